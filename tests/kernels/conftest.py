"""Kernel tests. Without CUDA they run Triton's interpreter on CPU tensors: TRITON_INTERPRET
must be set before the kernels are decorated (at import), and while they launch. It is
set here, the kernels imported, and the variable restored at once, so other test folders
(and the processes they spawn) never see it; an autouse fixture sets it again around each
test of this folder. With CUDA, kernels compile for the GPU and tests run there: every test
of this folder is then marked `gpu` (`pytest -m gpu` runs them all), and the kernels'
dtype parametrizations add bfloat16 (helpers.DTYPES). Except the CPU kernels' tests
(test_cpu_*.py): CPU tests wherever they run. The GPU self-check runs them apart on the
GPU host's CPU (its host-cpu step), so that a fault in the host's CPU path cannot end the
GPU tests' run (a segfault in test_cpu_amx did, on an H200 host, 2026-11-28)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

INTERPRET = not torch.cuda.is_available()
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

_prev = os.environ.get("TRITON_INTERPRET")
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"
try:
    import llmserve.kernels.triton  # noqa: E402,F401  (decorated now: interpreted on CPU)
    from llmserve.kernels.triton import paged_attention as _pa  # noqa: E402
finally:
    if _prev is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _prev

if INTERPRET and type(_pa._decode_kernel).__name__ != "InterpretedFunction":
    raise RuntimeError("llmserve.kernels was imported before tests/kernels/conftest.py set TRITON_INTERPRET=1")


_HERE = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # before `-m gpu` deselects what is not marked yet
def pytest_collection_modifyitems(config, items):
    """With CUDA, this folder's tests but the CPU kernels' are the GPU kernel checks: mark
    them `gpu`. (A conftest's hook sees every collected item: only this folder's are marked.)"""
    if INTERPRET:
        return
    for item in items:
        if _HERE in item.path.parents and not item.path.name.startswith("test_cpu_"):
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch):
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    return DEVICE

