"""`llmserve bench overhead`: a smoke run through a real cluster (TLS, simulated 1 ms
device step), and its per-phase arithmetic."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys

import pytest

from llmserve.bench.overhead import LOOPS, expected_tokens, scenarios, settled_snapshot, steady_state
from llmserve.bench.overhead_phases import PHASES, format_table, phase_figures

MAX_TOKENS = 16


def test_smoke_every_phase_is_measured_and_the_tokens_are_the_simulated_ones(tmp_path):
    out = subprocess.run([sys.executable, "-m", "llmserve.cli", "--log-level", "WARNING", "bench", "overhead",
                          "--simulated-step-ms", "1", "--batches", "1", "8", "--max-tokens", str(MAX_TOKENS),
                          "--output-dir", str(tmp_path)], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "| step ms |" in out.stdout and "transport" in out.stdout and "router CPU" in out.stdout
    (path,) = tmp_path.glob("overhead-*.json")
    report = json.loads(path.read_text())
    loops = ["pipelined" if p else "serial" for p in LOOPS]
    assert report["settings"]["loops"] == loops and report["machine"]["cpu"]
    assert [(r["loop"], r["scenario"]) for r in report["results"]] == [
        (loop, name) for loop in loops for name in ("decode-1", "decode-8", "mixed-8+prefill")]
    for r in report["results"]:
        f = r["figures"]
        assert r["tokens_ok"] and r["bad_requests"] == 0
        # Every decoding request ran MAX_TOKENS steps at least (its prompt took one more).
        assert f["steps"] >= MAX_TOKENS and f["plans"] >= 1
        assert 0 < f["device_busy"] <= 1
        assert f["device_s"] == pytest.approx(f["steps"] * 0.001)
        for phase in PHASES:
            assert math.isfinite(f["host_ms_per_step"][phase]) and f["host_ms_per_step"][phase] >= 0, phase
        # Host work the step path cannot skip: each of these is measured, not defaulted.
        for phase in ("schedule", "encode", "transport", "prepare", "update", "dispatch"):
            assert f["host_ms_per_step"][phase] > 0, phase
        # From a result to the next plan written: measured by the pipelined loop only.
        if r["loop"] == "pipelined":
            assert 0 < f["critical_ms"] < f["wall_ms_per_step"] * 10, f["critical_ms"]
        else:
            assert math.isnan(f["critical_ms"])
    # Each process's CPU per step (clock ticks: a short scenario may read 0 for one of them).
    cpu = [r["figures"]["cpu_ms_per_step"] for r in report["results"]]
    assert all(set(c) == {"router", "scheduler", "worker", "client"} for c in cpu)
    assert all(math.isfinite(v) and v >= 0 for c in cpu for v in c.values())
    assert sum(c["client"] for c in cpu) > 0 and sum(sum(c.values()) for c in cpu) > 0
    mixed = [r for r in report["results"] if r["scenario"].startswith("mixed")]
    assert all(r["figures"]["mixed_steps"] >= 1 for r in mixed)  # Prefill chunks did ride with decodes.
    decode8 = next(r for r in report["results"] if r["scenario"] == "decode-8")
    assert decode8["output_tokens"] == 8 * MAX_TOKENS
    assert 0 < decode8["figures"]["steady_busy"] <= 1 and decode8["figures"]["steady_steps"] < MAX_TOKENS
    # The in-process engine over the same simulated device: both loops at each batch, its
    # tokens the simulated ones; a step takes the device's 1 ms at least.
    assert "in process" in out.stdout
    assert [(r["loop"], r["batch"]) for r in report["in_process"]] == [
        (loop, b) for b in (1, 8) for loop in ("serial", "pipelined")]
    assert all(r["tokens_ok"] and 1.0 <= r["wall_ms_per_step"] and 0 < r["busy"] <= 1 for r in report["in_process"])


def test_steady_state_counts_steps_while_every_decoder_runs():
    # Decoder a starts at t=0, b at t=2 (a partial batch before); a ends at 10, b at 12.
    a = [(float(t), 1) for t in range(0, 11)]
    b = [(float(t), 1) for t in range(2, 13)]
    window = steady_state([a, b], step_ms=500.0)
    assert window["steady_window_s"] == 8.0  # from b's first token to a's last
    assert window["steady_steps"] == 8.0  # tokens at 3..10 each
    assert window["steady_busy"] == pytest.approx(0.5 * 8 / 8)
    # Tokens held back and sent 4 at a time count as the steps that made them.
    chunked = steady_state([[(0.0, 1), (4.0, 4), (8.0, 4)], [(0.0, 1), (4.0, 4), (8.0, 4), (9.0, 3)]], 1000.0)
    assert chunked["steady_steps"] == 8.0 and chunked["steady_busy"] == pytest.approx(1.0)
    assert steady_state([[(1.0, 1)], []], 1.0)["steady_window_s"] == 0.0


def test_a_snapshot_waits_for_the_worker_to_write_every_plan_the_scheduler_sent(tmp_path):
    """Two equal reads of a worker file that lags (its writer thread late on busy cores)
    are not a settled snapshot: the scenario's steps would read 0."""
    (tmp_path / "scheduler.json").write_text(json.dumps({"plans": 5.0, "schedule": 0.1}))
    (tmp_path / "worker.json").write_text(json.dumps({"plans": 3.0, "steps": 3.0}))

    async def snapshot_while_the_worker_catches_up():
        async def catch_up():
            await asyncio.sleep(0.6)
            (tmp_path / "worker.json").write_text(json.dumps({"plans": 5.0, "steps": 5.0}))

        writer = asyncio.create_task(catch_up())
        scheduler, worker = await settled_snapshot(tmp_path)
        await writer
        return scheduler, worker

    scheduler, worker = asyncio.run(snapshot_while_the_worker_catches_up())
    assert scheduler["plans"] == worker["plans"] == 5.0 and worker["steps"] == 5.0


