"""Fixtures shared by every test folder."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.tiny_models import VARIANTS, make_tiny_model


@pytest.fixture(scope="session", params=list(VARIANTS))
def tiny_model_dir(request, tmp_path_factory) -> Path:
    kind, tied = VARIANTS[request.param]
    return make_tiny_model(tmp_path_factory.mktemp(request.param), kind, tied)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llama_runner"), "llama", True, seed=1)


@pytest.fixture(scope="session")
def credentials(tmp_path_factory):
    """A cluster's credentials (CA, a certificate per role, an API key), made once."""
    from llmserve.certs import write_credentials

    return write_credentials(tmp_path_factory.mktemp("credentials"))


@pytest.fixture(scope="session")
def foreign_credentials(tmp_path_factory):
    """The same set from another CA: the cluster must refuse its certificates."""
    from llmserve.certs import write_credentials

    return write_credentials(tmp_path_factory.mktemp("foreign-credentials"))


@pytest.fixture(scope="session")
def node_example() -> Path:
    """examples/node with its locked dependencies installed (@llmserve/api copied from protos/)."""
    npm = shutil.which("npm")
    assert npm, "npm is missing: the Node client example and package need Node.js 18+ with npm"
    example = Path(__file__).resolve().parent.parent / "examples" / "node"
    subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=example, check=True, timeout=300)
    return example
