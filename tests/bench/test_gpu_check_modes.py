"""The GPU self-check's bench modes run through device-generic code: on the CPU here
(tiny random model), on CUDA under `-m gpu`. And its summary judges the targets."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from llmserve.bench import flops
from llmserve.bench.clock import best_rate, now
from llmserve.bench.decode_graphs import compare_decode, graph_and_eager_runners
from llmserve.bench.flops import ModelFlops, measure_matmul_peak, measure_memory_bandwidth
from llmserve.bench.kv_sizing import check_kv_sizing
from llmserve.bench.random_model import PRESETS, make_random_model, parameter_shapes
from llmserve.kernels import cpu as cpu_kernels
from llmserve.worker.config import RunnerConfig
from llmserve.worker.layers.packed_weight import onednn_packing_available
from tests.script_modules import load_script

gpu_summary = load_script("gpu_summary")  # scripts/gpu_summary.py, which gpu_check.sh runs last

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def tiny_random_model(tmp_path_factory):
    return make_random_model(tmp_path_factory.mktemp("random-tiny"), "tiny", seed=3)


def test_the_1b_preset_has_llama_3_2_1b_s_parameter_count():
    from transformers import LlamaConfig

    config = LlamaConfig(**PRESETS["llama-1b"])
    shapes = parameter_shapes(config)
    assert "lm_head.weight" not in shapes  # Tied: stored once, as the embedding.
    assert sum(math.prod(s) for s in shapes.values()) == 1_235_814_400
    flops = ModelFlops.from_config(config)
    assert flops.lm_head_params == 2048 * 128256
    assert flops.linear_params == 16 * (2048 * 64 * (32 + 2 * 8) + 2048**2 + 3 * 2048 * 8192)


def test_the_random_model_is_an_hf_checkpoint(tiny_random_model):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    made = tiny_random_model
    with safe_open(f"{made['dir']}/model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.norm.weight").eq(1).all()  # Norm gains are ones, not random.
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
        assert abs(f.get_tensor("model.layers.0.mlp.up_proj.weight").float().std().item() - 0.02) < 0.003
    assert "lm_head.weight" not in names and made["parameters"] == 106_816
    hf = AutoModelForCausalLM.from_pretrained(made["dir"], dtype=torch.float32)
    assert set(hf.state_dict()) - names == {"lm_head.weight"}  # Only the tied head is not stored.
    assert json.loads((Path(made["dir"]) / "random-model.json").read_text()) == made


def test_decode_comparison_runs_both_modes_over_one_copy_of_the_weights(tiny_random_model):
    # float32 named: --dtype auto could take this bfloat16 checkpoint's own dtype on a CPU with BF16.
    runners = graph_and_eager_runners(tiny_random_model["dir"], RunnerConfig(device="cpu", dtype="float32"), 2, 16, 8)
    assert runners["eager"].model is runners["graphs"].model
    assert runners["graphs"].graphs is None  # No CUDA graphs on the CPU: both run eagerly.
    result = compare_decode(tiny_random_model["dir"], RunnerConfig(device="cpu", dtype="float32"), [1, 2], context=16,
                            steps=4, mixed=(8, 2))
    assert result["device"] == "cpu" and result["dtype"] == "float32" and not result["uses_graphs"]
    assert sorted(result["batches"]) == [1, 2]
    for batch, row in result["batches"].items():
        assert row["graphs_tok_per_s"] == pytest.approx(batch * 1000 / row["graphs_step_ms"])
        assert row["graphs_over_eager"] == pytest.approx(row["eager_step_ms"] / row["graphs_step_ms"])
    mixed = result["mixed"]  # A step of an 8-token prefill beside 2 decodes, in both modes.
    assert (mixed["chunk"], mixed["decodes"], mixed["uses_piecewise"]) == (8, 2, False)
    assert mixed["graphs_over_eager"] == pytest.approx(mixed["eager_step_ms"] / mixed["graphs_step_ms"])


def test_the_compile_pass_leaves_a_fresh_engine_on_the_same_runner(tiny_random_model):
    from llmserve.bench.step_records import RecordingEngine
    from llmserve.bench.throughput import compile_pass, run_in_process
    from llmserve.bench.workloads import random_workload
    from llmserve.launcher.engine import InProcessEngine
    from llmserve.scheduler.config import SchedulerConfig

    scheduling = SchedulerConfig()
    engine = RecordingEngine(InProcessEngine.from_model_dir(tiny_random_model["dir"], device="cpu",
                                                            num_kv_blocks=64).runner, scheduling)
    requests = random_workload(3, (20, 40), (3, 5), 512, seed=2)
    fresh = compile_pass(engine, requests, scheduling)
    assert fresh is not engine and fresh.runner.runner is engine.runner.runner and not fresh.steps
    assert fresh.runner.batch.states == {}  # The pass's requests are gone from the runner.
    result = run_in_process(fresh, requests)
    # Its prompts all ran before, but this scheduler has never seen them: the one hit is
    # run_in_process's own 16-token warm-up prompt, request 0's first block (its 16
    # queried tokens count too).
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    assert result["prefix_cache_hit_rate"] == pytest.approx(16 / (prompt_tokens + 16))
    assert result["output_tokens"] == sum(r.output_len for r in requests)


def test_kv_sizing_on_the_cpu_takes_its_explicit_budget(tiny_random_model):
    budget = 8 * 2**20
    result = check_kv_sizing(tiny_random_model["dir"], RunnerConfig(device="cpu", dtype="float32",
                                                                    kv_cache_memory=budget, swap_space=0,
                                                                    max_num_batched_tokens=64))
    # tiny: 2 layers x K and V x 16 tokens x 2 KV heads x head_dim 16 x 4 bytes (float32).
    assert result["block_bytes"] == 2 * 2 * 16 * 2 * 16 * 4
    assert result["num_kv_blocks"] == budget // result["block_bytes"]
    assert result["kv_bytes"] == result["kv_bytes_allocated"] and result["fits_bytes"] == budget
    assert any(line.startswith("# KV blocks: 1024") for line in result["log_lines"])
    assert result["smoke"] == {"prompt_tokens": 64, "output_tokens": 4, "activation_peak_bytes": None}


def test_matmul_peak_and_bandwidth_on_the_cpu():
    assert measure_matmul_peak(torch.float32, size=256, seconds=0.05, device="cpu") > 1e8
    assert measure_memory_bandwidth(nbytes=2**24, seconds=0.05, device="cpu") > 1e8
    calls = []
    rate = best_rate(lambda: calls.append(now("cpu")), 10, "cpu", seconds=0.01, reps=3)
    assert rate > 0 and (len(calls) - 1) % 3 == 0  # One warm-up call, then samples of 3.


@pytest.mark.skipif(not onednn_packing_available(), reason="this torch cannot pack a weight for oneDNN")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_matmul_peak_is_the_faster_of_torch_mm_and_onednn(dtype, monkeypatch):
    """torch.mm alone understated AMD hosts' float32 peak 2.3x: both products are timed
    and the faster one counts."""
    timed = []

    def fake_rate(work, amount, device, seconds, reps=1):
        timed.append((work().shape, work().dtype, amount))  # the product a sample would time
        return [5e11, 2e12][len(timed) - 1]  # torch.mm's, then oneDNN's

    monkeypatch.setattr(flops, "best_rate", fake_rate)
    assert measure_matmul_peak(dtype, size=64, seconds=0.02, device="cpu") == 2e12
    assert timed == [((64, 64), dtype, 2 * 64**3)] * 2


@pytest.mark.skipif(not cpu_kernels.w8a8_supported(), reason="no AVX-512 VNNI: no W8A8 kernel")
def test_cpu_matmul_peak_under_w8a8_times_int8_products(monkeypatch):
    """Under W8A8 the products run in int8 (~2x bfloat16's rate): its peak is int8's, from
    our kernel and torch's int8 matmul, not the activations' dtype's."""
    timed = []

    def fake_rate(work, amount, device, seconds, reps=1):
        timed.append(work().dtype)
        return 1e12 * len(timed)

    monkeypatch.setattr(flops, "best_rate", fake_rate)
    peak = measure_matmul_peak(torch.bfloat16, size=64, seconds=0.02, device="cpu", quantization="int8")
    # our W8A8 kernel (bfloat16 out), then torch._int_mm (int32 out)
    assert timed == [torch.bfloat16, torch.int32] and peak == 2e12


@pytest.mark.gpu
@needs_cuda
def test_matmul_peak_and_bandwidth_on_cuda():
    peak = measure_matmul_peak(torch.bfloat16, seconds=0.5, device="cuda")
    bandwidth = measure_memory_bandwidth(nbytes=2**28, seconds=0.5, device="cuda")
    # Any GPU worth benchmarking on beats these by far; a timing without synchronisation
    # (launch time only) would report absurd figures above the second bound.
    assert 1e13 < peak < 1e16 and 1e11 < bandwidth < 1e14


@pytest.mark.gpu
@needs_cuda
def test_decode_comparison_captures_graphs_on_cuda(tiny_random_model):
    result = compare_decode(tiny_random_model["dir"], RunnerConfig(device="cuda", dtype="bfloat16"), [1, 4],
                            context=16, steps=8, mixed=(16, 3))
    assert result["uses_graphs"] and result["device"].startswith("cuda") and result["dtype"] == "bfloat16"
    assert result["mixed"]["uses_piecewise"] and result["mixed"]["graphs_step_ms"] > 0
    assert all(row["graphs_tok_per_s"] > 0 and row["eager_tok_per_s"] > 0 for row in result["batches"].values())


# --- The summary's judgement, on reports shaped like the benches' own. ---------------------

STEPS = ("install", "verify", "make-model", "offline-1b", "decode-floor-1b", "loops", "profile", "gpu-tests",
         "make-model-8b", "offline-8b", "decode-floor-8b", "host-cpu", "kv-sizing", "decode", "throughput")


def _offline_report(device: str, model: str, share: float) -> dict:
    ceiling = {"seconds": 2.42, "compute_s": 2.42, "memory_s": 1.45, "bound": "compute",
               "output_tokens_per_s": 52_875.0, "formula": "ceiling_s = max(compute_s, memory_s)"}
    result = lambda: {"seconds": 2.42 / share, "requests_per_s": 1000 * share / 2.42,  # noqa: E731
                      "output_tokens_per_s": 52_875.0 * share, "total_tokens_per_s": 475_876.0 * share,
                      "share_of_ceiling": share, "num_steps": 200, "num_preemptions": 0}
    return {"device": device, "model": model, "workload": {"num_prompts": 1000, "input_len": 1024, "output_len": 128},
            "matmul_peak_gflop_per_s": 989e3, "memory_bandwidth_gb_per_s": 3350.0, "ceiling": ceiling,
            "results": {"greedy": result(), "sampled": result()}}


def _decode_floor_report(device: str, model: str, share: float) -> dict:
    return {"device": device, "model": model, "context": 1024, "uses_graphs": device != "cpu",
            "memory_bandwidth_gb_per_s": 3350.0, "batches": {
                str(b): {"step_ms": 0.75 * b / share, "tok_per_s": 1000 * share / 0.75, "floor_ms": 0.75 * b,
                         "bound": "memory", "share_of_floor": share} for b in (1, 8, 64, 256)}}


def _loops_report(device: str, ratio: float) -> dict:
    rows = lambda rate: {"64": {"steady_tokens_per_s": rate}}  # noqa: E731
    return {"device": device, "model": "llama-1b", "transport": "mutual TLS",
            "loops": {"serial": rows(10_000.0), "pipelined": rows(10_000.0 * ratio)},
            "pipelined_over_serial": {"64": ratio}}


def _write_results(tmp_path, device: str, graphs_over_eager: float, engine_over_hf: float, kv_over_fits: float,
                   failures: int = 0, offline_share: float = 0.6, floor_share: float = 0.7,
                   pipelined_over_serial: float = 1.5, piecewise_over_eager: float = 1.3):
    machine = {"cuda": "NVIDIA H100" if device != "cpu" else None, "cuda_version": "12.8", "torch": "2.11.0",
               "python": "3.12.3", "git_revision": "abc1234", "date": "2026-11-25 12:00:00"}
    (tmp_path / "steps.tsv").write_text("".join(f"{s}\t0\t5\n" for s in STEPS) + "total\t0\t70\n")
    (tmp_path / "gpu-tests.xml").write_text(
        f'<testsuites><testsuite tests="10" failures="{failures}" errors="0" skipped="1">'
        + "".join(f'<testcase classname="tests.t" name="f{i}"><failure/></testcase>' for i in range(failures))
        + "</testsuite></testsuites>")
    (tmp_path / "host-cpu.xml").write_text('<testsuites><testsuite tests="216" failures="0" errors="0" skipped="0">'
                                           '</testsuite></testsuites>')
    (tmp_path / "random-model.json").write_text(json.dumps({
        "preset": "llama-1b", "dtype": "bfloat16", "parameters": 1_235_814_400, "bytes": 2_471_628_800,
        "shape": {"hidden_size": 2048, "num_hidden_layers": 16, "vocab_size": 128256}}))
    (tmp_path / "random-model-8b.json").write_text(json.dumps({
        "preset": "llama-8b", "dtype": "bfloat16", "parameters": 8_030_261_248, "bytes": 16_060_522_496,
        "shape": {"hidden_size": 4096, "num_hidden_layers": 32, "vocab_size": 128256}}))
    reports = {
        "kv-sizing": {"device": device, "num_kv_blocks": 1000, "block_bytes": 2**19, "kv_bytes": 1000 * 2**19,
                      "fits_bytes": 1000 * 2**19 / kv_over_fits, "kv_over_fits": kv_over_fits},
        "decode": {"device": device, "uses_graphs": device != "cpu", "batches": {
            str(b): {"graphs_tok_per_s": 100.0 * b * graphs_over_eager, "eager_tok_per_s": 100.0 * b,
                     "graphs_over_eager": graphs_over_eager} for b in (1, 2, 4, 8)},
            "mixed": {"chunk": 256, "decodes": 63, "uses_piecewise": device != "cpu", "graphs_step_ms": 4.0,
                      "eager_step_ms": 4.0 * piecewise_over_eager, "graphs_over_eager": piecewise_over_eager}},
        "throughput": {"device": device, "dtype": "bfloat16", "rounds": 3, "workload": {"name": "reference"},
                       "matmul_peak_gflop_per_s": 700e3, "memory_bandwidth_gb_per_s": 3000.0, "results": {
                           "engine": {"output_tokens_per_s": 100.0 * engine_over_hf, "mfu": 0.05,
                                      "roofline_fraction": 0.3, "roofline_floor_seconds": 0.3, "seconds": 1.0},
                           "hf": {"output_tokens_per_s": 100.0, "engine_over_this": engine_over_hf,
                                  "engine_over_this_median": engine_over_hf, "batch_size": 16}}},
    }
    for size in ("1b", "8b"):
        reports[f"offline-{size}"] = _offline_report(device, f"llama-{size}", offline_share)
        reports[f"decode-floor-{size}"] = _decode_floor_report(device, f"llama-{size}", floor_share)
    reports["loops"] = _loops_report(device, pipelined_over_serial)
    reports["profile"] = {"reports": [
        {"batch": b, "context": 256, "step_s": 0.002 * b, "uses_graphs": device != "cpu",
         "families_s": {"matmul": 0.001, "attention (paged decode)": 0.0005 * b, "copies": 0.0001}}
        for b in (8, 64)] + [
        {"prompt_len": 1024, "prompts": 16, "step_s": 0.08, "uses_graphs": False,
         "families_s": {"matmul": 0.05, "attention (prefill)": 0.02, "copies": 0.001}}]}
    for folder, report in reports.items():
        (tmp_path / folder).mkdir()
        (tmp_path / folder / f"{folder}-20261125.json").write_text(json.dumps({**report, "machine": machine}))


def _results(rows) -> dict[str, str]:
    return {row.check: row.result for row in rows}


def test_summary_passes_a_run_that_meets_every_target(tmp_path, capsys):
    _write_results(tmp_path, "cuda:0", graphs_over_eager=2.0, engine_over_hf=4.0, kv_over_fits=0.98)
    assert gpu_summary.main([str(tmp_path)]) == 0
    results = _results(gpu_summary.summarize(tmp_path))
    assert results["CUDA graphs >= 1.5x eager, batch 8"] == "PASS"
    assert results["engine >= 3x HF generate (reference workload)"] == "PASS"
    assert results["KV blocks within 5% of what fits"] == "PASS"
    assert results["offline llama-8b, 1000 x 1024/128, sampled >= 50% of the ceiling"] == "PASS"
    assert results["decode llama-1b, context 1024, batch 1 >= 60% of the floor"] == "PASS"
    assert results["pipelined loop >= 1.3x serial, batch 64"] == "PASS"
    assert results["piecewise graphs faster than eager, mixed step"] == "PASS"
    assert results["CPU kernel tests on the host's CPU"] == "PASS"
    assert set(results.values()) == {"PASS", "INFO"} and len(results) == 29
    out = capsys.readouterr().out
    assert out.startswith("GPU self-check on NVIDIA H100") and "PASSED: 0 of 29 rows failed" in out
    profile = {row.check: row.figure for row in gpu_summary.summarize(tmp_path)}["decode step profile, batch 64"]
    # 64 x 0.5 ms of attention against 1 ms of matmul and 0.1 ms of copies: shares of 33.1 ms.
    assert profile == ("128.00 ms a step (CUDA graphs, context 256); kernel time 33.10 ms: attention (paged decode) "
                       "97%, matmul 3%, copies 0%")
    figures = {row.check: row.figure for row in gpu_summary.summarize(tmp_path)}
    prefill = figures["prefill step profile, 16 x 1024 tokens"]
    assert prefill == ("80.00 ms a step (eager, whole prompts); kernel time 71.00 ms: matmul 70%, "
                       "attention (prefill) 28%, copies 1%")
    assert (tmp_path / "summary.md").read_text().strip() == out.strip()


def test_summary_fails_each_missed_target(tmp_path):
    _write_results(tmp_path, "cuda:0", graphs_over_eager=1.2, engine_over_hf=2.5, kv_over_fits=0.90, failures=2)
    assert gpu_summary.main([str(tmp_path)]) == 1
    rows = {row.check: row for row in gpu_summary.summarize(tmp_path)}
    failed = {check for check, row in rows.items() if row.result == "FAIL"}
    assert failed == {"GPU tests (pytest -m gpu)", "KV blocks within 5% of what fits",
                      "engine >= 3x HF generate (reference workload)",
                      *(f"CUDA graphs >= 1.5x eager, batch {b}" for b in (1, 2, 4, 8))}
    assert rows["GPU tests (pytest -m gpu)"].figure == "7 passed, 2 failed, 1 skipped: tests.t::f0, tests.t::f1"


def test_summary_fails_each_missed_gpu_target_of_issue_31(tmp_path):
    _write_results(tmp_path, "cuda:0", graphs_over_eager=2.0, engine_over_hf=4.0, kv_over_fits=1.0,
                   offline_share=0.45, floor_share=0.55, pipelined_over_serial=1.25, piecewise_over_eager=0.9)
    assert gpu_summary.main([str(tmp_path)]) == 1
    rows = {row.check: row for row in gpu_summary.summarize(tmp_path)}
    failed = {check for check, row in rows.items() if row.result == "FAIL"}
    assert failed == {*(f"offline llama-{size}, 1000 x 1024/128, {mode} >= 50% of the ceiling"
                        for size in ("1b", "8b") for mode in ("greedy", "sampled")),
                      *(f"decode llama-{size}, context 1024, batch 1 >= 60% of the floor" for size in ("1b", "8b")),
                      "pipelined loop >= 1.3x serial, batch 64", "piecewise graphs faster than eager, mixed step"}
    assert rows["piecewise graphs faster than eager, mixed step"].figure == (
        "256-token prefill + 63 decodes: 4.00 vs 3.60 ms a step = 0.90x")
    assert rows["pipelined loop >= 1.3x serial, batch 64"].figure == (
        "steady decode 12,500 vs 10,000 tok/s = 1.25x (llama-1b, through gRPC with mutual TLS)")
    assert rows["offline llama-1b, 1000 x 1024/128, greedy >= 50% of the ceiling"].figure == (
        "185.95 req/s, 23,794 output / 214,144 total tok/s = 45.0% (5.4 s, 200 steps, 0 preemptions)")
    # The other batch sizes are figures, not targets.
    assert rows["decode llama-1b, context 1024, batch 8 / 64 / 256: share of the floor"].result == "INFO"


def test_summary_fails_a_crashed_host_cpu_step_and_keeps_the_gpu_tests_row(tmp_path):
    # The CPU kernels' tests run apart from the GPU tests: a crash there (no JUnit report,
    # SIGSEGV's exit code) fails its own row only.
    _write_results(tmp_path, "cuda:0", graphs_over_eager=2.0, engine_over_hf=4.0, kv_over_fits=1.0)
    (tmp_path / "host-cpu.xml").unlink()
    (tmp_path / "steps.tsv").write_text((tmp_path / "steps.tsv").read_text().replace("host-cpu\t0", "host-cpu\t139"))
    rows = {row.check: row for row in gpu_summary.summarize(tmp_path)}
    assert rows["CPU kernel tests on the host's CPU"] == gpu_summary.Row(
        "CPU kernel tests on the host's CPU", "FAIL", "exited 139: see logs/host-cpu.log")
    assert rows["GPU tests (pytest -m gpu)"].result == "PASS"
    assert [r.check for r in rows.values() if r.result == "FAIL"] == ["CPU kernel tests on the host's CPU"]


def test_summary_skips_what_only_or_the_budget_left_out(tmp_path):
    _write_results(tmp_path, "cuda:0", graphs_over_eager=2.0, engine_over_hf=4.0, kv_over_fits=1.0)
    for folder in ("offline-8b", "profile"):
        for report in (tmp_path / folder).iterdir():
            report.unlink()
    steps = (tmp_path / "steps.tsv").read_text()
    (tmp_path / "steps.tsv").write_text(steps.replace("offline-8b\t0\t5", "offline-8b\tbudget\t0")
                                        .replace("profile\t0\t5", "profile\tonly\t0"))
    rows = {row.check: row for row in gpu_summary.summarize(tmp_path)}
    assert rows["offline-8b: >= 50% of the physical ceiling"] == gpu_summary.Row(
        "offline-8b: >= 50% of the physical ceiling", "SKIP", "not run: the time budget (--budget) ran out first")
    assert rows["decode step profile"].figure == "not run: --only left it out"
    assert rows["time (seconds)"].figure.startswith("70 in all; install 5, verify 5, make-model 5, offline-1b 5, ")
    assert "offline-8b" not in rows["time (seconds)"].figure and gpu_summary.main([str(tmp_path)]) == 0


def test_summary_of_a_cpu_dry_run_skips_the_performance_targets(tmp_path):
    _write_results(tmp_path, "cpu", graphs_over_eager=1.0, engine_over_hf=1.4, kv_over_fits=1.0)
    results = _results(gpu_summary.summarize(tmp_path))
    assert results["CUDA graphs >= 1.5x eager, batch 1"] == "SKIP"
    assert results["engine >= 3x HF generate (reference workload)"] == "SKIP"
    assert results["KV blocks within 5% of what fits"] == "PASS"
    assert results["offline llama-1b, 1000 x 1024/128, greedy >= 50% of the ceiling"] == "SKIP"
    assert results["decode llama-8b, context 1024, batch 1 >= 60% of the floor"] == "SKIP"
    assert results["pipelined loop >= 1.3x serial, batch 64"] == "SKIP"
    assert gpu_summary.main([str(tmp_path)]) == 0


def test_summary_fails_a_step_that_left_no_report(tmp_path):
    _write_results(tmp_path, "cuda:0", graphs_over_eager=2.0, engine_over_hf=4.0, kv_over_fits=1.0)
    (tmp_path / "decode" / "decode-20261125.json").unlink()
    (tmp_path / "steps.tsv").write_text((tmp_path / "steps.tsv").read_text().replace("decode\t0", "decode\t124"))
    rows = {row.check: row for row in gpu_summary.summarize(tmp_path)}
    assert rows["CUDA graphs vs eager decode"].result == "FAIL"
    assert rows["CUDA graphs vs eager decode"].figure == "timed out: see logs/decode.log"


def test_kv_sizing_keeps_the_worker_s_own_budget_and_asks_for_one_on_the_cpu(tiny_random_model, capsys, tmp_path):
    """Other benches cap the KV cache at 1 GiB; kv-sizing checks the worker's own sizing,
    so on CUDA it must profile (no cap), and on the CPU an explicit budget is required."""
    from llmserve.cli import main

    code = main(["bench", "kv-sizing", "--model", str(tiny_random_model["dir"]), "--device", "cpu",
                 "--output-dir", str(tmp_path)])
    assert code == 2 and "pass --kv-cache-memory" in capsys.readouterr().out
    assert main(["bench", "kv-sizing", "--model", str(tiny_random_model["dir"]), "--device", "cpu",
                 "--dtype", "float32", "--kv-cache-memory", "4MiB", "--swap-space", "0",
                 "--output-dir", str(tmp_path)]) == 0
    assert "fits after start-up: 0.004 GiB" in capsys.readouterr().out


def test_whole_step_profile_sums_each_family_per_step(tiny_random_model):
    """The CUDA mode of `bench profile`, run here on the CPU: whole engine steps timed, then
    each operator family's time per profiled step."""
    from llmserve.bench.profile_step import decoding_engine, profile_whole_steps

    engine = decoding_engine(tiny_random_model["dir"], "float32", 3, 20, max_new_tokens=40, device="cpu")
    report = profile_whole_steps(engine, steps=4)
    assert report["device"] == "cpu" and not report["uses_graphs"] and report["step_s"] > 0
    families = report["families_s"]
    assert families["matmul"] > 0 and families["attention (paged decode)"] > 0
    # Per step: 4 profiled steps of 3 rows, each step 2 layers x 1 paged-attention call.
    rows = {row["name"]: row for row in report["top_rows"]}
    assert rows["llmserve_cpu::paged_attention_decode"]["calls"] == 2
    assert sum(families.values()) < 5 * report["step_s"]


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_prefill_profile_runs_whole_prompts_that_end_in_their_step(tiny_random_model, pipelined):
    """`bench profile --prefill-len`: each profiled step carries step_tokens // L whole
    prompts of L tokens, and every prompt ends in the step that prefills it; in the
    pipelined loop (CUDA's) too, where one step's seats left every other plan empty."""
    from llmserve.bench.profile_step import prefilling_engine, profile_whole_steps

    engine = prefilling_engine(tiny_random_model["dir"], "float32", 24, 100, steps=3 + 2 * 2, device="cpu",
                               pipelined=pipelined)
    assert engine.pipelined == pipelined
    plans = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    report = profile_whole_steps(engine, steps=2)
    assert len(plans) == 7  # 3 warm-up, 2 timed, 2 profiled
    for plan in plans:  # 4 prompts of 24 tokens a step (100 // 24), each in full
        assert [r.num_scheduled_tokens for r in plan.new_requests] == [24] * 4 and not plan.cached_requests
    families = report["families_s"]
    assert families["matmul"] > 0 and families["attention (prefill)"] > 0
    assert len({r.seq_id for plan in plans for r in plan.new_requests}) == 7 * 4  # each prefilled once
    assert len(engine.scheduler.running) == (4 if pipelined else 0)  # each ended in its step (the last in flight)
    assert engine.scheduler.has_unfinished_requests()  # 2 steps' prompts left: the engine never ran dry


def test_profile_families_name_every_kernel_of_ours():
    from llmserve.bench.profile_step import CUDA_FAMILIES, _family

    for op in ("llmserve_cpu::bf16_linear", "llmserve_cpu::w8a8_linear", "mkldnn::_linear_pointwise", "aten::mm"):
        assert _family(op) == "matmul", op
    assert _family("llmserve_cpu::silu_and_mul") == "fused element-wise (C++)"
    assert _family("llmserve_cpu::decoder_layers") == "the C++ layer loop (between its ops)"
    assert _family("llmserve_cpu::paged_attention_prefill") == "attention (prefill)"
    assert _family("llmserve_cpu::paged_attention_decode") == "attention (paged decode)"
    cuda = {"_decode_kernel": "attention (paged decode)", "_decode_reduce_kernel": "attention (paged decode)",
            "_varlen_kernel": "attention (prefill)", "nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT": "matmul",
            "_reshape_and_cache_kernel": "KV cache write", "_rms_norm_kernel": "norms, rotary, activation"}
    for kernel, family in cuda.items():
        assert _family(kernel, CUDA_FAMILIES) == family, kernel
