"""A CPU step's layers in one C++ call (models/cpu_decoder_stack.py) compute what the
eager layers compute, bit for bit, in every projection layout, for decode, prefill and
mixed steps; steps and models it does not take run eagerly, and say why at load."""

from __future__ import annotations

import logging

import pytest
import torch

from llmserve.kernels import cpu as cpu_kernels
from llmserve.worker.config import RunnerConfig
from llmserve.worker.layers.int8_weight import W8A8_BLOCK
from llmserve.worker.layers.packed_weight import (BFLOAT16_GEMM_ENV, FLOAT32_GEMM_ENV, bfloat16_gemm, float32_gemm,
                                                  mkl_packing_available, onednn_packing_available, tiles_available)
from llmserve.worker.model_runner import ModelRunner
from llmserve.worker.models.cpu_decoder_stack import DENSE, ENV, MKL, ONEDNN, TILES, TILES_SILU_MUL

from tests.tiny_models import make_tiny_model, make_tiny_moe_model, make_tiny_window_model

from .conftest import PlanDriver

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="the CPU kernels cannot be built here")

BLOCK = 4


def _runner(model_dir, dtype="float32", quantization="none") -> ModelRunner:
    return ModelRunner(model_dir, RunnerConfig(dtype=dtype, quantization=quantization, block_size=BLOCK,
                                               num_kv_blocks=64, max_model_len=128, swap_space=0))


class BothPaths:
    """Runs each forward of the runner's decoder twice, eagerly and through the stack, and
    keeps both hidden outputs (the KV slots the two write hold the same values)."""

    def __init__(self, runner: ModelRunner):
        self.decoder = runner.model.model
        self.stack = self.decoder.cpu_decoder_stack
        assert self.stack is not None
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.stack_runs = 0
        forward, run = type(self.decoder).forward, self.stack.run

        def counted_run(*args):
            self.stack_runs += 1
            return run(*args)

        def both(input_ids, positions, kv_caches, meta, intermediate=None):
            self.decoder.cpu_decoder_stack = None
            eager = forward(self.decoder, input_ids, positions, kv_caches, meta, intermediate)
            self.decoder.cpu_decoder_stack = self.stack
            runs = self.stack_runs
            fused = forward(self.decoder, input_ids, positions, kv_caches, meta, intermediate)
            if self.stack_runs > runs:
                self.pairs.append((eager, fused))
            return fused

        self.stack.run = counted_run
        self.decoder.forward = both


# head_dim 32: the bfloat16 prefill kernel's products need a multiple of 32 (else prefill
# rows take the SDPA fallback, and their steps run eagerly); every projection a multiple
# of the W8A8 kernel's 16 channels and 64-column groups.
WIDE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


def _steps(runner: ModelRunner, decodes: int = 6) -> tuple[PlanDriver, int, int]:
    """Three prompts prefilled together, decode steps of all three (batch 3), a step that
    mixes their decodes with a fourth prompt's first chunk, then decodes of three (one
    finished). Returns the driver, the number of decode-only steps and of steps with
    prefill rows."""
    driver = PlanDriver(runner, BLOCK, 64)
    prompts = {"a": [5, 17, 33, 8, 250, 61, 7], "b": [9, 120, 44], "c": [3, 3, 71, 12, 199, 40, 41, 42, 43, 90, 11]}
    for rid, p in prompts.items():
        driver.add(rid, p)
    driver.step({rid: None for rid in prompts})
    for _ in range(decodes):
        driver.step({rid: 1 for rid in prompts})
    driver.add("d", [7, 8, 9, 10, 11, 12, 13, 14, 15])
    driver.step({"a": 1, "b": 1, "c": 1, "d": 5})
    driver.step({"a": 1, "b": 1, "c": 1, "d": None})
    for _ in range(2):
        driver.step({"a": 1, "c": 1, "d": 1}, finished=["b"] if "b" in prompts else ())
        prompts.pop("b", None)
    return driver, decodes + 2, 3


def _assert_same(both: BothPaths, runs: int) -> None:
    assert both.stack_runs == runs and len(both.pairs) == runs
    for eager, fused in both.pairs:
        assert fused.dtype == eager.dtype and fused.shape == eager.shape
        assert torch.equal(fused, eager), (fused - eager).abs().max()


def _expected_runs(runner: ModelRunner, decode_steps: int, prefill_steps: int) -> int:
    return decode_steps + (prefill_steps if runner.model.model.cpu_decoder_stack.prefill_in_kernel else 0)


@pytest.fixture
def layout(monkeypatch):
    """Sets a projection layout for one test (the choices are cached per process)."""

    def choose(env: str, kind: str) -> None:
        monkeypatch.setenv(env, kind)
        float32_gemm.cache_clear()
        bfloat16_gemm.cache_clear()

    yield choose
    monkeypatch.delenv(FLOAT32_GEMM_ENV, raising=False)
    monkeypatch.delenv(BFLOAT16_GEMM_ENV, raising=False)
    float32_gemm.cache_clear()
    bfloat16_gemm.cache_clear()


FLOAT32_LAYOUTS = ["dense"] + [k for k, ok in (("tiles", tiles_available(torch.float32)),
                                               ("mkl", mkl_packing_available()),
                                               ("onednn", onednn_packing_available())) if ok]
BFLOAT16_LAYOUTS = ["dense"] + [k for k, ok in (("tiles", tiles_available()),
                                                ("onednn", onednn_packing_available())) if ok]


@pytest.mark.parametrize("kind,tied", [("llama", True), ("qwen2", False)])  # qwen2: q/k/v biases
@pytest.mark.parametrize("dtype,gemm", [("float32", g) for g in FLOAT32_LAYOUTS] +
                         [("bfloat16", g) for g in BFLOAT16_LAYOUTS])
