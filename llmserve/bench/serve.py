"""`llmserve bench serve`: online load against a running cluster (vLLM `bench serve`
style), over the router's gRPC API or any OpenAI-compatible server's (--backend). Requests arrive as a Poisson process at --request-rate (or all at once for
`inf`), at most --max-concurrency in flight; latencies are taken per streamed delta.
With --launch, TPOT is set against an in-process decode step at the cluster's batch
(see compare_with_decode_step), in --repeat rounds paired run by run. The cluster's own
steps come from its trace spans (see step_spans.py): a launched cluster's scheduler and
worker append them to a span file of the benchmark's; with --target, --span-file names
the running cluster's (its LLMSERVE_SPAN_FILE)."""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from llmserve.bench import cpu_usage
from llmserve.bench.cli import GRPC_SECURITY
from llmserve.bench.openai_backend import OpenAIClient
from llmserve.bench.report import machine_info, median_round, plot_latency, write_json
from llmserve.bench.step_spans import StepTotals, read_spans, step_totals
from llmserve.bench.workloads import BenchRequest, summary, workload_from_args

# With --target: how long after the run the cluster may take to append its last step span.
SPAN_SETTLE_S = 1.0
# --backend: the APIs a round drives, in order (both: on one cluster, alternating which goes first).
BACKENDS = {"grpc": ("grpc",), "openai": ("openai",), "both": ("grpc", "openai")}
DEFAULT_GRPC_TARGET = "localhost:50051"
DEFAULT_OPENAI_TARGET = "http://localhost:8000/v1"


@dataclass
class RequestTiming:
    prompt_len: int
    start: float = 0.0
    token_times: list[float] = field(default_factory=list)  # One entry per generated token.
    delta_times: list[float] = field(default_factory=list)  # One per streamed message (several tokens
    # each with --stream-interval > 1: ITL is the gap between messages, as vLLM's bench takes it).
    end: float = 0.0
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT)."""
        n = len(self.token_times)
        return (self.end - self.token_times[0]) / (n - 1) if n > 1 else None


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"mean": math.nan, "median": math.nan, "p99": math.nan}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {"mean": statistics.fmean(values), "median": statistics.median(values), "p99": p99}


def compute_metrics(timings: list[RequestTiming], duration: float) -> dict:
    ok = [t for t in timings if not t.error and t.token_times]
    itls = [b - a for t in ok for a, b in zip(t.delta_times, t.delta_times[1:])]
    out_tokens = sum(len(t.token_times) for t in ok)
    ms = 1000.0
    return {
        "completed": len(ok),
        "failed": len(timings) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(t.prompt_len for t in ok)) / duration,
        "ttft_ms": {k: v * ms for k, v in percentiles([t.ttft for t in ok]).items()},
        "tpot_ms": {k: v * ms for k, v in percentiles([t.tpot for t in ok if t.tpot is not None]).items()},
        "itl_ms": {k: v * ms for k, v in percentiles(itls).items()},
        "tokens_per_message": out_tokens / max(1, sum(len(t.delta_times) for t in ok)),
        "e2e_ms": {k: v * ms for k, v in percentiles([t.end - t.start for t in ok]).items()},
        # Requests in flight, time-averaged over the run: the batch size the engine ran at.
        "mean_concurrency": sum(t.end - t.start for t in ok) / duration if duration else 0.0,
    }


async def run_load(connect, requests: list[BenchRequest], request_rate: float, max_concurrency: int | None,
                   seed: int = 0) -> tuple[list[RequestTiming], float]:
    """`connect()`: a new LLMServeClient for the cluster under test."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency or len(requests))
    timings = [RequestTiming(len(r.prompt_token_ids)) for r in requests]

    async def one(client, r: BenchRequest, timing: RequestTiming) -> None:
        async with limit:
            timing.start = time.perf_counter()
            try:
                async for delta in client.generate(token_ids=r.prompt_token_ids, max_tokens=r.output_len,
                                                   temperature=0.0, ignore_eos=True):
                    now = time.perf_counter()
                    timing.token_times += [now] * len(delta.token_ids)
                    if delta.token_ids:
                        timing.delta_times.append(now)
            except Exception as err:  # A failed request is counted, not fatal to the run.
                timing.error = str(err)
            timing.end = time.perf_counter()

    async with connect() as client:
        tasks = []
        start = time.perf_counter()
        for r, timing in zip(requests, timings):
            tasks.append(asyncio.create_task(one(client, r, timing)))
            if math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return timings, duration


