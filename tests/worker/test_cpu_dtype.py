"""`--dtype auto` on the CPU: bfloat16 only for a bfloat16 checkpoint on a CPU with AMX or
AVX-512 BF16 where bfloat16 products measured faster, each refusal with its reason."""

from __future__ import annotations

import pytest
import torch

from llmserve.worker import cpu_dtype


@pytest.fixture
def machine(monkeypatch):
    def set_machine(flags: set[str], speedup: float) -> None:
        monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: flags)
        monkeypatch.setattr(cpu_dtype, "bf16_speedup", lambda: speedup)
    return set_machine


def test_a_float32_checkpoint_stays_float32(machine):
    machine({"avx512_bf16", "amx_bf16"}, 3.0)
    choice = cpu_dtype.choose_cpu_dtype(torch.float32)
    assert choice.dtype == torch.float32 and "the checkpoint is float32" in choice.reason


def test_bfloat16_needs_the_instruction_sets(machine):
    machine({"avx2", "avx512f"}, 3.0)
    choice = cpu_dtype.choose_cpu_dtype(torch.bfloat16)
    assert choice.dtype == torch.float32 and "neither AMX nor AVX-512 BF16" in choice.reason


def test_bfloat16_must_measure_faster(machine):
    machine({"avx512_bf16"}, 1.05)
    choice = cpu_dtype.choose_cpu_dtype(torch.bfloat16)
    assert choice.dtype == torch.float32 and "measured only 1.05x" in choice.reason


def test_bfloat16_where_it_pays(machine):
    machine({"avx512_bf16", "amx_bf16"}, 2.4)
    choice = cpu_dtype.choose_cpu_dtype(torch.bfloat16)
    assert choice.dtype == torch.bfloat16 and "amx_bf16/avx512_bf16" in choice.reason and "2.40x" in choice.reason


def test_the_measurement_times_both_dtypes_once_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path))
    first = cpu_dtype.bf16_speedup()
    assert first > 0
    assert len(list((tmp_path / "cpu-gemm").glob("bf16-vs-float32-*.json"))) == 1
    monkeypatch.setattr(cpu_dtype, "_time_bf16_vs_float32", lambda: {"speedup": -1.0})
    assert cpu_dtype.bf16_speedup() == first  # Remembered: later processes agree.


# A checkpoint stored quantized (a GGUF's Q4_1): int8 W8A8, bfloat16 or float32, the fastest.

@pytest.fixture
def w8a8(monkeypatch):
    def set_speedup(speedup: float) -> None:  # 0: the W8A8 kernel was not built here
        monkeypatch.setattr(cpu_dtype, "w8a8_speedup", lambda dtype: speedup)
    return set_speedup


def test_a_quantized_checkpoint_takes_int8_where_w8a8_measures_fastest(machine, w8a8):
    machine({"avx512_bf16"}, 2.3)
    w8a8(2.0)
    choice = cpu_dtype.choose_cpu_for_quantized("Q4_1")
    assert (choice.dtype, choice.quantization) == (torch.bfloat16, "int8")
    assert choice.reason.startswith("Q4_1 checkpoint: int8 weights and activations (W8A8 products measured "
                                    "2.00x bfloat16 here), bfloat16 (avx512_bf16;")


def test_a_quantized_checkpoint_takes_bfloat16_without_w8a8(machine, w8a8):
    machine({"avx512_bf16"}, 2.3)
    w8a8(0.0)
    choice = cpu_dtype.choose_cpu_for_quantized("Q8_0")
    assert (choice.dtype, choice.quantization) == (torch.bfloat16, None)
    assert "dequantized to bfloat16" in choice.reason and "no AVX-512 VNNI" in choice.reason


def test_a_quantized_checkpoint_takes_float32_where_neither_pays(machine, w8a8):
    machine({"avx2"}, 3.0)
    w8a8(1.05)
    choice = cpu_dtype.choose_cpu_for_quantized("Q4_K")
    assert (choice.dtype, choice.quantization) == (torch.float32, None)
    assert "neither AMX nor AVX-512 BF16" in choice.reason and "measured only 1.05x float32" in choice.reason


def test_auto_reads_the_storage_and_an_explicit_dtype_wins(machine, w8a8):
    from llmserve.worker.device import dtype_choice

    machine({"avx512_bf16"}, 2.3)
    w8a8(2.0)
    cpu = torch.device("cpu")
    assert dtype_choice("auto", cpu, None, "none", "Q4_1").quantization == "int8"
    assert dtype_choice("float32", cpu, None, "none", "Q4_1") == cpu_dtype.DtypeChoice(torch.float32, "--dtype")
    # Asked for int8 already: today's rule (bfloat16 activations), the quantization as asked.
    assert dtype_choice("auto", cpu, None, "int8", "Q4_1").quantization is None


def test_the_w8a8_measurement_is_remembered(tmp_path, monkeypatch):
    from llmserve.kernels import cpu as cpu_kernels

    if not cpu_kernels.w8a8_supported():
        assert cpu_dtype.w8a8_speedup(torch.bfloat16) == 0.0
        return
    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path))
    first = cpu_dtype.w8a8_speedup(torch.bfloat16)
    assert first > 0 and len(list((tmp_path / "cpu-gemm").glob("w8a8-vs-bfloat16-*.json"))) == 1
    monkeypatch.setattr(cpu_dtype, "_time_w8a8_vs", lambda dtype: {"speedup": -1.0})
    assert cpu_dtype.w8a8_speedup(torch.bfloat16) == first