def test_the_stack_computes_what_the_eager_layers_compute(kind, tied, dtype, gemm, layout, tmp_path):
    layout(FLOAT32_GEMM_ENV if dtype == "float32" else BFLOAT16_GEMM_ENV, gemm)
    runner = _runner(make_tiny_model(tmp_path, kind, tied, seed=3, **WIDE), dtype)
    stack = runner.model.model.cpu_decoder_stack
    kind = {"dense": DENSE, "tiles": TILES, "onednn": ONEDNN, "mkl": MKL}[gemm]
    # On AMX the bfloat16 tiles' gate_up products also apply SiLU·mul (in both paths).
    fused = dtype == "bfloat16" and gemm == "tiles" and cpu_kernels.amx_supported()
    assert set(stack.kinds[2::4]) == {TILES_SILU_MUL if fused else kind}
    assert set(stack.kinds[0::4] + stack.kinds[1::4] + stack.kinds[3::4]) == {kind}
    assert stack.prefill_in_kernel == (dtype == "float32" or cpu_kernels.prefill_bf16_dot_supported())
    both = BothPaths(runner)
    _, decodes, prefills = _steps(runner)
    _assert_same(both, _expected_runs(runner, decodes, prefills))


@pytest.mark.skipif(not cpu_kernels.w8a8_supported(), reason="the W8A8 kernel needs AVX-512 VNNI")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_stack_runs_w8a8_int8_projections(dtype, tmp_path):
    runner = _runner(make_tiny_model(tmp_path, "qwen2", False, seed=4, **WIDE), dtype, "int8")
    assert set(runner.model.model.cpu_decoder_stack.kinds) == {0} and WIDE["hidden_size"] % W8A8_BLOCK == 0
    both = BothPaths(runner)
    _, decodes, prefills = _steps(runner)
    _assert_same(both, _expected_runs(runner, decodes, prefills))


def test_partial_rotary_and_longrope_layers_run_in_the_stack(tmp_path):
    # Phi-3: rotary on 12 of each head's 16 dims, LongRoPE tables (float32: its prefill
    # attention takes the C++ kernel at any head size).
    runner = _runner(make_tiny_model(tmp_path, "phi3", False, seed=7))
    both = BothPaths(runner)
    _, decodes, prefills = _steps(runner)
    _assert_same(both, _expected_runs(runner, decodes, prefills))


def test_windowed_layers_run_in_the_stack(tmp_path):
    runner = _runner(make_tiny_window_model(tmp_path, "mistral", seed=2))
    assert runner.model.model.cpu_decoder_stack.windows == [8] * 3
    both = BothPaths(runner)
    _, decodes, prefills = _steps(runner, decodes=10)  # the longest prompt leaves the 8-token window
    _assert_same(both, _expected_runs(runner, decodes, prefills))


def test_greedy_tokens_are_the_eager_ones(tmp_path, monkeypatch):
    model = make_tiny_model(tmp_path, "llama", True, seed=5)
    with_stack, _, _ = _steps(_runner(model), decodes=12)
    monkeypatch.setenv(ENV, "0")
    eager_runner = _runner(model)
    assert eager_runner.model.model.cpu_decoder_stack is None
    eager, _, _ = _steps(eager_runner, decodes=12)
    for rid in ("a", "b", "c", "d"):
        assert with_stack.outputs(rid) == eager.outputs(rid) and len(eager.outputs(rid)) >= 3


@pytest.mark.skipif(not tiles_available(), reason="this CPU has no AVX-512 BF16 (the bfloat16 prefill kernel's)")
def test_steps_with_prefill_rows_the_kernel_does_not_take_run_eagerly(tmp_path):
    # head_dim 16 in bfloat16: prefill rows take one SDPA each (TorchPagedAttention).
    runner = _runner(make_tiny_model(tmp_path, "llama", True, seed=6), "bfloat16")
    assert not runner.model.model.cpu_decoder_stack.prefill_in_kernel
    both = BothPaths(runner)
    driver = PlanDriver(runner, BLOCK, 64)
    driver.add("a", [5, 6, 7, 8, 9])
    driver.add("b", [10, 11, 12, 13, 14, 15, 16, 17])
    driver.step({"a": None})  # a prefill
    driver.step({"a": 1, "b": 3})  # a decode beside a prefill chunk
    assert both.stack_runs == 0
    driver.step({"a": 1, "b": None})
    driver.step({"a": 1, "b": 1})  # decodes only
    assert both.stack_runs == 1


@pytest.mark.parametrize("kind,reason", [("qwen3", "(sandwich or q/k norms)"), ("gemma2", "(sandwich or q/k norms)"),
                                         ("gemma", "(OffsetRMSNorm norms)")])
def test_other_layers_keep_the_eager_path_and_say_why(kind, reason, tmp_path, caplog):
    make = (lambda d: make_tiny_model(d, "gemma", True, seed=1)) if kind == "gemma" else (
        lambda d: make_tiny_window_model(d, kind, seed=1))
    with caplog.at_level(logging.INFO, logger="llmserve.worker.models.cpu_decoder_stack"):
        runner = _runner(make(tmp_path))
    assert runner.model.model.cpu_decoder_stack is None
    assert any(reason in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_mixture_of_experts_layers_keep_the_eager_path(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="llmserve.worker.models.cpu_decoder_stack"):
        runner = _runner(make_tiny_moe_model(tmp_path, "mixtral", seed=1))
    assert runner.model.model.cpu_decoder_stack is None
    mlp = type(runner.model.model.layers[0].mlp).__name__
    assert any(f"({mlp} MLPs)" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
