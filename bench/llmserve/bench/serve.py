"""`llmserve bench serve`: online load against a running cluster (vLLM `bench serve`
style), over the router's gRPC API or any OpenAI-compatible server's (--backend).
Requests arrive as a Poisson process at --request-rate (or all at once for `inf`), at
most --max-concurrency in flight; latencies are taken per streamed delta (load.py).
With --launch, TPOT is set against an in-process decode step at the cluster's batch
(see step_compare.py), in --repeat rounds paired run by run. The cluster's own
steps come from its trace spans (see step_spans.py): a launched cluster's scheduler and
worker append them to a span file of the benchmark's; with --target, --span-file names
the running cluster's (its LLMSERVE_SPAN_FILE)."""

from __future__ import annotations

import asyncio
import math
import statistics
import tempfile
import time
from pathlib import Path

from llmserve.bench.cli import GRPC_SECURITY
from llmserve.bench.load import compute_metrics, measured_load
from llmserve.bench.openai_backend import OpenAIClient
from llmserve.bench.report import machine_info, median_round, plot_latency, report_dir, write_json
from llmserve.bench.step_compare import cluster_steps, compare_with_decode_step
from llmserve.bench.workloads import BenchRequest, summary, workload_from_args

# With --target: how long after the run the cluster may take to append its last step span.
SPAN_SETTLE_S = 1.0
# --backend: the APIs a round drives, in order (both: on one cluster, alternating which goes first).
BACKENDS = {"grpc": ("grpc",), "openai": ("openai",), "both": ("grpc", "openai")}
DEFAULT_GRPC_TARGET = "localhost:50051"
DEFAULT_OPENAI_TARGET = "http://localhost:8000/v1"


