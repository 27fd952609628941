"""`bench structured`, run tiny: it prints the plain requests' TPOT in both batches and
their ratio, and its report says the constrained request beside them left their greedy
tokens unchanged and produced the schema's JSON."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_bench_structured_smoke(tmp_path):
    out = subprocess.run([sys.executable, "-m", "llmserve.cli", "--log-level", "WARNING", "bench", "structured",
                          "--batch", "4", "--context", "8", "--output-len", "6", "--rounds", "2", "--dtype",
                          "float32", "--kv-cache-memory", "64MiB", "--output-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    printed = dict(re.findall(r"(tpot_plain_ms|tpot_mixed_ms|ratio)=([\d.]+)", out.stdout))
    assert set(printed) == {"tpot_plain_ms", "tpot_mixed_ms", "ratio"}, out.stdout
    (path,) = tmp_path.glob("structured-*.json")
    report = json.loads(path.read_text())
    assert float(printed["ratio"]) == pytest.approx(report["ratio"], abs=1e-3)
    assert report["tpot_plain_ms"] > 0 and report["tpot_mixed_ms"] > 0 and len(report["rounds_ratio"]) == 2
    assert report["same_plain_tokens"] is True and report["batch"] == 4
    assert report["constrained_output"].startswith('{') and '"story"' in report["constrained_output"]
    assert report["load"]["cpus"] >= 1
