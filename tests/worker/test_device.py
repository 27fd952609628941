"""--device and --dtype: what `auto` resolves to, the errors, and that an explicit
`--device cpu` is today's CPU path (same tokens, same dtype)."""

from __future__ import annotations

import types

import pytest
import torch

from llmserve.worker.config import RunnerConfig
from llmserve.worker.cpu_dtype import choose_cpu_dtype
from llmserve.worker.device import model_dtype, resolve_device, resolve_dtype

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")


@no_cuda
def test_auto_is_the_cpu_without_a_gpu_and_cuda_is_refused_clearly():
    assert resolve_device("auto") == torch.device("cpu") == resolve_device("cpu", rank=3)
    with pytest.raises(ValueError, match="--device cuda: this process sees no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        resolve_device("tpu")


@pytest.mark.parametrize("saved, on_cuda", [("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                            ("float32", torch.float32), (None, torch.float32),
                                            (torch.bfloat16, torch.bfloat16), ("int8", torch.float32)])
def test_auto_dtype_is_the_checkpoints_own_on_cuda_and_float32_on_the_cpu_unless_bf16_pays(saved, on_cuda):
    config = types.SimpleNamespace(torch_dtype=saved)
    assert model_dtype(config) == on_cuda
    # resolve_dtype only reads the device's type: no GPU needed to check the CUDA rule.
    assert resolve_dtype("auto", torch.device("cuda", 0), config) == on_cuda
    # The CPU: float32, unless a bfloat16 checkpoint meets a CPU that runs it fast (cpu_dtype.py).
    on_cpu = choose_cpu_dtype(torch.bfloat16).dtype if on_cuda == torch.bfloat16 else torch.float32
    assert resolve_dtype("auto", torch.device("cpu"), config) == on_cpu


def test_explicit_dtypes_and_float16_only_on_cuda():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_dtype("bf16", cpu) == torch.bfloat16 and resolve_dtype("float32", cuda) == torch.float32
    assert resolve_dtype("float16", cuda) == torch.float16
    with pytest.raises(ValueError, match="float16 runs on CUDA only"):
        resolve_dtype("float16", cpu)
    with pytest.raises(ValueError, match="unsupported dtype 'float64'"):
        resolve_dtype("float64", cpu)


@no_cuda
def test_explicit_cpu_is_the_default_path(tiny_llama_dir):
    from llmserve.worker.model_runner import ModelRunner
    from tests.worker.conftest import PlanDriver

    tokens = {}
    for name, settings in {"default": RunnerConfig(num_kv_blocks=16, swap_space=0),
                           "explicit": RunnerConfig(num_kv_blocks=16, swap_space=0, device="cpu", dtype="float32",
                                                    enforce_eager=True)}.items():
        runner = ModelRunner(tiny_llama_dir, settings)
        assert runner.device == torch.device("cpu") and runner.dtype == torch.float32 and runner.graphs is None
        assert runner.info.device == "cpu" and runner.info.dtype == "float32" and not runner.info.cuda_graphs
        assert runner.kv_caches[0].device.type == "cpu" and not runner.kv_caches[0].is_pinned()
        drv = PlanDriver(runner, 16, 16, seed=0)
        drv.add("a", list(range(5, 30)))
        for _ in range(4):
            drv.step({"a": None})
        tokens[name] = drv.outputs("a")
    assert tokens["default"] == tokens["explicit"] and len(tokens["default"]) == 4
