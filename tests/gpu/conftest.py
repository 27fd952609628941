"""The worker on a CUDA device (`pytest -m gpu`): CUDA graphs vs eager, HF equivalence in
float32 / bfloat16 / float16, a three-process cluster, swaps and copy-on-write on the
device, tensor parallelism over NCCL. Every test here is marked `gpu` and skipped where
torch sees no CUDA device.

LLMSERVE_TEST_GPU_DEVICE=cpu runs them on the CPU instead: a check of the tests' own logic
(plans, padding sizes, tie rules, the cluster's flags) on a machine without a GPU. What
exists on CUDA only (graph replays, the pinned swap pool, float16, NCCL) is then not
asserted, or the test skips; the float16 cases skip (the worker refuses float16 on CPU).
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from tests.tiny_models import make_tiny_model

GPU_DEVICE_ENV = "LLMSERVE_TEST_GPU_DEVICE"


def _device() -> torch.device:
    name = os.environ.get(GPU_DEVICE_ENV, "cuda")
    if name not in ("cuda", "cpu"):
        raise ValueError(f"{GPU_DEVICE_ENV}={name!r}: expected 'cuda' or 'cpu'")
    return torch.device(name)


DEVICE = _device()  # where these tests run the worker: CUDA unless told otherwise
ON_CUDA = DEVICE.type == "cuda"
needs_cuda = pytest.mark.skipif(ON_CUDA and not torch.cuda.is_available(),
                                reason="needs a CUDA device (torch.cuda.is_available() is False)")
# Every module here: `pytestmark = GPU`.
GPU = [pytest.mark.gpu, needs_cuda]

# kind -> (tied embeddings, seed): the architectures the worker serves (tests/tiny_models.py)
KINDS = {"llama": (True, 1), "qwen2": (False, 2), "gemma": (True, 3)}


def on_device(dtype: torch.dtype) -> None:
    """Skip what the device under test cannot run: float16 is CUDA only in the worker."""
    if dtype == torch.float16 and not ON_CUDA:
        pytest.skip("float16 runs on CUDA only (the worker refuses it on the CPU)")


@pytest.fixture(scope="session")
def gpu_models(tmp_path_factory) -> dict[str, Path]:
    """kind -> a tiny random-weight checkpoint (float32 safetensors) of that architecture."""
    root = tmp_path_factory.mktemp("gpu-models")
    return {kind: make_tiny_model(root / kind, kind, tied, seed=seed) for kind, (tied, seed) in KINDS.items()}


@pytest.fixture(autouse=True)
def _release_device_memory():
    """Runners hold KV caches and graph pools: give their memory back between tests."""
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