def bench_serve(args) -> int:
    from llmserve.model_store import resolve_model_dir

    modes, backends = _modes_and_backends(args)
    model_dir = resolve_model_dir(args.model)
    requests = workload_from_args(args, model_dir)
    # (insecure, backend) -> rounds; with two of either, each round runs both, in turns first.
    by_run = run_rounds(model_dir, requests, args, modes, backends)
    report = serve_report(args, requests, modes, backends, by_run)
    out = report_dir(args.output_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if out is not None:
        write_json(report, out / f"serve-{args.workload}-{stamp}.json")
        if report["metrics"]["completed"]:
            plot_latency(report, out / f"serve-{args.workload}-{stamp}.png")
        print(f"wrote {out}/serve-{args.workload}-{stamp}.{{json,png}}")
    return 0 if all(r["failed"] == 0 for rounds in by_run.values() for r in rounds) else 1


def _modes_and_backends(args) -> tuple[tuple[bool, ...], tuple[str, ...]]:
    """The transports (insecure or not) and the APIs each round runs; SystemExit for a
    combination a run cannot serve."""
    if args.scheduler_target:
        raise SystemExit("bench serve: --scheduler-target is gone (the scheduler no longer reports step totals): "
                         "pass --span-file with the file the cluster's scheduler and worker append their "
                         "spans to (LLMSERVE_SPAN_FILE), or use --launch")
    modes = GRPC_SECURITY[args.grpc_security]
    backends = BACKENDS[args.backend]
    if len(modes) > 1 and not args.launch:
        raise SystemExit("bench serve: --grpc-security both needs --launch (a running cluster has one transport)")
    if len(backends) > 1 and (not args.launch or len(modes) > 1):
        raise SystemExit("bench serve: --backend both needs --launch (one cluster serving both APIs) and one "
                         "--grpc-security")
    return modes, backends


def run_rounds(model_dir, requests: list[BenchRequest], args, modes: tuple[bool, ...],
               backends: tuple[str, ...]) -> dict[tuple[bool, str], list[dict]]:
    """--repeat rounds of every (insecure, backend) run, two of either in turns first (so
    that neither always runs on the machine the other just warmed)."""
    by_run: dict[tuple[bool, str], list[dict]] = {(insecure, b): [] for insecure in modes for b in backends}
    for index in range(args.repeat):
        if len(backends) > 1:
            order = backends if index % 2 == 0 else backends[::-1]
            print(f"round {index + 1}: {' then '.join(order)}", flush=True)
            for backend, metrics in serve_round(model_dir, requests, args, modes[0], order).items():
                by_run[(modes[0], backend)].append(metrics)
            continue
        for insecure in (modes if index % 2 == 0 else modes[::-1]):
            if len(modes) > 1:
                print(f"round {index + 1}: {'plaintext' if insecure else 'TLS'}", flush=True)
            by_run[(insecure, backends[0])].append(serve_round(model_dir, requests, args, insecure,
                                                               backends)[backends[0]])
    return by_run


def serve_report(args, requests: list[BenchRequest], modes: tuple[bool, ...], backends: tuple[str, ...],
                 by_run: dict[tuple[bool, str], list[dict]]) -> dict:
    """The run's report (the first run's median round; TLS or OpenAI costs paired round
    by round beside it), printed as it is made."""
    rounds = by_run[(modes[0], backends[0])]
    metrics = summarize_rounds(rounds)
    report = {"kind": "serve", "workload": {"name": args.workload, **summary(requests)}, "machine": machine_info(),
              "dtype": args.dtype, "quantization": args.quantization, "request_rate": args.request_rate,
              "max_concurrency": args.max_concurrency,
              "command": " ".join(args.argv), "rounds": len(rounds), "grpc_security": args.grpc_security,
              "backend": args.backend, "metrics": metrics}
    if len(backends) > 1:
        print(f"{backends[0]}:")
    print_metrics(metrics)
    if len(modes) > 1:
        report["metrics_insecure"] = summarize_rounds(by_run[(True, backends[0])])
        report["tls_cost"] = tls_cost(by_run[(False, backends[0])], by_run[(True, backends[0])])
        print("plaintext:")
        print_metrics(report["metrics_insecure"])
        print_cost(report["tls_cost"])
    if len(backends) > 1:
        other = by_run[(modes[0], backends[1])]
        report[f"metrics_{backends[1]}"] = summarize_rounds(other)
        report["openai_cost"] = openai_cost(rounds, other)
        print(f"{backends[1]}:")
        print_metrics(report[f"metrics_{backends[1]}"])
        print_cost(report["openai_cost"])
    return report


def openai_cost(grpc_rounds: list[dict], openai_rounds: list[dict]) -> dict:
    """The OpenAI HTTP API against native gRPC, paired round by round (same cluster)."""
    return {"output_tok_s_openai_over_grpc": [o["output_token_throughput"] / g["output_token_throughput"]
                                              for g, o in zip(grpc_rounds, openai_rounds)],
            "tpot_median_openai_over_grpc": [o["tpot_ms"]["median"] / g["tpot_ms"]["median"]
                                             for g, o in zip(grpc_rounds, openai_rounds)],
            "ttft_median_openai_over_grpc": [o["ttft_ms"]["median"] / g["ttft_ms"]["median"]
                                             for g, o in zip(grpc_rounds, openai_rounds)]}


def tls_cost(tls: list[dict], plain: list[dict]) -> dict:
    """TLS against plaintext, paired round by round (the host drifts between rounds)."""
    return {"output_tok_s_plaintext_over_tls": [p["output_token_throughput"] / t["output_token_throughput"]
                                                for t, p in zip(tls, plain)],
            "tpot_median_tls_over_plaintext": [t["tpot_ms"]["median"] / p["tpot_ms"]["median"]
                                               for t, p in zip(tls, plain)],
            "ttft_median_tls_over_plaintext": [t["ttft_ms"]["median"] / p["ttft_ms"]["median"]
                                               for t, p in zip(tls, plain)]}


def print_cost(cost: dict) -> None:
    for name, values in cost.items():
        finite = [v for v in values if math.isfinite(v)]
        median = statistics.median(finite) if finite else math.nan
        print(f"{name}: median {median:.3f} (rounds: {', '.join(f'{v:.3f}' for v in values)})")


def _connector(args, insecure: bool, backend: str = "grpc"):
    """How this run's clients reach --target: over gRPC, the transport --grpc-security
    names, the CA and key of the flags (else LLMSERVE_TLS_CA, LLMSERVE_API_KEY); over
    OpenAI's API, the same CA and key (else the system's roots, no key)."""
    import os

    from llmserve.client import LLMServeClient

    api_key = Path(args.api_key_file).read_text().strip() if args.api_key_file else None
    if backend == "openai":
        return lambda: OpenAIClient(args.target or DEFAULT_OPENAI_TARGET, api_key or os.environ.get("LLMSERVE_API_KEY"),
                                    args.tls_ca or os.environ.get("LLMSERVE_TLS_CA"), args.served_model)
    return lambda: LLMServeClient(args.target or DEFAULT_GRPC_TARGET, api_key=api_key, tls_ca=args.tls_ca,
                                  insecure=insecure)


def _launched_connector(cluster, backend: str):
    if backend == "openai":
        ca = None if cluster.credentials is None else cluster.credentials.ca
        return lambda: OpenAIClient(cluster.http_url, cluster.api_key, ca)
    return cluster.client


def serve_round(model_dir, requests: list[BenchRequest], args, insecure: bool = False,
                backends: tuple[str, ...] = ("grpc",)) -> dict[str, dict]:
    """One online run per backend, in order; with --launch on one fresh cluster (so no
    round finds the previous round's prompts in the prefix cache), followed by the
    in-process decode step it is compared with (one backend only), so each round's ratio
    pairs two measurements minutes apart at most. `insecure`: the cluster (or --target)
    is plaintext, without an API key. Returns {backend: metrics}."""
    from llmserve.bench.throughput import cluster_spec
    from llmserve.launcher.cluster import LocalCluster, free_port
    from llmserve.telemetry.tracing import SPAN_FILE_ENV

    cluster = None
    span_file, pids = args.span_file, None
    connects = {b: _connector(args, insecure, b) for b in backends} if not args.launch else {}
    results: dict[str, tuple] = {}
    by_backend: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="llmserve-bench-") as tmp:
        if args.launch:
            # The scheduler's and the worker's step spans, and no collector (the router's
            # request spans are not needed).
            span_file = Path(tmp) / "spans.jsonl"
            spec = cluster_spec(model_dir, args, insecure)
            spec.service_env = {name: {SPAN_FILE_ENV: str(span_file)} for name in ("scheduler", "worker")}
            if "openai" in backends:
                spec.http_port = free_port()
            cluster = LocalCluster(spec).start()
            connects = {b: _launched_connector(cluster, b) for b in backends}
            pids = {name: proc.pid for name, proc in cluster.processes.items()}
        try:
            for backend in backends:
                results[backend] = asyncio.run(measured_load(connects[backend], requests, args, pids))
        finally:
            if cluster is not None:
                cluster.stop()  # Its processes gone, every span they ended is in the file.
        if span_file and cluster is None:
            time.sleep(SPAN_SETTLE_S)
        for backend, (timings, duration, window, cpu) in results.items():
            metrics = compute_metrics(timings, duration)
            if span_file:
                metrics["engine_steps"] = cluster_steps(span_file, window, cpu)
            by_backend[backend] = metrics
    for metrics in by_backend.values():
        if args.launch and metrics["completed"] and len(backends) == 1:
            compare_with_decode_step(metrics, model_dir, args.dtype, requests, args.quantization)
        if args.repeat > 1:
            print_metrics(metrics)
    return by_backend


