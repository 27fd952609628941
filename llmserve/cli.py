"""`llmserve`: start the services (alone or as a local cluster) and talk to them.

    llmserve up [--prompt TEXT]       router + scheduler + worker on localhost
    llmserve router|scheduler|worker  one service (docker-compose, Kubernetes)
    llmserve generate "prompt"        stream an answer from a running cluster

Every flag can also be set with an environment variable LLMSERVE_<FLAG> (e.g.
LLMSERVE_PORT=6000); a flag on the command line wins.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import sys
from pathlib import Path

logger = logging.getLogger("llmserve")

_SIZE_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
               "kib": 2**10, "mib": 2**20, "gib": 2**30}


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_bytes(text: str) -> int:
    """'2GiB' -> 2147483648, '512MB' -> 512000000, '1000' -> 1000."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 2GiB, 512MiB, 1000000)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


# --- flags ------------------------------------------------------------------------


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="local HF model directory; 'default' = the embedded SmolLM2-135M-Instruct")
    p.add_argument("--served-model-name", default=None, help="name clients use (default: the directory's name)")


def _add_scheduler_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="most tokens computed in one step (long prompts are chunked to fit)")
    p.add_argument("--no-chunked-prefill", action="store_true", help="prompts must fit one step whole")
    p.add_argument("--no-prefix-caching", action="store_true", help="never reuse the KV of earlier prompts")
    p.add_argument("--preemption-mode", default="auto", choices=["auto", "swap", "recompute"],
                   help="when KV blocks run out: swap to CPU, recompute later, or auto "
                        "(swap requests with several samples, recompute the others)")
    p.add_argument("--stream-interval", type=_at_least_one, default=1,
                   help="stream each sample's tokens N at a time (its first and last at once): fewer "
                        "messages, less control-plane CPU beside the model; 1 = every token")
    p.add_argument("--num-scheduler-steps", type=_at_least_one, default=1,
                   help="decode steps one plan may run back to back on the worker (multi-step "
                        "scheduling) while nothing waits: one plan, result and message per K tokens; "
                        "tokens reach clients K at a time; an arrival cuts a run short after one step")


def _add_worker_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="bytes for the KV cache, e.g. 2GiB (default: 10%% of available RAM)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="exact KV block count (overrides the budget)")
    p.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + completion tokens")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="paged attention kernels (auto: triton on CUDA, torch on CPU)")
    p.add_argument("--swap-space", type=float, default=4.0, help="GiB of CPU memory for swapped-out KV blocks")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="on GPU: fraction of device memory for weights, activations and the KV cache")


def _add_ops_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", type=int, default=0,
                   help="Prometheus endpoint http://HOST:PORT/metrics (0 = off)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="after SIGTERM, seconds in-flight streams may run on before they are aborted")


def _add_parallel_flags(p: argparse.ArgumentParser, group_member: bool) -> None:
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks (attention heads split)")
    p.add_argument("--pp-size", type=int, default=1, help="pipeline stages (layers split)")
    if not group_member:
        return
    p.add_argument("--rank", type=int, default=None,
                   help="this worker's rank in the group, pp_rank * tp_size + tp_rank (default: $RANK)")
    p.add_argument("--dist-init", default=None,
                   help="rendezvous tcp://HOST:PORT, served by rank 0 (default: $MASTER_ADDR:$MASTER_PORT)")
    p.add_argument("--dist-timeout", type=float, default=60.0,
                   help="seconds to wait for every rank to join, and for any collective")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start router, scheduler and worker on localhost")
    _add_model_flags(up)
    _add_scheduler_flags(up)
    _add_worker_flags(up)
    _add_parallel_flags(up, group_member=False)
    up.add_argument("--port", type=int, default=50051, help="the router's (public) port")
    up.add_argument("--scheduler-port", type=int, default=50052)
    up.add_argument("--worker-port", type=int, default=50053)
    up.add_argument("--prompt", default=None, help="answer this prompt (as a chat message), then stop")
    up.add_argument("--max-tokens", type=int, default=128, help="with --prompt")
    up.add_argument("--startup-timeout", type=float, default=600.0)
    _add_ops_flags(up)  # up: --metrics-port P serves router, scheduler, worker on P, P+1, P+2.
    up.add_argument("--config", type=Path, default=None,
                    help="YAML or TOML file of `up` flags (command line and environment override it)")

    router = sub.add_parser("router", help="the public gRPC API")
    _add_model_flags(router)
    router.add_argument("--host", default="0.0.0.0")
    router.add_argument("--port", type=int, default=50051)
    router.add_argument("--scheduler", default="localhost:50052", help="scheduler address")
    router.add_argument("--connect-timeout", type=float, default=600.0)
    _add_ops_flags(router)

    scheduler = sub.add_parser("scheduler", help="request queues, KV block tables, engine loop")
    _add_scheduler_flags(scheduler)
    scheduler.add_argument("--host", default="0.0.0.0")
    scheduler.add_argument("--port", type=int, default=50052)
    _add_ops_flags(scheduler)

    worker = sub.add_parser("worker", help="model shard + KV cache; executes step plans")
    _add_model_flags(worker)
    _add_worker_flags(worker)
    worker.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="tokens of the profiling forward that sizes the KV cache")
    worker.add_argument("--host", default="0.0.0.0")
    worker.add_argument("--port", type=int, default=50053, help="0 picks a free port")
    worker.add_argument("--advertise-host", default="localhost", help="host the scheduler dials back")
    worker.add_argument("--scheduler", default="localhost:50052", help="scheduler address to register with")
    _add_parallel_flags(worker, group_member=True)
    _add_ops_flags(worker)

    from llmserve.bench.cli import add_bench_parser

    add_bench_parser(sub, _add_model_flags, _add_scheduler_flags, parse_bytes)

    health = sub.add_parser("health", help="exit 0 if a service's grpc.health.v1 says SERVING (probes)")
    health.add_argument("--target", default="localhost:50051", help="service address")
    health.add_argument("--service", default="", help="service name to ask about ('' = the whole server)")
    health.add_argument("--timeout", type=float, default=5.0)

    gen = sub.add_parser("generate", help="stream an answer from a running cluster")
    gen.add_argument("prompt")
    gen.add_argument("--target", default="localhost:50051", help="router address")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    gen.add_argument("--max-tokens", type=int, default=None)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--ignore-eos", action="store_true")
    return parser


