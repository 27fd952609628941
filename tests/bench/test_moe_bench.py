"""`llmserve bench moe` on its tiny preset: the two models have the same active
parameters per token, and every batch size gets both figures and their ratio."""

from __future__ import annotations

import json

import pytest

from llmserve.cli import main


def test_bench_moe_smoke(tmp_path, capsys):
    assert main(["--log-level", "WARNING", "bench", "moe", "--preset", "tiny", "--batch", "1", "3", "--context", "8",
                 "--steps", "2", "--output-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("moe-*.json")
    report = json.loads(path.read_text())
    moe, dense = report["models"]["moe"], report["models"]["dense"]
    shape = report["shape"]
    router = shape["num_hidden_layers"] * shape["experts"] * shape["hidden_size"]  # the MoE's one extra matrix
    assert moe["active_parameters"] == dense["parameters"] + router < moe["parameters"]
    assert report["dtype"] == "float32" and report["machine"]["cpu"]
    for batch in ("1", "3"):
        row = report["batches"][batch]
        assert row["moe_over_dense_time"] == pytest.approx(row["moe_step_ms"] / row["dense_step_ms"])
        assert row["moe_tok_per_s"] == pytest.approx(int(batch) / (row["moe_step_ms"] / 1000))
    assert "moe time / dense" in capsys.readouterr().out
