"""`llmserve bench routing`: routing policies over data-parallel replicas, side by side.

Each round launches a fresh cluster of --dp-size replicas per policy (caches start
empty), in turns, and sends it the same requests in the same (shuffled) order with
--max-concurrency in flight. Reported per policy: the fraction of prompt tokens served
from a prefix cache (the requests' own `usage.cached_tokens`), output tokens/s, the
wall time, and how the requests spread over the replicas (each scheduler's stats).

The prefix workload (--num-prefixes shared prefixes of --prefix-len tokens, more than
one replica's KV cache holds) is what cache-aware routing is for: round-robin sends
every prefix everywhere, so each replica's cache churns through all of them.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path

from llmserve.bench.report import machine_info, save_report
from llmserve.bench.workloads import BenchRequest, summary, workload_from_args


def add_routing_arguments(parser) -> None:
    parser.add_argument("--dp-size", type=int, default=2, help="replicas per launched cluster")
    parser.add_argument("--policies", nargs="+", default=["cache-aware", "round-robin"],
                        choices=["cache-aware", "least-load", "round-robin"], help="routing policies to compare")
    parser.add_argument("--max-concurrency", type=int, default=16, help="requests in flight")
    parser.add_argument("--repeat", type=int, default=1, help="rounds, each running every policy in turn")


async def _drive(cluster, requests: list[BenchRequest], concurrency: int) -> dict:
    seats = asyncio.Semaphore(concurrency)
    results = []

    async def one(client, request: BenchRequest) -> None:
        async with seats:
            out, usage = 0, None
            async for delta in client.generate(token_ids=request.prompt_token_ids, max_tokens=request.output_len,
                                               temperature=0.0, ignore_eos=True):
                out += len(delta.token_ids)
                usage = delta.usage or usage
            results.append((len(request.prompt_token_ids), usage["cached_tokens"], out))

    start = time.perf_counter()
    async with cluster.client() as client:
        await asyncio.gather(*(one(client, r) for r in requests))
    seconds = time.perf_counter() - start
    prompt = sum(p for p, _, _ in results)
    return {"seconds": seconds, "prompt_tokens": prompt, "cached_tokens": sum(c for _, c, _ in results),
            "cached_fraction": sum(c for _, c, _ in results) / prompt,
            "output_tokens": sum(o for _, _, o in results),
            "output_tok_per_s": sum(o for _, _, o in results) / seconds}


async def _replica_spread(cluster, dp_size: int) -> list[int]:
    from llmserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc

    spread = []
    for replica in range(dp_size):
        async with cluster.channel("scheduler", replica=replica) as channel:
            stats = await scheduler_pb2_grpc.SchedulerStub(channel).GetStats(scheduler_pb2.GetStatsRequest(),
                                                                             timeout=10)
        spread.append(stats.prompt_tokens_total)
    return spread


def _round(model_dir: Path, requests: list[BenchRequest], args, policy: str) -> dict:
    from llmserve.bench.throughput import cluster_spec
    from llmserve.launcher.cluster import LocalCluster, free_port

    spec = cluster_spec(model_dir, args)
    spec.dp_size = args.dp_size
    spec.replica_ports = [(free_port(), free_port()) for _ in range(args.dp_size - 1)]
    spec.router = replace(spec.router, routing_policy=policy)
    with LocalCluster(spec) as cluster:
        metrics = asyncio.run(_drive(cluster, requests, args.max_concurrency))
        metrics["replica_prompt_tokens"] = asyncio.run(_replica_spread(cluster, args.dp_size))
    return metrics


def bench_routing(args) -> int:
    from llmserve.model_store import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    requests = workload_from_args(args, model_dir)
    # Arrival order must not line prefixes up with the replicas (request i of the prefix
    # workload has prefix i mod N: round-robin over an even N would look cache-aware).
    random.Random(args.seed).shuffle(requests)
    rounds: dict[str, list[dict]] = {p: [] for p in args.policies}
    for index in range(args.repeat):
        order = args.policies if index % 2 == 0 else args.policies[::-1]
        for policy in order:
            metrics = _round(model_dir, requests, args, policy)
            rounds[policy].append(metrics)
            print(f"round {index + 1} {policy:>12}: cached {metrics['cached_fraction']:.1%} of prompt tokens, "
                  f"{metrics['output_tok_per_s']:.1f} output tok/s, {metrics['seconds']:.1f} s, prompt tokens per "
                  f"replica {metrics['replica_prompt_tokens']}", flush=True)
    report = {"kind": "routing", "workload": summary(requests), "args": {k: v for k, v in vars(args).items()
                                                                         if isinstance(v, (int, float, str, list))},
              "machine": machine_info(), "rounds": rounds,
              "median": {p: {k: statistics.median(r[k] for r in rs)
                             for k in ("cached_fraction", "output_tok_per_s", "seconds")}
                         for p, rs in rounds.items()}}
    print("median:")
    for policy, m in report["median"].items():
        print(f"  {policy:>12}: cached {m['cached_fraction']:.1%}, {m['output_tok_per_s']:.1f} output tok/s, "
              f"{m['seconds']:.1f} s")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    save_report(report, args.output_dir, f"routing-{args.workload}-dp{args.dp_size}-{stamp}.json")
    return 0
