"""`llmserve bench throughput`: one workload through the in-process engine, optionally
through a local three-process cluster over gRPC and through HF transformers, all in
the same run so the ratios are measured side by side."""

from __future__ import annotations

import asyncio
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

from llmserve.bench.workloads import BenchRequest, random_workload, reference_workload, summary
from llmserve.engine import InProcessEngine
from llmserve.sampling import SamplingParams


def _sampling(r: BenchRequest) -> SamplingParams:
    return SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)


def run_in_process(model_dir: Path, requests: list[BenchRequest], dtype: str, kv_cache_memory_bytes: int | None,
                   max_num_seqs: int, max_num_batched_tokens: int) -> dict:
    engine = InProcessEngine.from_model_dir(model_dir, dtype=dtype, kv_cache_memory_bytes=kv_cache_memory_bytes,
                                            max_num_seqs=max_num_seqs,
                                            max_num_batched_tokens=max_num_batched_tokens)
    # Warm-up: first calls pay for lazy initialisation inside torch.
    engine.run([("warmup", requests[0].prompt_token_ids[:16], SamplingParams(max_tokens=2, temperature=0.0))])
    engine.steps.clear()
    start = time.perf_counter()
    done = engine.run([(f"r{i}", r.prompt_token_ids, _sampling(r)) for i, r in enumerate(requests)])
    seconds = time.perf_counter() - start
    out_tokens = sum(len(c.output_token_ids) for c in done.values())
    steps = engine.steps
    step_time = sum(s.seconds for s in steps)
    kv_util = sum(s.seconds * s.live_tokens / max(s.allocated_slots, 1) for s in steps) / step_time
    block_size = engine.scheduler.kv.block_size
    return {
        "seconds": seconds,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / seconds,
        "total_tokens_per_s": (out_tokens + sum(len(r.prompt_token_ids) for r in requests)) / seconds,
        "num_steps": len(steps),
        "kv_utilisation": kv_util,
        "peak_blocks_in_use": max(s.allocated_slots for s in steps) // block_size,
        "num_preemptions": engine.scheduler.stats().num_preemptions,
        "outputs": {rid: c.output_token_ids for rid, c in done.items()},
    }


def run_through_grpc(model_dir: Path, requests: list[BenchRequest], dtype: str, kv_cache_memory_bytes: int | None,
                     max_num_seqs: int, max_num_batched_tokens: int) -> dict:
    from llmserve.client import LLMServeClient
    from llmserve.launcher import ClusterSpec, LocalCluster, free_port

    worker_args = ["--dtype", dtype]
    if kv_cache_memory_bytes is not None:
        worker_args += ["--kv-cache-memory", str(kv_cache_memory_bytes)]
    spec = ClusterSpec(model_dir=model_dir, router_port=free_port(), scheduler_port=free_port(),
                       worker_port=free_port(), log_level="WARNING",
                       scheduler_args=["--max-num-seqs", str(max_num_seqs),
                                       "--max-num-batched-tokens", str(max_num_batched_tokens)],
                       worker_args=worker_args)

    async def one(client, i: int, r: BenchRequest) -> tuple[str, list[int]]:
        ids = []
        async for delta in client.generate(token_ids=r.prompt_token_ids, max_tokens=r.output_len,
                                           temperature=0.0, ignore_eos=True):
            ids += delta.token_ids
        return f"r{i}", ids

    async def run_all() -> tuple[float, dict]:
        async with LLMServeClient(cluster.router_address) as client:
            await one(client, -1, BenchRequest(requests[0].prompt_token_ids[:16], 2))  # Warm-up.
            start = time.perf_counter()
            results = await asyncio.gather(*(one(client, i, r) for i, r in enumerate(requests)))
            return time.perf_counter() - start, dict(results)

    with LocalCluster(spec) as cluster:
        seconds, outputs = asyncio.run(run_all())
    out_tokens = sum(len(v) for v in outputs.values())
    return {"seconds": seconds, "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / seconds,
            "outputs": outputs}


def machine_info() -> dict:
    try:
        revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                  cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        revision = ""
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "git_revision": revision}


def bench_throughput(args) -> int:
    from llmserve.model_store import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    if args.workload == "reference":
        requests = reference_workload(vocab)
    else:
        requests = random_workload(args.num_requests, tuple(args.input_len), tuple(args.output_len), vocab,
                                   seed=args.seed)
    report = {"workload": {"name": args.workload, **summary(requests)}, "machine": machine_info(),
              "dtype": args.dtype, "results": {}}
    print(f"workload {args.workload}: {summary(requests)}", flush=True)
    common = dict(dtype=args.dtype, kv_cache_memory_bytes=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens)
    engine = run_in_process(model_dir, requests, **common)
    report["results"]["engine"] = engine
    _print_row("llmserve in-process", engine)
    if args.through_grpc:
        grpc_run = run_through_grpc(model_dir, requests, **common)
        grpc_run["matches_in_process"] = grpc_run["outputs"] == engine["outputs"]
        report["results"]["grpc"] = grpc_run
        _print_row("llmserve through gRPC", grpc_run, engine)
    if args.baseline == "hf":
        dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
        from llmserve.bench.hf_baseline import run_hf_static

        hf = run_hf_static(model_dir, requests, batch_size=args.hf_batch_size, dtype=dtype)
        report["results"]["hf_static"] = hf
        _print_row(f"HF generate, static batch {args.hf_batch_size}", hf, engine)
    for result in report["results"].values():
        result.pop("outputs", None)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.output}")
    return 0


def _print_row(label: str, result: dict, engine: dict | None = None) -> None:
    line = f"{label:<34} {result['output_tokens']:>6} tokens in {result['seconds']:7.1f} s = " \
           f"{result['output_tokens_per_s']:7.1f} output tok/s"
    if engine is not None:
        line += f"   (engine / this = {engine['output_tokens_per_s'] / result['output_tokens_per_s']:.2f}x)"
    if "kv_utilisation" in result:
        line += f"   KV utilisation {100 * result['kv_utilisation']:.1f}%, peak blocks {result['peak_blocks_in_use']}"
    print(line, flush=True)
