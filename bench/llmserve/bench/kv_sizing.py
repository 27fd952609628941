"""`llmserve bench kv-sizing`: does the worker's KV cache take what fits, and no more?

Starts a model runner exactly as the worker does (profiling forward, decode graphs), then
compares what it allocated, N blocks x bytes per block, with what fits, measured
independently once start-up is over:

  CUDA: fits = total x gpu_memory_utilization - (device memory in use - the KV cache)
        (in use = total - free from the driver: weights, graph pool, CUDA context,
        cuBLAS/Triton workspaces, other processes)
  CPU:  fits = --kv-cache-memory (the budget is explicit there; required)

Within 5% is the target: the profiling forward's activation peak (freed once start-up is
over) and rounding down to whole blocks are all that should separate the two. A short
request of a full step's tokens then runs on the sized cache, proving the activations
still fit beside it.
"""

from __future__ import annotations

import logging
import time

import torch

from llmserve.bench.clock import synchronize
from llmserve.bench.report import machine_info, save_report


class _Lines(logging.Handler):
    """Keeps the formatted messages of the records it sees."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def start_runner(model_dir, settings):
    """A ModelRunner started as the worker starts it, and the runner's start-up log lines
    ("profiling on cuda:0: ... KV cache budget ...", "# KV blocks: N ...")."""
    from llmserve.worker.model_runner import ModelRunner

    logger, handler = logging.getLogger("llmserve.worker.model_runner"), _Lines()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        runner = ModelRunner(model_dir, settings)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return runner, handler.lines


def fits_bytes(runner, settings, kv_bytes: int) -> tuple[int, dict]:
    """Bytes the KV cache could take, measured now (see the module docstring), and the
    memory figures it came from."""
    device = runner.device
    if device.type != "cuda":
        return settings.kv_cache_memory, {"budget": settings.kv_cache_memory}
    synchronize(device)
    torch.cuda.empty_cache()  # What the allocator caches but no tensor holds is free to take.
    free, total = torch.cuda.mem_get_info(device)
    other = total - free - kv_bytes
    return int(total * settings.gpu_memory_utilization) - other, {
        "total": total, "free": free, "in_use": total - free, "in_use_besides_kv": other,
        "gpu_memory_utilization": settings.gpu_memory_utilization}


def smoke_step(runner, num_tokens: int) -> dict:
    """One request of `num_tokens` prompt tokens (a full step's budget) and 4 outputs on the
    sized cache; on CUDA the activation peak it added."""
    from llmserve.contract.sampling import SamplingParams
    from llmserve.launcher.engine import InProcessEngine
    from llmserve.scheduler.config import SchedulerConfig

    device = runner.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    engine = InProcessEngine(runner, SchedulerConfig(max_num_batched_tokens=num_tokens))
    prompt = [i % runner.config.vocab_size for i in range(min(num_tokens, runner.max_model_len - 8))]
    done = engine.run([("smoke", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))])
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
    return {"prompt_tokens": len(prompt), "output_tokens": len(done["smoke"].output_token_ids),
            "activation_peak_bytes": peak}


def check_kv_sizing(model_dir, settings) -> dict:
    from llmserve.worker import kv_cache as kvc
    from llmserve.worker.models.decoder import head_dim_of, local_kv_heads

    runner, lines = start_runner(model_dir, settings)
    cfg = runner.config
    block_bytes = kvc.bytes_per_block(runner.block_size, local_kv_heads(cfg, 1), head_dim_of(cfg),
                                      runner.model.num_local_layers, runner.dtype)
    kv_bytes = runner.num_kv_blocks * block_bytes
    allocated = sum(t.numel() * t.element_size() for t in runner.kv_caches)
    fits, memory = fits_bytes(runner, settings, allocated)
    return {
        "device": str(runner.device), "dtype": str(runner.dtype).removeprefix("torch."),
        "uses_graphs": runner.graphs is not None, "log_lines": lines,
        "num_kv_blocks": runner.num_kv_blocks, "block_bytes": block_bytes, "kv_bytes": kv_bytes,
        "kv_bytes_allocated": allocated, "fits_bytes": fits, "kv_over_fits": kv_bytes / fits, "memory": memory,
        "smoke": smoke_step(runner, runner.settings.max_num_batched_tokens),  # As resolved by device.
    }


def bench_kv_sizing(args) -> int:
    from llmserve.model_store import resolve_model_dir
    from llmserve.worker.device import resolve_device

    runner_settings = args.engine.worker.runner
    if resolve_device(runner_settings.device).type != "cuda" and runner_settings.kv_cache_memory is None:
        print("bench kv-sizing: on the CPU the KV budget is explicit: pass --kv-cache-memory", flush=True)
        return 2
    result = check_kv_sizing(resolve_model_dir(args.model), runner_settings)
    for line in result["log_lines"]:
        print(f"worker: {line}", flush=True)
    print(f"KV cache: {result['num_kv_blocks']} blocks x {result['block_bytes']} B = "
          f"{result['kv_bytes'] / 2**30:.3f} GiB; fits after start-up: {result['fits_bytes'] / 2**30:.3f} GiB "
          f"({100 * result['kv_over_fits']:.1f}%); a {result['smoke']['prompt_tokens']}-token request then ran",
          flush=True)
    report = {"kind": "kv-sizing", "machine": machine_info(), "command": " ".join(args.argv), **result}
    save_report(report, args.output_dir, f"kv-sizing-{time.strftime('%Y%m%d-%H%M%S')}.json")
    return 0
