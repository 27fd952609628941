"""`llmserve bench overload`: admission control under more load than a cluster can serve.

    1. unloaded   --unloaded-requests requests one at a time: TTFT with nothing else running
    2. capacity   --calibrate-s seconds with every seat taken (max-num-seqs requests in
                  flight, closed loop): completions per second = the sustainable rate
                  (or --request-rate R to skip this phase and take R)
    3. overload   Poisson arrivals at --overload x that rate for --duration seconds
    4. idle       the scheduler's stats once nothing runs: leaked blocks = total - free

Every request has a short random prompt and a fixed output length (eos ignored). In
phase 3 each must either complete with exactly that many tokens (LENGTH) or be refused
with RESOURCE_EXHAUSTED carrying a google.rpc.RetryInfo; anything else is a violation.
The report sets the admitted requests' TTFT against phase 1's and the refusals' latency
against ACCEPTANCE_REFUSAL_MS (issue #17's acceptance: refusals within 100 ms, p99
TTFT within 2x the unloaded one, no leaked blocks).

The client runs on the same host as the cluster: on a small machine its own CPU (a few
thousand streams a minute) is part of what the cluster competes with.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

ACCEPTANCE_REFUSAL_MS = 100.0  # A refusal must come back within this.
ACCEPTANCE_TTFT_RATIO = 2.0  # Admitted p99 TTFT under overload / unloaded p99 TTFT, at most.
IDLE_TIMEOUT_S = 120.0  # After the load: how long the cluster may take to finish what it admitted.
GENERATION_SERVICE = "llmserve.v1.Generation"


@dataclass
class Outcome:
    """One request as the client saw it (perf_counter seconds)."""

    start: float
    first_token: float | None = None
    end: float = 0.0
    num_tokens: int = 0
    finish: str | None = None  # The last delta's finish reason.
    code: str | None = None  # The gRPC status name when the call failed.
    retry_after_s: float | None = None  # The RetryInfo delay of a failed call.
    error: str = ""

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    def kind(self, output_len: int) -> str:
        """completed | refused | violation (see the module docstring)."""
        if self.code is None and self.finish == "length" and self.num_tokens == output_len:
            return "completed"
        if self.code == "RESOURCE_EXHAUSTED" and self.retry_after_s and self.num_tokens == 0:
            return "refused"
        return "violation"


def add_overload_arguments(p) -> None:
    from llmserve.bench.report import add_output_dir_flag

    p.add_argument("--target", default="localhost:50051",
                   help="router address (without --launch: a cluster started with --insecure)")
    p.add_argument("--scheduler-target", default="localhost:50052",
                   help="scheduler address for its stats (without --launch)")
    p.add_argument("--launch", action="store_true", help="start a local cluster for the run")
    p.add_argument("--input-len", type=int, nargs=2, default=[16, 32], metavar=("MIN", "MAX"),
                   help="prompt tokens, uniform")
    p.add_argument("--output-len", type=int, default=16, help="tokens every request generates")
    p.add_argument("--unloaded-requests", type=int, default=20, help="phase 1: requests one at a time")
    p.add_argument("--calibrate-s", type=float, default=20.0, help="phase 2: seconds with every seat taken")
    p.add_argument("--concurrency", type=int, default=None,
                   help="phase 2: requests in flight (default: the cluster's --max-num-seqs)")
    p.add_argument("--request-rate", type=float, default=None,
                   help="the sustainable rate, req/s: skips phase 2")
    p.add_argument("--overload", type=float, default=2.0, help="phase 3: offered rate / sustainable rate")
    p.add_argument("--duration", type=float, default=60.0, help="phase 3: seconds of arrivals")
    p.add_argument("--seed", type=int, default=0)
    add_output_dir_flag(p, "the JSON report goes here")


def random_prompts(input_len: tuple[int, int], vocab_size: int, rng: random.Random) -> Iterator[list[int]]:
    """Endless fresh prompts (random ids: no two share a prefix-cache block)."""
    while True:
        yield [rng.randrange(vocab_size) for _ in range(rng.randint(*input_len))]


async def one_request(client, prompt: list[int], output_len: int) -> Outcome:
    import grpc

    from llmserve.contract.retry_info import retry_delay_s

    out = Outcome(start=time.perf_counter())
    try:
        async for delta in client.generate(token_ids=prompt, max_tokens=output_len, temperature=0.0,
                                           ignore_eos=True):
            if delta.token_ids and out.first_token is None:
                out.first_token = time.perf_counter()
            out.num_tokens += len(delta.token_ids)
            out.finish = delta.finish_reason or out.finish
    except grpc.aio.AioRpcError as err:
        out.code, out.error, out.retry_after_s = err.code().name, err.details() or "", retry_delay_s(err)
    out.end = time.perf_counter()
    return out


async def unloaded(client, prompts: Iterable[list[int]], output_len: int) -> list[Outcome]:
    """Phase 1: one request at a time."""
    return [await one_request(client, p, output_len) for p in prompts]


async def capacity(client, prompts: Iterator[list[int]], output_len: int, concurrency: int,
                   seconds: float) -> tuple[float, list[Outcome]]:
    """Phase 2: `concurrency` closed loops for `seconds`; returns completions per second
    after the first quarter (the batch filling up) and every outcome."""
    start = time.perf_counter()
    stop_at, count_from = start + seconds, start + seconds / 4
    outcomes: list[Outcome] = []

    async def loop():
        while time.perf_counter() < stop_at:
            outcomes.append(await one_request(client, next(prompts), output_len))

    await asyncio.gather(*(loop() for _ in range(concurrency)))
    done = [o for o in outcomes if o.kind(output_len) == "completed" and o.end >= count_from]
    return len(done) / (time.perf_counter() - count_from), outcomes


async def overload(client, prompts: Iterator[list[int]], output_len: int, rate: float, seconds: float,
                   rng: random.Random, watch) -> tuple[list[Outcome], float]:
    """Phase 3: Poisson arrivals at `rate` for `seconds`; `watch` samples the cluster
    meanwhile. Returns every outcome and the arrivals' real duration."""
    tasks = []
    start = time.perf_counter()
    watcher = asyncio.create_task(watch())
    next_at = start + rng.expovariate(rate)
    while next_at - start <= seconds:
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        tasks.append(asyncio.create_task(one_request(client, next(prompts), output_len)))
        next_at += rng.expovariate(rate)
    arrivals_s = time.perf_counter() - start
    outcomes = await asyncio.gather(*tasks)
    watcher.cancel()
    await asyncio.gather(watcher, return_exceptions=True)
    return list(outcomes), arrivals_s


