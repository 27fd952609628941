"""`llmserve bench loops`: the serial engine loop against the pipelined one
(SchedulerConfig.async_scheduling False / True) on a real model, side by side in one run.

The comparison runs through a local cluster as deployed (router, scheduler, worker
processes, mutual TLS; the scheduler service's loop, scheduler/engine_loop.py, plans step
N+1 while the worker runs step N), one cluster per loop, the same worker settings in
both: what the gRPC hops and the processes cost is in it. (`bench decode-floor` times
the in-process engine's two loops, launcher/engine.py.) Per batch size B: B requests at once, short random prompts,
`--max-tokens` each (eos ignored), streamed as clients see them. The figure is the steady
decode rate: tokens per second while all B decode (bench/overhead.py's window: after the
last first token, before the first finish), and pipelined / serial.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

from llmserve.bench.overhead import Scenario, drive, prompts, steady_state
from llmserve.bench.report import add_output_dir_flag, machine_info, model_label, save_report
from llmserve.contract.arith import cdiv

LOOPS = {"serial": False, "pipelined": True}
WARMUP_TOKENS = 8  # A first untimed pass at each batch size: Triton's compiles, the graphs' first replays.


def cluster_spec(model_dir: Path, runner, pipelined: bool, batches: list[int], prompt_len: int, max_tokens: int,
                 log_dir: Path | None):
    """A cluster whose worker serves `runner`'s settings, with a KV cache for the largest
    batch (no profiling, no preemption) and graphs up to it."""
    from llmserve.launcher.cluster import ClusterSpec, free_port
    from llmserve.scheduler.config import SchedulerConfig, SchedulerServiceConfig
    from llmserve.worker.config import WorkerConfig

    largest = max(batches)
    blocks = largest * cdiv(prompt_len + max_tokens, runner.block_size) + 64
    runner = replace(runner, num_kv_blocks=blocks, swap_space=0, max_num_seqs=largest)
    scheduling = replace(SchedulerConfig(), max_num_seqs=largest, async_scheduling=pipelined)
    return ClusterSpec(model_dir=model_dir, worker=WorkerConfig(runner=runner),
                       scheduler=SchedulerServiceConfig(scheduling=scheduling), router_port=free_port(),
                       scheduler_port=free_port(), worker_port=free_port(), log_level="WARNING", log_dir=log_dir)


async def run_batches(cluster, batches: list[int], prompt_len: int, max_tokens: int, vocab_size: int,
                      seed: int) -> dict[int, dict]:
    """Each batch size once untimed (WARMUP_TOKENS each), then timed."""
    rows = {}
    async with cluster.client() as client:
        for batch in batches:
            warm = Scenario(f"warmup-{batch}", batch, prompt_len, WARMUP_TOKENS)
            await drive(client, warm, prompts(warm, vocab_size, seed))
            scenario = Scenario(f"decode-{batch}", batch, prompt_len, max_tokens)
            wall, outputs, arrivals = await drive(client, scenario, prompts(scenario, vocab_size, seed + 1))
            errors = [o for o in outputs if not isinstance(o, list)]
            if errors:
                raise RuntimeError(f"batch {batch}: {len(errors)} requests failed, the first: {errors[0]!r}")
            steady = steady_state(arrivals, 0.0)
            tokens = sum(len(o) for o in outputs)
            rows[batch] = {"wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
                           "steady_window_s": steady["steady_window_s"], "steady_steps": steady["steady_steps"],
                           "steady_tokens_per_s": (batch * steady["steady_steps"] / steady["steady_window_s"]
                                                   if steady["steady_window_s"] else 0.0)}
    return rows


def compare_loops(model_dir: Path, runner, batches: list[int], prompt_len: int, max_tokens: int,
                  log_dir: Path | None = None, seed: int = 0) -> dict:
    """Per loop and batch size: whole-run and steady decode tok/s; per batch size, the
    pipelined loop's steady rate over the serial one's."""
    from llmserve.launcher.cluster import LocalCluster
    from llmserve.worker.device import resolve_device
    from llmserve.worker.models.loader import load_config

    vocab_size = load_config(model_dir).vocab_size
    loops = {}
    for name, pipelined in LOOPS.items():
        spec = cluster_spec(model_dir, runner, pipelined, batches, prompt_len, max_tokens, log_dir)
        with LocalCluster(spec) as cluster:
            loops[name] = asyncio.run(run_batches(cluster, batches, prompt_len, max_tokens, vocab_size, seed))
        print_loop(name, loops[name])
    ratios = {b: loops["pipelined"][b]["steady_tokens_per_s"] / loops["serial"][b]["steady_tokens_per_s"]
              for b in batches if loops["serial"][b]["steady_tokens_per_s"]}
    return {"device": str(resolve_device(runner.device)), "dtype": runner.dtype, "prompt_len": prompt_len,
            "max_tokens": max_tokens, "transport": "mutual TLS", "loops": loops, "pipelined_over_serial": ratios}


def print_loop(name: str, rows: dict[int, dict]) -> None:
    for batch, r in rows.items():
        print(f"{name:<9} batch {batch:>4}: {r['output_tokens']:>7} tokens in {r['wall_s']:6.2f} s = "
              f"{r['output_tokens_per_s']:9,.0f} tok/s; steady {r['steady_tokens_per_s']:9,.0f} tok/s "
              f"({r['steady_steps']:.0f} steps in {r['steady_window_s']:.2f} s)", flush=True)


def bench_loops(args) -> int:
    from llmserve.model_store import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    batches = sorted(set(args.batch))
    result = compare_loops(model_dir, args.engine.worker.runner, batches, args.prompt_len, args.max_tokens,
                           Path(args.log_dir) if args.log_dir else None, args.seed)
    for batch, ratio in result["pipelined_over_serial"].items():
        print(f"batch {batch}: pipelined / serial steady decode = {ratio:.2f}x", flush=True)
    model = model_label(model_dir)
    report = {"kind": "loops", "model": model, "machine": machine_info(), "command": " ".join(args.argv), **result}
    save_report(report, args.output_dir, f"loops-{model}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    return 0


def add_loops_flags(p) -> None:
    p.add_argument("--batch", type=int, nargs="+", default=[64], help="decode batch sizes, one pass each per loop")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of each request")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens each request generates (eos ignored)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None, help="the clusters' logs go here")
    add_output_dir_flag(p)
