"""The float32 CPU weight layout is chosen by timing the layouts once per machine (our
tiles, MKL's, oneDNN's) and remembering it, not by the CPU's vendor name."""

from __future__ import annotations

import json

import torch

from llmserve.worker.layers import packed_weight


def test_the_faster_layout_is_chosen_and_remembered(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(packed_weight, "_time_float32_gemms", lambda: {"mkl": 0.5, "onednn": 2.0})
    assert packed_weight.measured_float32_gemm() == "mkl"
    (record,) = (tmp_path / "cpu-gemm").glob("float32-gemm-*.json")
    assert json.loads(record.read_text())["seconds"] == {"mkl": 0.5, "onednn": 2.0}
    # Later processes of this machine read the record: a noisier timing cannot flip it.
    monkeypatch.setattr(packed_weight, "_time_float32_gemms", lambda: {"mkl": 9.0, "onednn": 1.0})
    assert packed_weight.measured_float32_gemm() == "mkl"


def test_the_timing_runs_every_layout_here():
    times = packed_weight._time_float32_gemms()
    available = {k for k, ok in (("tiles", packed_weight.tiles_available(torch.float32)),
                                 ("mkl", packed_weight.mkl_packing_available()),
                                 ("onednn", packed_weight.onednn_packing_available())) if ok}
    assert set(times) == available and all(t > 0 for t in times.values())


def test_the_override_still_wins(monkeypatch):
    monkeypatch.setenv(packed_weight.FLOAT32_GEMM_ENV, "dense")
    packed_weight.float32_gemm.cache_clear()
    try:
        assert packed_weight.float32_gemm() == "dense"
    finally:
        packed_weight.float32_gemm.cache_clear()


def test_a_change_to_our_kernels_times_the_choice_again(tmp_path, monkeypatch):
    # A timing of our kernels belongs to the build it timed: edited sources measure anew.
    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(packed_weight.cpu_kernels, "source_key", lambda: "sources-a")
    monkeypatch.setattr(packed_weight, "_time_float32_gemms", lambda: {"mkl": 0.5, "onednn": 2.0})
    assert packed_weight.measured_float32_gemm() == "mkl"
    monkeypatch.setattr(packed_weight, "_time_float32_gemms", lambda: {"mkl": 9.0, "onednn": 1.0})
    assert packed_weight.measured_float32_gemm() == "mkl"  # the same build: remembered
    monkeypatch.setattr(packed_weight.cpu_kernels, "source_key", lambda: "sources-b")
    assert packed_weight.measured_float32_gemm() == "onednn"
    assert len(list((tmp_path / "cpu-gemm").glob("float32-gemm-*.json"))) == 2