class ClusterWatch:
    """Samples the router's Generation health and the scheduler's queue while loaded."""

    def __init__(self, endpoints: "Endpoints") -> None:
        self.endpoints = endpoints
        self.samples: list[tuple[bool, int, int]] = []  # (Generation NOT_SERVING, queued requests, running)

    async def __call__(self, interval_s: float = 0.25) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from llmserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc

        async with self.endpoints.channel("router") as r, self.endpoints.channel("scheduler") as s:
            health, stats = health_pb2_grpc.HealthStub(r), scheduler_pb2_grpc.SchedulerStub(s)
            while True:
                reply = await health.Check(health_pb2.HealthCheckRequest(service=GENERATION_SERVICE), timeout=5)
                st = await stats.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
                self.samples.append((reply.status == health_pb2.HealthCheckResponse.NOT_SERVING,
                                     st.num_queued_requests, st.num_running))
                await asyncio.sleep(interval_s)

    def summary(self) -> dict:
        n = len(self.samples) or 1
        return {"samples": len(self.samples),
                "share_not_serving": sum(s[0] for s in self.samples) / n,
                "mean_queued_requests": sum(s[1] for s in self.samples) / n,
                "mean_running": sum(s[2] for s in self.samples) / n}


class PlaintextEndpoints:
    """A cluster started elsewhere with --insecure: its router and scheduler addresses.
    (A secure cluster's scheduler takes only its routers' certificates: launch one.)"""

    def __init__(self, router: str, scheduler: str) -> None:
        self.addresses = {"router": router, "scheduler": scheduler}

    def client(self):
        from llmserve.client import LLMServeClient

        return LLMServeClient(self.addresses["router"], insecure=True)

    def channel(self, service: str):
        import grpc

        return grpc.aio.insecure_channel(self.addresses[service])