def summarize_rounds(rounds: list[dict]) -> dict:
    """The round whose TPOT median / in-process step is the median (else whose TPOT
    median is), with every round's figures beside it. The host's speed drifts by tens
    of percent within minutes; a ratio is only as good as the pairing of its terms."""
    ratio = "tpot_median_over_decode_step"
    paired = all(ratio in r for r in rounds)
    chosen = median_round(rounds, key=lambda r: r[ratio] if paired else r["tpot_ms"]["median"])
    if len(rounds) > 1:
        chosen["rounds_tpot_median_ms"] = [r["tpot_ms"]["median"] for r in rounds]
        for name in ("tpot_median_over_decode_step", "online_decode_step_over_in_process",
                     "tpot_median_over_online_decode_step"):
            if all(name in r for r in rounds):
                chosen[f"rounds_{name}"] = [r[name] for r in rounds]
        # The ratios' terms too: which of them moved from round to round.
        if all("decode_step_ms" in r for r in rounds):
            chosen["rounds_in_process_step_ms"] = [r["decode_step_ms"]["mean"] for r in rounds]
        if all("cluster_mean" in r.get("decode_step_ms", {}) for r in rounds):
            chosen["rounds_cluster_decode_step_ms"] = [r["decode_step_ms"]["cluster_mean"] for r in rounds]
    return chosen


