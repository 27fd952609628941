"""The model catalog the supported-models page is generated from names exactly the
architectures the worker registers, each in one family."""

from __future__ import annotations

from collections import Counter

from llmserve.worker.models.catalog import FAMILIES, family_of
from llmserve.worker.models.registry import supported_architectures


def test_every_registered_architecture_is_in_one_family_and_no_other_is():
    listed = Counter(a for f in FAMILIES for a in f.architectures)
    assert [a for a, n in listed.items() if n > 1] == []
    assert sorted(listed) == supported_architectures()
    for architecture in supported_architectures():
        family = family_of(architecture)
        assert family is not None and family.examples and family.features, architecture