Endpoints = PlaintextEndpoints  # Or a LocalCluster: client(), channel("router" | "scheduler").


async def idle_stats(endpoints: Endpoints, timeout_s: float = IDLE_TIMEOUT_S):
    """The scheduler's stats once nothing runs, waits or is swapped out (or at the timeout)."""
    from llmserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc

    deadline = time.perf_counter() + timeout_s
    async with endpoints.channel("scheduler") as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        while True:
            stats = await stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)
            if (stats.num_running == stats.num_waiting == stats.num_swapped == 0) or time.perf_counter() > deadline:
                return stats
            await asyncio.sleep(0.2)


def quantiles_ms(values: list[float]) -> dict:
    """p50 / p99 / max in ms (NaN when empty)."""
    if not values:
        return {"p50": math.nan, "p99": math.nan, "max": math.nan}
    ordered = sorted(values)
    at = lambda q: ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]  # noqa: E731
    return {"p50": 1000 * at(0.5), "p99": 1000 * at(0.99), "max": 1000 * ordered[-1]}


def summarize(base: list[Outcome], calibration: list[Outcome], loaded: list[Outcome], output_len: int,
              rate: float, offered: float, arrivals_s: float, stats, watch: dict) -> dict:
    kinds = {k: [o for o in loaded if o.kind(output_len) == k] for k in ("completed", "refused", "violation")}
    ttft_unloaded = quantiles_ms([o.ttft_s for o in base if o.ttft_s is not None])
    ttft_loaded = quantiles_ms([o.ttft_s for o in kinds["completed"]])
    ttft_capacity = quantiles_ms([o.ttft_s for o in calibration if o.ttft_s is not None])
    refusal = quantiles_ms([o.end - o.start for o in kinds["refused"]])
    leaked = stats.num_total_blocks - stats.num_free_blocks
    idle = stats.num_running == stats.num_waiting == stats.num_swapped == 0
    report = {
        "sustainable_rate": rate,
        "offered_rate": offered,
        "requests": len(loaded),
        "completed": len(kinds["completed"]),
        "refused": len(kinds["refused"]),
        "violations": len(kinds["violation"]),
        "violation_examples": [asdict(o) for o in kinds["violation"][:5]],
        "admitted_rate": len(kinds["completed"]) / arrivals_s,
        "refusal_ms": refusal,
        "retry_after_ms": quantiles_ms([o.retry_after_s for o in kinds["refused"]]),
        "ttft_unloaded_ms": ttft_unloaded,
        "calibration_requests": len(calibration),
        "ttft_at_capacity_ms": ttft_capacity,
        "ttft_loaded_ms": ttft_loaded,
        "ttft_p99_loaded_over_unloaded": ttft_loaded["p99"] / ttft_unloaded["p99"],
        # Against the cluster full but not overloaded: what the queue adds, the batch aside.
        "ttft_p99_loaded_over_at_capacity": ttft_loaded["p99"] / ttft_capacity["p99"],
        "e2e_loaded_ms": quantiles_ms([o.end - o.start for o in kinds["completed"]]),
        "leaked_blocks": leaked,
        "idle": idle,
        "scheduler": {"num_total_blocks": stats.num_total_blocks, "num_free_blocks": stats.num_free_blocks,
                      "num_refused": dict(stats.num_refused), "num_expired": stats.num_expired,
                      "max_queued_requests": stats.max_queued_requests,
                      "max_queued_tokens": stats.max_queued_tokens, "saturated_after": stats.saturated},
        "watch": watch,
    }
    report["acceptance"] = {
        "every_request_completed_or_refused": report["violations"] == 0,
        "refusals_within_100_ms": not kinds["refused"] or refusal["max"] <= ACCEPTANCE_REFUSAL_MS,
        "ttft_p99_within_2x_unloaded": report["ttft_p99_loaded_over_unloaded"] <= ACCEPTANCE_TTFT_RATIO,
        "no_leaked_blocks": leaked == 0 and idle,
    }
    return report