def _per(total: float, count: float) -> float:
    """total / count, NaN when nothing was counted (a run without that kind of step)."""
    return total / count if count else math.nan


def engine_steps(d: StepTotals) -> dict:
    """The cluster's steps during the run (from its step spans): how long its decode
    steps took at what batch, and what share of its busy time went to steps that carried
    prompt tokens."""
    decodes, prefills = d.num_decode_steps, d.num_prefill_steps
    busy = d.decode_step_seconds + d.prefill_step_seconds
    # A step of batch b carries b tokens: TPOT, a mean over a request's tokens, weighs it
    # b times. Per batch size: the steps, the share of decoded tokens, the mean step.
    tokens = sum(b * n for b, n in d.decode_steps_by_batch.items())
    by_batch = {b: {"steps": n, "token_share": b * n / tokens, "ms": 1000 * d.decode_seconds_by_batch[b] / n}
                for b, n in sorted(d.decode_steps_by_batch.items())}
    worker_seconds = d.decode_step_worker_seconds if d.worker_seconds_known else math.nan
    return {
        "num_decode_steps": decodes,
        "num_prefill_steps": prefills,
        "decode_step_ms": 1000 * _per(d.decode_step_seconds, decodes),
        "decode_step_worker_ms": 1000 * _per(worker_seconds, decodes),
        "decode_batch": _per(d.decode_step_sequences, decodes),
        # What a generated token saw, on average: its step's batch (larger than the
        # per-step mean whenever the batch varies) and its step's time.
        "decode_batch_per_token": sum(b * v["token_share"] for b, v in by_batch.items()) if tokens else math.nan,
        "decode_step_ms_per_token": sum(v["ms"] * v["token_share"] for v in by_batch.values()) if tokens else math.nan,
        "decode_by_batch": by_batch,
        # Multi-step scheduling: decode steps per plan (1 without it; runs end early when a
        # request arrives or one is about to reach its max_tokens).
        "decode_steps_per_plan": _per(decodes, d.num_decode_plans),
        "prefill_step_ms": 1000 * _per(d.prefill_step_seconds, prefills),
        "prefill_step_tokens": _per(d.prefill_step_tokens, prefills),
        "prefill_time_share": _per(d.prefill_step_seconds, busy),
    }


async def measured_load(connect, requests: list[BenchRequest], args, pids: dict[str, int] | None = None):
    """run_load, with the wall-clock window it ran in (nanoseconds, the spans' clock) and
    the CPU time of the processes in `pids` (a launched cluster's) before and after."""
    cpu_before = cpu_usage.snapshot(pids) if pids else None
    start_ns = time.time_ns()
    timings, duration = await run_load(connect, requests, args.request_rate, args.max_concurrency, args.seed)
    end_ns = time.time_ns()
    cpu = (cpu_before, cpu_usage.snapshot(pids)) if pids else None
    return timings, duration, (start_ns, end_ns), cpu


def cluster_steps(span_file: str | Path, window: tuple[int, int], cpu=None) -> dict:
    """engine_steps of the scheduler.step spans that started within the run's window,
    with each process's CPU per step when `cpu` holds its snapshots."""
    path = Path(span_file)
    steps = engine_steps(step_totals(read_spans(path) if path.exists() else [], *window))
    if cpu is not None:
        steps["cpu"] = cpu_usage.cpu_per_step(*cpu, steps["num_decode_steps"] + steps["num_prefill_steps"])
    return steps