def print_metrics(m: dict) -> None:
    print(f"completed {m['completed']}, failed {m['failed']}, duration {m['duration_s']:.1f} s")
    print(f"request throughput {m['request_throughput']:.2f} req/s, output {m['output_token_throughput']:.1f} tok/s,"
          f" total {m['total_token_throughput']:.1f} tok/s; {m['tokens_per_message']:.2f} tokens per message")
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = m[name]
        print(f"{name[:-3].upper():>5} ms: mean {s['mean']:8.1f}  median {s['median']:8.1f}  p99 {s['p99']:8.1f}")
    if "decode_step_ms" in m:
        d = m["decode_step_ms"]
        timed = ", ".join(f"{ms:.1f} ms at {b} (x{d['weights'][b]:.2f})" for b, ms in d["at_batch"].items())
        print(f"in-process decode steps at the run's batch sizes, context {d['context']}: {d['mean']:.1f} ms "
              f"({timed}); "
              f"TPOT median / step = {m['tpot_median_over_decode_step']:.2f}x (mean concurrency "
              f"{m['mean_concurrency']:.1f})")
    if "engine_steps" in m:
        e = m["engine_steps"]
        print(f"cluster steps: {e['num_decode_steps']} decode, mean {e['decode_step_ms']:.1f} ms at batch "
              f"{e['decode_batch']:.1f} (worker {e['decode_step_worker_ms']:.1f} ms, {e['decode_steps_per_plan']:.2f} "
              f"steps per plan; per token: {e['decode_step_ms_per_token']:.1f} ms at batch "
              f"{e['decode_batch_per_token']:.2f}); {e['num_prefill_steps']} with "
              f"prompt tokens, mean {e['prefill_step_ms']:.1f} ms for {e['prefill_step_tokens']:.0f} tokens, "
              f"{100 * e['prefill_time_share']:.0f}% of the busy time")
        if e.get("cpu", {}).get("ms_per_step"):
            print("CPU per step (ms; the worker's includes its compute): " +
                  ", ".join(f"{name} {ms:.2f}" for name, ms in e["cpu"]["ms_per_step"].items()))
    else:
        print("cluster steps: unavailable (no span file: --launch, or --span-file with the running "
              "cluster's LLMSERVE_SPAN_FILE)")
    if "online_decode_step_over_in_process" in m:
        print(f"  = cluster decode step / in-process step {m['online_decode_step_over_in_process']:.2f}x"
              f"  x  TPOT median / cluster decode step {m['tpot_median_over_online_decode_step']:.2f}x")
    labels = {"tpot_median_over_decode_step": "TPOT median / in-process step",
              "online_decode_step_over_in_process": "cluster decode step / in-process step",
              "tpot_median_over_online_decode_step": "TPOT median / cluster decode step"}
    per_round = [f"{label} " + ", ".join(f"{r:.2f}x" for r in m[f"rounds_{name}"])
                 for name, label in labels.items() if f"rounds_{name}" in m]
    if per_round:
        print("rounds (this is the median one): " + "; ".join(per_round))