async def run_phases(args, endpoints: Endpoints, vocab_size: int, seats: int | None) -> dict:
    """`seats`: the cluster's --max-num-seqs; None (by device): what its GetModelInfo says."""
    rng = random.Random(args.seed)
    prompts = random_prompts(tuple(args.input_len), vocab_size, rng)
    async with endpoints.client() as client:
        await one_request(client, [1, 2, 3, 4], 2)  # Warm-up.
        base = await unloaded(client, itertools.islice(prompts, args.unloaded_requests), args.output_len)
        calibration: list[Outcome] = []
        rate = args.request_rate
        if rate is None:
            concurrency = args.concurrency or seats or (await client.model_info()).max_num_seqs
            rate, calibration = await capacity(client, prompts, args.output_len, concurrency, args.calibrate_s)
        offered = args.overload * rate
        watch = ClusterWatch(endpoints)
        loaded, arrivals_s = await overload(client, prompts, args.output_len, offered, args.duration, rng, watch)
    stats = await idle_stats(endpoints)
    return summarize(base, calibration, loaded, args.output_len, rate, offered, arrivals_s, stats, watch.summary())


def bench_overload(args) -> int:
    import json

    from llmserve.bench.report import machine_info, save_report
    from llmserve.bench.throughput import cluster_spec
    from llmserve.launcher.cluster import LocalCluster
    from llmserve.model_store import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    seats = args.engine.scheduling.max_num_seqs
    cluster = LocalCluster(cluster_spec(model_dir, args)).start() if args.launch else None
    try:
        endpoints = cluster or PlaintextEndpoints(args.target, args.scheduler_target)
        report = asyncio.run(run_phases(args, endpoints, vocab_size, seats))
    finally:
        if cluster is not None:
            cluster.stop()
    report = {"kind": "overload", "machine": machine_info(), "command": " ".join(args.argv),
              "workload": {"input_len": args.input_len, "output_len": args.output_len, "duration_s": args.duration,
                           "overload": args.overload},
              **report}
    print_report(report)
    save_report(report, args.output_dir, f"overload-{time.strftime('%Y%m%d-%H%M%S')}.json")
    acceptance = report["acceptance"]
    # Timing figures are reported; a wrong answer or a leak fails the command.
    return 0 if acceptance["every_request_completed_or_refused"] and acceptance["no_leaked_blocks"] else 1


def print_report(r: dict) -> None:
    def q(d):
        return f"p50 {d['p50']:.1f}  p99 {d['p99']:.1f}  max {d['max']:.1f} ms"

    m, s = r["machine"], r["scheduler"]
    print(f"cpu: {m['cpu']} ({m['cores']} cores; {', '.join(m['cpu_matrix_isa']) or 'no AVX2/AVX-512/AMX'})")
    print(f"bounds: --max-queued-requests {s['max_queued_requests']}, --max-queued-tokens {s['max_queued_tokens']}")
    print(f"sustainable rate {r['sustainable_rate']:.2f} req/s; offered {r['offered_rate']:.2f} req/s "
          f"({r['workload']['overload']:g}x) for {r['workload']['duration_s']:g} s")
    print(f"requests {r['requests']}: completed {r['completed']} ({r['admitted_rate']:.2f} req/s), refused "
          f"{r['refused']}, violations {r['violations']}; refused by reason {s['num_refused']}")
    print(f"refusal latency: {q(r['refusal_ms'])}; retry hints {q(r['retry_after_ms'])}")
    print(f"TTFT unloaded:    {q(r['ttft_unloaded_ms'])}")
    print(f"TTFT at capacity: {q(r['ttft_at_capacity_ms'])}  ({r['calibration_requests']} requests, closed loop)")
    print(f"TTFT overloaded:  {q(r['ttft_loaded_ms'])}  (p99 {r['ttft_p99_loaded_over_unloaded']:.2f}x unloaded, "
          f"{r['ttft_p99_loaded_over_at_capacity']:.2f}x at capacity)")
    w = r["watch"]
    print(f"while loaded: Generation health NOT_SERVING {100 * w['share_not_serving']:.0f}% of {w['samples']} "
          f"samples, mean queued {w['mean_queued_requests']:.1f}, mean running {w['mean_running']:.1f}")
    print(f"afterwards: leaked blocks {r['leaked_blocks']} ({s['num_free_blocks']}/{s['num_total_blocks']} free), "
          f"idle {r['idle']}, saturated {s['saturated_after']}")
    print("acceptance: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in r["acceptance"].items()))
