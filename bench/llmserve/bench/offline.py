"""`llmserve bench offline`: the offline throughput benchmark vLLM users run (`vllm bench
throughput --dataset-name random`): N prompts of exactly I random token ids, exactly O
tokens out of each (eos ignored), all given to the in-process engine at once; greedy and
at temperature 1.0, one after the other on the same runner. It reports req/s, output and
total tok/s, and the share of this machine's physical ceiling for the workload
(bench/ceiling.py: the matmul peak and memory bandwidth measured in the same run).

The engine keeps the worker's own sizing (the KV cache from --gpu-memory-utilization on
CUDA, the step budget by device), not the other benches' 1 GiB cap. Before each timed
run the first --warmup-prompts of the workload run untimed in the same sampling mode: on
CUDA, Triton compiles a kernel variant the first time a launch shows it a new
specialization, seconds that are not serving (throughput.compile_pass says more).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from llmserve.bench.ceiling import offline_ceiling
from llmserve.bench.clock import now
from llmserve.bench.flops import measure_peak_and_bandwidth
from llmserve.bench.report import add_output_dir_flag, machine_info, model_label, report_dir, write_json
from llmserve.bench.step_records import PlanTap
from llmserve.bench.workloads import BenchRequest, random_workload
from llmserve.contract.sampling import SamplingParams
from llmserve.launcher.engine import InProcessEngine
from llmserve.launcher.engine_settings import EngineSettings
from llmserve.settings import group
from llmserve.worker.config import RunnerConfig, WorkerConfig

TEMPERATURES = {"greedy": 0.0, "sampled": 1.0}  # vLLM's benchmark samples at temperature 1.0, top-p 1.
STEP_KINDS = ("prefill", "decode")  # A plan that carries prompt tokens; one of one-token rows only.


def _offline_engine() -> EngineSettings:
    return EngineSettings(worker=WorkerConfig(runner=RunnerConfig(swap_space=0)))


@dataclass(frozen=True)
class OfflineSettings:
    """The engine as served (no KV cap), without swap space: offline use needs none."""
    engine: EngineSettings = group(_offline_engine)


def step_kind(plan) -> str:
    """"decode" when every row computes one token (its last sampled one), else "prefill"."""
    if plan.new_requests or any(r.num_scheduled_tokens != 1 for r in plan.cached_requests):
        return "prefill"
    return "decode"


def run_once(runner, scheduling, requests: list[BenchRequest], temperature: float) -> dict:
    """Every request at once through a fresh scheduler on `runner`, timed to the last token;
    with where the time went: each engine step's wall time, charged to the plan whose
    result it read back (pipelined, the one launched before), by kind of plan."""
    tap = PlanTap(runner)
    engine = InProcessEngine(tap, scheduling)
    for i, r in enumerate(requests):
        engine.add_request(f"r{i}", r.prompt_token_ids, SamplingParams(max_tokens=r.output_len,
                                                                       temperature=temperature, ignore_eos=True))
    split = {kind: {"steps": 0, "seconds": 0.0, "tokens": 0, "rows": 0} for kind in STEP_KINDS}
    output_tokens = 0
    start = last = now(runner.device)
    while engine.has_unfinished():
        tap.last = None
        output_tokens += sum(len(out.new_token_ids) for out in engine.step())
        # NOTE: no device sync per step: each step reads a result back (its one wait).
        t = time.perf_counter()
        if tap.last is not None:
            plan = tap.last[0]
            kind = split[step_kind(plan)]
            kind["steps"] += 1
            kind["seconds"] += t - last
            kind["tokens"] += plan.total_scheduled_tokens
            kind["rows"] += len(plan.new_requests) + len(plan.cached_requests)
        last = t
    seconds = now(runner.device) - start
    runner.reset_requests()  # The last step's finished requests: the next scheduler never saw them.
    if output_tokens != sum(r.output_len for r in requests):
        raise RuntimeError(f"{output_tokens} output tokens, {sum(r.output_len for r in requests)} asked for")
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    return {"seconds": seconds, "requests_per_s": len(requests) / seconds, "output_tokens": output_tokens,
            "output_tokens_per_s": output_tokens / seconds,
            "total_tokens_per_s": (prompt_tokens + output_tokens) / seconds, "num_steps": engine.num_plans,
            "num_preemptions": engine.scheduler.stats().num_preemptions,
            "loop": "pipelined" if engine.pipelined else "serial", "steps_by_kind": split}


@dataclass(frozen=True)
class OfflineWorkload:
    """N prompts of exactly `input_len` random ids (from `seed`), `output_len` tokens out each."""

    num_prompts: int
    input_len: int
    output_len: int
    seed: int = 0

    def requests(self, vocab_size: int) -> list[BenchRequest]:
        return random_workload(self.num_prompts, (self.input_len,) * 2, (self.output_len,) * 2, vocab_size, self.seed)


def measure_offline(model_dir: Path, runner_settings: RunnerConfig, scheduling, workload: OfflineWorkload,
                    modes: list[str], warmup: int, save: Callable[[dict], None] = lambda body: None,
                    calibrate_s: float = 1.0) -> dict:
    """This machine's ceiling for the workload and each sampling mode's figures: the report's
    body, also handed to `save` after each mode (a run stopped by a timeout keeps the modes done)."""
    from llmserve.bench.throughput import engine_device_and_precision
    from llmserve.worker.model_runner import ModelRunner

    device, dtype, _ = engine_device_and_precision(model_dir, runner_settings)
    # NOTE: before the engine takes its share of the device's memory (then handed back).
    peak, bandwidth = measure_peak_and_bandwidth(dtype, device, calibrate_s)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    runner = ModelRunner(model_dir, runner_settings)
    requests = workload.requests(runner.config.vocab_size)
    ceiling = offline_ceiling(runner.config, runner.dtype, workload.num_prompts, workload.input_len,
                              workload.output_len, peak, bandwidth)
    print_ceiling(ceiling, runner.dtype, peak, bandwidth)  # First: a run cut short by a timeout still shows it.
    body = {"device": str(runner.device), "dtype": str(runner.dtype).removeprefix("torch."),
            "uses_graphs": runner.graphs is not None, "num_kv_blocks": runner.info.num_kv_blocks,
            "workload": {**asdict(workload), "warmup_prompts": warmup},
            "matmul_peak_gflop_per_s": peak / 1e9, "memory_bandwidth_gb_per_s": bandwidth / 1e9,
            "ceiling": ceiling, "results": {}}
    for mode in modes:
        if warmup:
            run_once(runner, scheduling, requests[:warmup], TEMPERATURES[mode])
        result = run_once(runner, scheduling, requests, TEMPERATURES[mode])
        body["results"][mode] = {**result, "share_of_ceiling": ceiling["seconds"] / result["seconds"]}
        print_row(mode, body["results"][mode])
        save(body)
    return body


def print_row(mode: str, r: dict) -> None:
    print(f"{mode:<8} {r['seconds']:8.2f} s  {r['requests_per_s']:8.2f} req/s  {r['output_tokens_per_s']:10,.0f} "
          f"output tok/s  {r['total_tokens_per_s']:11,.0f} total tok/s  {100 * r['share_of_ceiling']:5.1f}% of "
          f"the ceiling  ({r['num_steps']} steps, {r['num_preemptions']} preemptions, {r['loop']} loop)", flush=True)
    for kind, k in r["steps_by_kind"].items():
        if k["steps"]:
            print(f"         {kind} steps: {k['steps']} in {k['seconds']:.2f} s ({1000 * k['seconds'] / k['steps']:.2f} "
                  f"ms each, {k['tokens'] / k['steps']:,.0f} tokens and {k['rows'] / k['steps']:,.0f} rows on "
                  f"average)", flush=True)


def print_ceiling(c: dict, dtype: torch.dtype, peak: float, bandwidth: float) -> None:
    rate = f"{peak / 1e12:,.0f} TFLOP/s" if peak >= 1e12 else f"{peak / 1e9:,.0f} GFLOP/s"
    print(f"ceiling ({str(dtype).removeprefix('torch.')} matmul {rate}, memory "
          f"{bandwidth / 1e9:,.0f} GB/s): {c['seconds']:.2f} s = {c['output_tokens_per_s']:,.0f} output tok/s, "
          f"{c['bound']}-bound (compute {c['compute_s']:.2f} s, memory {c['memory_s']:.2f} s)", flush=True)
    print(f"formula: {c['formula']}", flush=True)


def bench_offline(args) -> int:
    from llmserve.model_store import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    model = model_label(model_dir)
    workload = OfflineWorkload(args.num_prompts, args.input_len, args.output_len, args.seed)
    modes = list(dict.fromkeys(args.sampling))
    print(f"offline: {model}, {workload.num_prompts} prompts x {workload.input_len} in / {workload.output_len} out, "
          f"{', '.join(modes)}", flush=True)
    folder = report_dir(args.output_dir)
    path = folder / f"offline-{model}-{time.strftime('%Y%m%d-%H%M%S')}.json" if folder else None
    head = {"kind": "offline", "model": model, "machine": machine_info(), "command": " ".join(args.argv)}
    measure_offline(model_dir, args.engine.worker.runner, args.engine.scheduling, workload, modes,
                    min(args.warmup_prompts, workload.num_prompts),
                    save=lambda body: path and write_json({**head, **body}, path), calibrate_s=args.calibrate_s)
    if path:
        print(f"wrote {path}", flush=True)
    return 0


def add_offline_flags(p) -> None:
    from llmserve.settings import add_flags

    add_flags(p, OfflineSettings)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens of every request")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated by every request (eos ignored)")
    p.add_argument("--sampling", nargs="+", choices=list(TEMPERATURES), default=list(TEMPERATURES),
                   help="greedy (temperature 0) and sampled (temperature 1.0), each its own timed run")
    p.add_argument("--warmup-prompts", type=int, default=64, help="untimed prompts before each timed run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calibrate-s", type=float, default=1.0,
                   help="seconds measuring the memory bandwidth (the matmul peak: 1.5x that)")
    add_output_dir_flag(p)
