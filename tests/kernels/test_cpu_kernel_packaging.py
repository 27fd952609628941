"""A non-editable install (the worker's Docker image: `pip install ./kernels`) ships every
file the CPU kernels' build reads: sources and the headers they include; and they build."""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import tomllib
from pathlib import Path

import pytest

from llmserve.kernels import cpu as cpu_kernels

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
CSRC = KERNELS / "llmserve" / "kernels" / "cpu" / "csrc"


def _shipped_patterns() -> list[str]:
    config = tomllib.loads((KERNELS / "pyproject.toml").read_text())
    return config["tool"]["setuptools"]["package-data"]["llmserve.kernels.cpu"]


def test_every_file_the_build_reads_is_package_data():
    patterns = _shipped_patterns()
    files = sorted(p.name for p in CSRC.iterdir() if p.is_file())
    assert any(name.endswith(".h") for name in files)  # (the check below covers headers)
    missing = [name for name in files if not any(fnmatch.fnmatch(f"csrc/{name}", p) for p in patterns)]
    assert not missing, f"not in kernels/pyproject.toml's package-data: {missing}"


def test_every_local_include_is_a_file_beside_the_sources():
    for source in CSRC.glob("*.cpp"):
        for header in re.findall(r'#include "([^"]+)"', source.read_text()):
            assert (CSRC / header).is_file(), f"{source.name} includes {header}, which csrc/ lacks"


@pytest.mark.skipif(shutil.which("c++") is None or os.environ.get("LLMSERVE_DISABLE_CPU_KERNELS") == "1",
                    reason="no C++ compiler here (or the kernels are switched off): the plain torch ops run")
def test_the_kernels_build_wherever_a_compiler_is():
    # The kernel tests skip themselves when the kernels are unavailable (a host without a
    # compiler): a source that stopped compiling must fail here, not skip ninety tests.
    assert cpu_kernels.load(), "the CPU kernels did not build (see the warning above for the compiler's error)"
