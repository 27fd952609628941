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