def test_phases_come_from_the_two_services_snapshots():
    before = ({"schedule": 1.0, "encode": 0.1, "round_trip": 2.0, "update": 0.5, "dispatch": 0.2}, {"steps": 10})
    after = ({"schedule": 1.1, "encode": 0.12, "round_trip": 2.5, "update": 0.55, "dispatch": 0.22,
              "critical": 0.03, "critical_steps": 60},
             {"steps": 110, "plans": 100, "encode": 0.03, "execute": 0.4, "queued": 0.01, "prepare": 0.05,
              "sync": 0.01, "device": 0.2})
    f = phase_figures((before[0], after[0]), (before[1], after[1]), step_ms=2.0, wall_s=0.5)
    assert f["steps"] == 100 and f["device_busy"] == pytest.approx(0.4)
    ms = f["host_ms_per_step"]
    assert ms["schedule"] == pytest.approx(1.0) and ms["encode"] == pytest.approx(0.5)
    # The round trip less both ends' protobuf work, the worker's execute time and its queue wait.
    assert ms["transport"] == pytest.approx((0.5 - 0.02 - 0.03 - 0.4 - 0.01) * 10)
    assert f["host_ms_per_step_total"] == pytest.approx(sum(ms.values()))
    assert f["critical_ms"] == pytest.approx(0.5)  # Per step it was measured for, not per step run.
    assert math.isnan(phase_figures((before[0], before[0]), (before[1], after[1]), 2.0, 0.5)["critical_ms"])
    table = format_table([{"step_ms": 2.0, "loop": "serial", "scenario": "x", "figures": f, "tokens_ok": True,
                           "bad_requests": 0}])
    assert "transport" in table and "router CPU" in table  # (no CPU figures here: dashes)
    f["cpu_ms_per_step"] = {"router": 1.5, "scheduler": 0.5, "worker": 0.25, "client": 0.75}
    cpu_table = format_table([{"step_ms": 2.0, "loop": "serial", "scenario": "x", "figures": f, "tokens_ok": True,
                               "bad_requests": 0}]).split("\n\n")[1]
    cells = [cell.strip() for cell in cpu_table.splitlines()[-1].split("|")[4:9]]
    assert cells == ["1.500", "0.500", "0.250", "0.750", "3.000"]  # router, scheduler, worker, client, all


def test_scenarios_and_the_expected_chain():
    todo = scenarios([1, 64], prompt_len=8, max_tokens=32)
    assert [s.name for s in todo] == ["decode-1", "decode-64", "mixed-64+prefill"]
    assert todo[-1].prefills >= 4 and todo[-1].prefill_len > todo[-1].prompt_len
    chain = expected_tokens([5, 6], 3, vocab_size=50, eos=frozenset())
    assert len(chain) == 3 and chain == expected_tokens([9, 6], 3, vocab_size=50, eos=frozenset())
