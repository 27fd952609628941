"""The `llmserve bench ...` subcommands' flags."""

from __future__ import annotations

import argparse

from llmserve.bench.workloads import add_workload_flags


def add_bench_parser(sub, add_model_flags, add_scheduler_flags, parse_bytes) -> None:
    bench = sub.add_parser("bench", help="benchmarks (throughput offline, serve online)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)

    def common(p):
        add_model_flags(p)
        add_scheduler_flags(p)
        add_workload_flags(p)
        p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
        p.add_argument("--kv-cache-memory", type=parse_bytes, default=2**30)
        p.add_argument("--output-dir", default="bench-results", help="JSON + PNG go here")

    tput = bench_sub.add_parser("throughput", help="offline: in-process engine, optionally gRPC stack and HF")
    common(tput)
    tput.add_argument("--through-grpc", action="store_true", help="also run it through a local cluster")
    tput.add_argument("--baseline", action="append", choices=["hf", "hf-cb"], default=[],
                      help="HF transformers in the same run: static-batch generate (hf) or its continuous "
                           "batching (hf-cb); repeatable")
    tput.add_argument("--hf-batch-size", type=int, default=16)
    tput.add_argument("--repeat", type=int, default=1,
                      help="rounds, each running every system in turn; figures are each system's median round")

    serve = bench_sub.add_parser("serve", help="online: Poisson arrivals against a cluster")
    common(serve)
    serve.add_argument("--target", default="localhost:50051", help="router address")
    serve.add_argument("--span-file", default=None,
                       help="with --target: the JSON-lines span file the cluster's scheduler and worker append "
                            "to (their LLMSERVE_SPAN_FILE): also report its engine steps (known with --launch)")
    serve.add_argument("--scheduler-target", default=None, help=argparse.SUPPRESS)  # Gone: see bench_serve.
    serve.add_argument("--launch", action="store_true", help="start a local cluster for the run")
    serve.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf = all at once")
    serve.add_argument("--max-concurrency", type=int, default=None)
    serve.add_argument("--repeat", type=int, default=1,
                       help="rounds (each on a fresh cluster with --launch, then its in-process decode step); "
                            "figures are the median round's")


    prof = bench_sub.add_parser("profile", help="where the time of one decode step goes")
    add_model_flags(prof)
    prof.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    prof.add_argument("--batch", type=int, default=64)
    prof.add_argument("--context", type=int, default=256, help="prompt tokens per sequence")


def run_bench(args) -> int:
    if args.bench_command == "profile":
        from llmserve.bench.profile_step import bench_profile

        return bench_profile(args)
    if args.bench_command == "throughput":
        from llmserve.bench.throughput import bench_throughput

        return bench_throughput(args)
    from llmserve.bench.serve import bench_serve

    return bench_serve(args)
