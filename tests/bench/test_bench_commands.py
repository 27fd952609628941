"""Smoke runs of `llmserve bench throughput` and `llmserve bench serve` on a small
workload: the reports carry their fields, and greedy tokens agree across the engine,
the gRPC stack and HF transformers."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

# NOTE: float32 said outright: HF's tokens are float32's, and `auto` serves the embedded
# Q4_1 GGUF on the int8 or bfloat16 path (worker/cpu_dtype.py).
SMALL = ["--workload", "random", "--num-requests", "6", "--input-len", "8", "40", "--output-len", "4", "12",
         "--kv-cache-memory", "128MiB", "--dtype", "float32"]


def run_cli(args: list[str], tmp_path) -> dict:
    out = subprocess.run([sys.executable, "-m", "llmserve.cli", "--log-level", "WARNING", *args,
                          "--output-dir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    reports = list(tmp_path.glob("*.json"))
    assert len(reports) == 1 and len(list(tmp_path.glob("*.png"))) == 1
    return json.loads(reports[0].read_text())


@pytest.mark.slow
def test_bench_throughput_smoke(tmp_path):
    report = run_cli(["bench", "throughput", *SMALL, "--through-grpc", "--grpc-security", "both", "--baseline", "hf",
                      "--repeat", "2"], tmp_path)
    assert report["workload"]["num_requests"] == 6
    assert report["machine"]["torch"] and report["machine"]["git_revision"] is not None
    isa = report["machine"]["cpu_matrix_isa"]
    assert set(isa) <= {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16",
                        "amx_int8"}
    cpuinfo = open("/proc/cpuinfo").read().replace("\n", " ")
    for flag in ("avx512f", "avx512_vnni"):
        assert (flag in isa) == (f" {flag} " in cpuinfo)
    family, model = re.search(r"cpu family\s*:\s*(\d+)", cpuinfo), re.search(r" model\s*:\s*(\d+)", cpuinfo)
    expected = f"family {family[1]} model {model[1]}" if family else None
    assert report["machine"]["cpu_family_model"] == expected
    engine, grpc_run, hf = (report["results"][k] for k in ("engine", "grpc", "hf"))
    assert engine["output_tokens"] == report["workload"]["output_tokens"] == hf["output_tokens"]
    # Two interleaved rounds; each system reports its median round and every round's figure.
    assert report["rounds"] == 2
    for run in (engine, grpc_run, hf):
        assert len(run["rounds_output_tokens_per_s"]) == 2 and run["output_tokens_per_s"] in run["rounds_output_tokens_per_s"]
    # Ratios to the engine pair each round with that round's engine run.
    engine_rounds = engine["rounds_output_tokens_per_s"]
    for run in (grpc_run, hf):
        paired = [e / r for e, r in zip(engine_rounds, run["rounds_output_tokens_per_s"])]
        assert run["rounds_engine_over_this"] == pytest.approx(paired)
        assert run["engine_over_this_median"] == pytest.approx(sum(paired) / 2)
    assert 0 < engine["mfu"] < 1 and 0 < engine["kv_utilisation"] <= 1
    # Utilisation cannot beat its block-granularity ceiling; the roofline floor is real time.
    assert engine["kv_utilisation"] <= engine["kv_utilisation_bound"] + 1e-9
    assert engine["roofline_floor_seconds"] > 0 and 0 < engine["mfu_at_roofline"] <= 1
    # Bounding products and attention apart, then adding, can only raise the floor (equal
    # where one resource bounds both: then only the float rounding of the sums differs).
    assert engine["layerwise_floor_seconds"] >= engine["roofline_floor_seconds"] * (1 - 1e-9)
    # The device was probed before the rounds and after them; the best probe is the ceiling.
    probes = report["probes"]
    assert len(probes) == 2
    assert report["matmul_peak_gflop_per_s"] == max(p["matmul_peak_gflop_per_s"] for p in probes) > 0
    assert report["memory_bandwidth_gb_per_s"] == max(p["memory_bandwidth_gb_per_s"] for p in probes) > 0
    assert engine["mfu"] == pytest.approx(engine["achieved_gflop_per_s"] / report["matmul_peak_gflop_per_s"])
    assert engine["peak_blocks_in_use"] > 0
    # Greedy: the same tokens whichever way they were produced.
    assert grpc_run["same_tokens_as_engine"] == 1.0
    assert hf["same_tokens_as_engine"] == 1.0
    # --grpc-security both: every round ran the cluster over TLS and over plaintext too,
    # and the TLS cost pairs the two by round.
    plain = report["results"]["grpc-insecure"]
    assert plain["same_tokens_as_engine"] == 1.0 and len(plain["rounds_output_tokens_per_s"]) == 2
    # One cluster per security mode served both rounds, each round under its own cache salt:
    # a round finds cached only the one 16-token block its warm-up request (the first
    # prompt's first 16 tokens) left, never the previous round's prompts (they would hit:
    # the prompts hold more than one whole block each on average).
    assert report["workload"]["prompt_tokens"] > 6 * 16
    assert grpc_run["rounds_cached_prompt_tokens"] == plain["rounds_cached_prompt_tokens"] == [16, 16]
    assert report["tls_cost_rounds"] == pytest.approx(
        [p / t for p, t in zip(plain["rounds_output_tokens_per_s"], grpc_run["rounds_output_tokens_per_s"])])


@pytest.mark.slow
def test_bench_serve_smoke(tmp_path):
    report = run_cli(["bench", "serve", "--launch", *SMALL, "--request-rate", "8", "--repeat", "2",
                      "--stream-interval", "3"], tmp_path)
    m = report["metrics"]
    # Two rounds, each paired with its own in-process step; the figures are the median one's
    # (of two: the lower).
    assert report["rounds"] == 2 and len(m["rounds_tpot_median_over_decode_step"]) == 2
    assert m["tpot_median_over_decode_step"] == min(m["rounds_tpot_median_over_decode_step"])
    # Each round's terms: their ratio is that round's cluster ÷ in-process factor.
    assert [c / i for c, i in zip(m["rounds_cluster_decode_step_ms"], m["rounds_in_process_step_ms"])] == \
        pytest.approx(m["rounds_online_decode_step_over_in_process"])
    assert m["completed"] == 6 and m["failed"] == 0
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert 0 < m[name]["median"] <= m[name]["p99"]
    assert m["output_token_throughput"] > 0 and m["request_throughput"] > 0
    # The cluster's step totals over the run: every token of the workload was computed
    # once, in a decode step or in a step with prompt tokens (the last sampled token of
    # each request never is; random prompts give no prefix-cache hits).
    e, w = m["engine_steps"], report["workload"]
    assert e["num_decode_steps"] > 0 and e["num_prefill_steps"] > 0
    computed = e["num_decode_steps"] * e["decode_batch"] + e["num_prefill_steps"] * e["prefill_step_tokens"]
    assert round(computed) == w["prompt_tokens"] + w["output_tokens"] - w["num_requests"]
    assert 1 <= e["decode_batch"] <= 6 and 0 < e["decode_step_worker_ms"] < e["decode_step_ms"]
    # Per token (TPOT's weighting) the batch is at least the per-step mean.
    assert e["decode_batch"] <= e["decode_batch_per_token"] <= 6 and e["decode_step_ms_per_token"] > 0
    by_batch = {int(b): v for b, v in e["decode_by_batch"].items()}  # JSON keys are strings
    assert sum(v["steps"] for v in by_batch.values()) == e["num_decode_steps"]
    assert sum(v["token_share"] for v in by_batch.values()) == pytest.approx(1.0)
    assert 0 < e["prefill_time_share"] < 1
    # --stream-interval 3 reached the cluster: after each request's first token, up to 3
    # tokens per message (outputs of 4-12 tokens: 1 + 3 + 3 + ... ).
    assert 1.5 < m["tokens_per_message"] <= 3
    # Each process's CPU over the run, per step: the worker's holds its compute.
    cpu = e["cpu"]["ms_per_step"]
    assert set(cpu) == {"router", "scheduler", "worker", "client"} and min(cpu.values()) > 0
    assert cpu["worker"] > max(cpu["router"], cpu["scheduler"])
    # --launch: TPOT is set against in-process decode steps at the batch sizes the
    # cluster's decode steps ran, mixed by their share of the decoded tokens; the
    # cluster's own steps are mixed with the same weights.
    d = m["decode_step_ms"]
    assert 0 < m["mean_concurrency"] <= 6 and d["batch"] == pytest.approx(e["decode_batch_per_token"])
    timed = {int(b): ms for b, ms in d["at_batch"].items()}
    weights = {int(b): w for b, w in d["weights"].items()}
    assert set(timed) == set(weights) <= set(by_batch) and sum(weights.values()) == pytest.approx(1.0)
    assert min(timed.values()) <= d["mean"] <= max(timed.values()) and m["tpot_median_over_decode_step"] > 0
    assert d["mean"] == pytest.approx(sum(w * timed[b] for b, w in weights.items()))
    assert d["cluster_mean"] == pytest.approx(sum(w * by_batch[b]["ms"] for b, w in weights.items()))
    assert m["tpot_median_over_decode_step"] == pytest.approx(
        m["online_decode_step_over_in_process"] * m["tpot_median_over_online_decode_step"])


def test_batches_to_time_cover_most_tokens():
    from llmserve.bench.step_compare import batches_to_time

    shares = {1: 0.10, 2: 0.40, 3: 0.30, 4: 0.15, 5: 0.05}
    assert batches_to_time(shares) == pytest.approx({1: 0.10 / 0.95, 2: 0.40 / 0.95, 3: 0.30 / 0.95,
                                                      4: 0.15 / 0.95})
    assert batches_to_time(shares, most=2) == pytest.approx({2: 0.4 / 0.7, 3: 0.3 / 0.7})
    assert batches_to_time({7: 1.0}) == {7: 1.0}


def test_bench_serve_grpc_security_both_pairs_tls_with_plaintext_rounds(tmp_path, monkeypatch):
    """--grpc-security both: every round runs a TLS and a plaintext cluster, in turns
    first, and the report pairs them round by round. (The rounds are stand-ins here: the
    launched clusters of both kinds run for real in the throughput smoke.)"""
    from llmserve.bench import load, serve
    from llmserve.bench.cli import run_bench
    from llmserve.cli import build_parser

    ran = []

    def fake_round(model_dir, requests, args, insecure=False, backends=("grpc",)):
        ran.append(insecure)
        tpot = 0.010 if insecure else 0.011  # TLS: 10% slower per token
        timing = load.RequestTiming(8, start=0.0, end=0.05 + 4 * tpot)
        timing.token_times = timing.delta_times = [0.05 + i * tpot for i in range(5)]
        return {"grpc": load.compute_metrics([timing], duration=1.0)}

    monkeypatch.setattr(serve, "serve_round", fake_round)
    args = build_parser().parse_args(["bench", "serve", "--launch", *SMALL, "--repeat", "2", "--grpc-security",
                                      "both", "--output-dir", str(tmp_path)])
    args.argv = ["llmserve", "bench", "serve"]
    assert run_bench(args) == 0
    assert ran == [False, True, True, False]
    report = json.loads(next(tmp_path.glob("serve-*.json")).read_text())
    assert report["grpc_security"] == "both" and report["rounds"] == 2
    assert report["metrics"]["tpot_ms"]["median"] == pytest.approx(11.0)
    assert report["metrics_insecure"]["tpot_ms"]["median"] == pytest.approx(10.0)
    assert report["tls_cost"]["tpot_median_tls_over_plaintext"] == pytest.approx([1.1, 1.1])
    assert report["tls_cost"]["output_tok_s_plaintext_over_tls"] == pytest.approx([1.0, 1.0])


def test_bench_serve_backend_both_pairs_grpc_with_openai_on_one_cluster(tmp_path, monkeypatch):
    """--backend both: every round drives one cluster over gRPC and over the OpenAI API,
    in turns first, and the report pairs them round by round. (Stand-in rounds: the
    OpenAI client's real run is in tests/e2e/test_openai_api.py.)"""
    from llmserve.bench import load, serve
    from llmserve.bench.cli import run_bench
    from llmserve.cli import build_parser

    orders = []

    def fake_round(model_dir, requests, args, insecure=False, backends=("grpc",)):
        orders.append(backends)
        out = {}
        for backend in backends:
            tpot = 0.0105 if backend == "openai" else 0.010  # HTTP: 5% slower per token
            timing = load.RequestTiming(8, start=0.0, end=0.05 + 4 * tpot)
            timing.token_times = timing.delta_times = [0.05 + i * tpot for i in range(5)]
            out[backend] = load.compute_metrics([timing], duration=1.0)
        return out

    monkeypatch.setattr(serve, "serve_round", fake_round)
    args = build_parser().parse_args(["bench", "serve", "--launch", *SMALL, "--repeat", "2", "--backend", "both",
                                      "--output-dir", str(tmp_path)])
    args.argv = ["llmserve", "bench", "serve"]
    assert run_bench(args) == 0
    assert orders == [("grpc", "openai"), ("openai", "grpc")]
    report = json.loads(next(tmp_path.glob("serve-*.json")).read_text())
    assert report["backend"] == "both" and report["rounds"] == 2
    assert report["metrics"]["tpot_ms"]["median"] == pytest.approx(10.0)
    assert report["metrics_openai"]["tpot_ms"]["median"] == pytest.approx(10.5)
    assert report["openai_cost"]["tpot_median_openai_over_grpc"] == pytest.approx([1.05, 1.05])


def test_bench_serve_backend_both_needs_launch():
    from llmserve.bench.cli import run_bench
    from llmserve.cli import build_parser

    args = build_parser().parse_args(["bench", "serve", *SMALL, "--backend", "both"])
    args.argv = ["llmserve", "bench", "serve"]
    with pytest.raises(SystemExit, match="--backend both needs --launch"):
        run_bench(args)


def test_bench_serve_times_the_in_process_step_with_the_cluster_quantization(monkeypatch):
    # The cluster served int8: the in-process step it is set against must be int8 too.
    from llmserve.bench import profile_step, step_compare
    from llmserve.bench.workloads import BenchRequest

    seen = {}

    def fake_time_decode_steps(model_dir, dtype, batches, context, steps, quantization="none"):
        seen.update(dtype=dtype, quantization=quantization)
        return {b: 0.01 for b in batches}

    monkeypatch.setattr(profile_step, "time_decode_steps", fake_time_decode_steps)
    metrics = {"mean_concurrency": 2.0, "tpot_ms": {"median": 20.0}}
    requests = [BenchRequest(prompt_token_ids=[1] * 10, output_len=4)]
    step_compare.compare_with_decode_step(metrics, "model", "bfloat16", requests, "int8")
    assert seen == {"dtype": "bfloat16", "quantization": "int8"}
    assert metrics["tpot_median_over_decode_step"] == pytest.approx(2.0)


def test_the_ceilings_are_the_best_of_the_probes_and_every_rounds_floor_uses_them(monkeypatch):
    # A probe during a neighbour's burst reads low; a floor from it would overstate every
    # round's share of it, so the floors wait for the probe after the rounds.
    import torch

    from llmserve.bench import throughput

    readings = iter([(1e12, 20e9), (2e12, 10e9)])
    monkeypatch.setattr(throughput, "measure_matmul_peak", lambda *a, **k: current[0])
    monkeypatch.setattr(throughput, "measure_memory_bandwidth", lambda *a, **k: current[1])
    run = throughput._Run(None, None, [], torch.device("cpu"), torch.float32, "none", [])
    for _ in range(2):
        current = next(readings)
        run.probe()
    assert (run.peak, run.bandwidth) == (2e12, 20e9) and run.probes == [(1e12, 20e9), (2e12, 10e9)]