def bench_serve(args) -> int:
    from llmserve.model_store import resolve_model_dir

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
    model_dir = resolve_model_dir(args.model)
    requests = workload_from_args(args, model_dir)
    # (insecure, backend) -> rounds; with two of either, each round runs both, in turns first.
    runs = [(insecure, backend) for insecure in modes for backend in backends]
    by_run: dict[tuple[bool, str], list[dict]] = {run: [] for run in runs}
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
    rounds = by_run[runs[0]]
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
    rounds = [r for run in runs for r in by_run[run]]
    out = Path(args.output_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    write_json(report, out / f"serve-{args.workload}-{stamp}.json")
    if metrics["completed"]:
        plot_latency(report, out / f"serve-{args.workload}-{stamp}.png")
    print(f"wrote {out}/serve-{args.workload}-{stamp}.{{json,png}}")
    return 0 if all(r["failed"] == 0 for r in rounds) else 1


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
    from llmserve.launcher import LocalCluster, free_port
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


def batches_to_time(token_share: dict[int, float], coverage: float = 0.95, most: int = 12) -> dict[int, float]:
    """The batch sizes that carried most of the decoded tokens (largest shares first,
    until `coverage` of them, at most `most` sizes), with their shares renormalised."""
    chosen, covered = {}, 0.0
    for b, share in sorted(token_share.items(), key=lambda kv: -kv[1]):
        if covered >= coverage or len(chosen) == most:
            break
        chosen[b] = share
        covered += share
    return {b: share / covered for b, share in sorted(chosen.items())}


def compare_with_decode_step(metrics: dict, model_dir, dtype: str, requests: list[BenchRequest],
                             quantization: str = "none") -> None:
    """Times in-process decode steps at the run's batch sizes and mean context (same
    machine, right after the run) and sets TPOT median / their mix: what serving through
    the cluster, with arrivals and prefills in between, adds per token.

    With the cluster's step totals (from its step spans), the in-process step is timed at each batch size its
    decode steps ran (those carrying 95% of the decoded tokens) and mixed with the
    weights TPOT gives them: a step of batch b carries b tokens. A step's time is not
    affine in b (one sequence costs a CPU more than half of two), so neither the
    per-step mean batch (1.8 at 0.3 req/s here) nor the per-token one (2.5) stands for
    the mix. The cluster's own decode steps are mixed with the same weights, and the
    ratio splits in two:
      online decode step / in-process step   the cluster's own decode steps (round
                                             trips, other processes on the cores, drift)
      TPOT median / online decode step       arrivals' prefills sharing the steps
    Without the totals: the mean number of requests in flight, interpolated between the
    batch sizes either side.
    """
    from llmserve.bench.profile_step import time_decode_steps

    steps = metrics.get("engine_steps")
    known = steps is not None and steps["num_decode_steps"] > 0
    if known:
        weights = batches_to_time({b: v["token_share"] for b, v in steps["decode_by_batch"].items()})
        batch = steps["decode_batch_per_token"]
    else:
        batch = max(1.0, metrics["mean_concurrency"])
        low, frac = math.floor(batch), batch - math.floor(batch)
        weights = {low: 1.0 - frac, low + 1: frac} if frac else {low: 1.0}
    context = round(statistics.fmean(len(r.prompt_token_ids) + r.output_len / 2 for r in requests))
    # NOTE: at least 16 steps per batch size, in four interleaved chunks (drift).
    per_batch = max(16, 160 // len(weights) // 4 * 4)
    at_batch = {b: 1000 * t for b, t in time_decode_steps(model_dir, dtype, sorted(weights), context,
                                                           steps=per_batch, quantization=quantization).items()}
    step_ms = sum(w * at_batch[b] for b, w in weights.items())
    metrics["decode_step_ms"] = {"batch": batch, "context": context, "mean": step_ms,
                                 "at_batch": {str(b): ms for b, ms in at_batch.items()},
                                 "weights": {str(b): w for b, w in weights.items()}}
    metrics["tpot_median_over_decode_step"] = metrics["tpot_ms"]["median"] / step_ms
    if known:
        cluster_ms = sum(w * steps["decode_by_batch"][b]["ms"] for b, w in weights.items())
        metrics["decode_step_ms"]["cluster_mean"] = cluster_ms
        metrics["online_decode_step_over_in_process"] = cluster_ms / step_ms
        metrics["tpot_median_over_online_decode_step"] = metrics["tpot_ms"]["median"] / cluster_ms


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