def apply_env_defaults(parser: argparse.ArgumentParser) -> None:
    """LLMSERVE_<DEST> environment variables become the defaults of every subcommand's flags."""
    actions = list(parser._actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                actions += subparser._actions
    for action in actions:
        if not action.option_strings or action.dest in ("help",):
            continue
        value = os.environ.get(f"LLMSERVE_{action.dest.upper()}")
        if value is None:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            action.default = value.lower() in ("1", "true", "yes", "on")
        elif isinstance(action, argparse._AppendAction):
            action.default = [v for v in value.split(",") if v]
        else:
            action.default = action.type(value) if action.type else value


# --- running services ----------------------------------------------------------------


def _model(args) -> tuple[Path, str]:
    from llmserve.model_store import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    return model_dir, args.served_model_name or model_dir.name


def _run_service(serve, config) -> int:
    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(config, stop)

    logger.info("config: %s", config)
    asyncio.run(main())
    return 0


def cmd_router(args) -> int:
    from llmserve.router.service import RouterConfig, serve

    model_dir, name = _model(args)
    return _run_service(serve, RouterConfig(
        model_dir=model_dir, model_name=name, scheduler_address=args.scheduler,
        host=args.host, port=args.port, connect_timeout_s=args.connect_timeout,
        metrics_port=args.metrics_port, shutdown_timeout_s=args.shutdown_timeout,
    ))


def cmd_scheduler(args) -> int:
    from llmserve.scheduler.service import SchedulerServiceConfig, serve

    return _run_service(serve, SchedulerServiceConfig(
        host=args.host, port=args.port, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=not args.no_chunked_prefill,
        enable_prefix_caching=not args.no_prefix_caching, preemption_mode=args.preemption_mode,
        metrics_port=args.metrics_port, shutdown_timeout_s=args.shutdown_timeout,
        stream_interval=args.stream_interval, num_scheduler_steps=args.num_scheduler_steps,
    ))


def cmd_worker(args) -> int:
    from llmserve.worker.service import WorkerConfig, serve

    model_dir, name = _model(args)
    return _run_service(serve, WorkerConfig(
        model_dir=model_dir, model_name=name, scheduler_address=args.scheduler,
        host=args.host, port=args.port, advertise_host=args.advertise_host, dtype=args.dtype,
        block_size=args.block_size, kv_cache_memory_bytes=args.kv_cache_memory,
        num_kv_blocks=args.num_kv_blocks, max_model_len=args.max_model_len,
        attention_backend=args.attention_backend,
        swap_space_bytes=int(args.swap_space * 2**30), max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        metrics_port=args.metrics_port, shutdown_timeout_s=args.shutdown_timeout,
        tp_size=args.tp_size, pp_size=args.pp_size, rank=args.rank, dist_init=args.dist_init,
        dist_timeout_s=args.dist_timeout,
    ))


def cmd_up(args) -> int:
    from llmserve.launcher import run_local_cluster

    return run_local_cluster(args)


def cmd_bench(args) -> int:
    from llmserve.bench.cli import run_bench

    return run_bench(args)


def cmd_health(args) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(args.target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
    except grpc.RpcError as err:
        print(f"{args.target}: {err.code().name} {err.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.target}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def cmd_generate(args) -> int:
    from llmserve.client import LLMServeClient

    async def main() -> int:
        async with LLMServeClient(args.target) as client:
            kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
            if args.chat:
                stream = client.generate(messages=[{"role": "user", "content": args.prompt}], **kwargs)
            else:
                stream = client.generate(args.prompt, **kwargs)
            async for delta in stream:
                print(delta.text, end="", flush=True)
            print()
        return 0

    return asyncio.run(main())


COMMANDS = {"up": cmd_up, "router": cmd_router, "scheduler": cmd_scheduler,
            "worker": cmd_worker, "generate": cmd_generate, "bench": cmd_bench, "health": cmd_health}


def load_up_config(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parses argv; for `up --config FILE`, the file's values become defaults (below the
    environment and the command line), then argv is parsed again."""
    from llmserve.config_file import apply_config_file

    args = parser.parse_args(argv)
    if args.command == "up" and args.config is not None:
        up = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["up"]
        apply_config_file(up, args.config)
        args = parser.parse_args(argv)
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    apply_env_defaults(parser)
    args = load_up_config(parser, argv)
    args.argv = ["llmserve", *(sys.argv[1:] if argv is None else argv)]
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s [{args.command}] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
