"""`llmserve bench decode-floor`: decode steps at each batch size against the least time
this machine allows them (bench/ceiling.py: weights + K/V bytes at the measured memory
bandwidth, or FLOPs at the measured matmul peak where that is more).

One runner as served (CUDA graphs unless --enforce-eager), a KV cache of exactly the
largest batch; per batch size `batch` sequences of `--context` random tokens are
prefilled (in chunks of PREFILL_CHUNK tokens), then a run of whole engine steps is timed
(schedule, inputs, forward, sampling, update), the device synced at the run's two ends
only: the mean step, its tok/s and floor / step, the floor taken at the sequences' mean
context in the middle of the run. The engine loop is the served one (pipelined on CUDA:
a step's host work overlaps the step before it on the device); where that is pipelined,
the serial loop's step is timed too, side by side.
"""

from __future__ import annotations

import time
from dataclasses import replace

from llmserve.bench.ceiling import DECODE_FORMULA, decode_floor
from llmserve.bench.clock import now
from llmserve.contract.arith import cdiv
from llmserve.bench.decode_graphs import SPARE_TOKENS, WARMUP_STEPS
from llmserve.bench.flops import measure_peak_and_bandwidth
from llmserve.bench.profile_step import decode_kv_blocks, prefilled_engine
from llmserve.bench.report import machine_info, model_label, save_report

PREFILL_CHUNK = 16384  # Tokens a prefill step carries: the H100 step budget, whatever the device.


def new_tokens(batch: int, context: int, steps: int) -> int:
    """Tokens each sequence may generate: the timed steps, the warm-up's and a margin
    (SPARE_TOKENS), and one per prefill chunk after its own (a sequence prefilled in the
    first chunk decodes while the others prefill), so none finishes while timed."""
    return steps + SPARE_TOKENS + cdiv(batch * context, PREFILL_CHUNK)


def mean_step(runner, batch: int, context: int, steps: int,
              pipelined: bool | None = None) -> tuple[float, float, bool]:
    """Seconds of the mean of `steps` consecutive decode steps at `batch` (after
    WARMUP_STEPS), the mean context (cached tokens per sequence) at the middle step, and
    whether the engine loop was pipelined (`pipelined`: which loop; None: as served)."""
    engine = prefilled_engine(runner, batch, context, new_tokens(batch, context, steps),
                              max_num_batched_tokens=max(PREFILL_CHUNK, batch), pipelined=pipelined)
    for _ in range(WARMUP_STEPS):
        engine.step()
    mean_context = float(context)
    start = now(runner.device)
    for i in range(steps):
        if i == steps // 2:
            running = list(engine.scheduler.running)
            mean_context = sum(s.num_computed_tokens for s in running) / len(running)
        engine.step()
    seconds = (now(runner.device) - start) / steps
    runner.reset_requests()  # The next batch size starts from a fresh scheduler (and a plan may be in flight).
    return seconds, mean_context, engine.pipelined


def measure_decode_floor(model_dir, base, batches: list[int], context: int, steps: int,
                         calibrate_s: float = 1.0, pipelined: bool | None = None) -> dict:
    """Per batch size: the mean step, tok/s, the floor and floor / step; and the serial
    loop's step where the loop (`pipelined`; None: as served) is pipelined."""
    from llmserve.worker.model_runner import ModelRunner

    largest = max(batches)
    settings = replace(base, num_kv_blocks=decode_kv_blocks(largest, context, new_tokens(largest, context, steps),
                                                             base.block_size),
                       swap_space=0, max_num_seqs=largest)
    runner = ModelRunner(model_dir, settings)
    # NOTE: measured beside the model and its cache, as they will run: a few GiB spare.
    peak, bandwidth = measure_peak_and_bandwidth(runner.dtype, runner.device, calibrate_s)
    rows = {}
    ran_pipelined = False
    for batch in batches:
        step, mean_context, ran_pipelined = mean_step(runner, batch, context, steps, pipelined)
        floor = decode_floor(runner.config, runner.dtype, batch, round(mean_context), peak, bandwidth)
        rows[batch] = {"step_ms": 1000 * step, "tok_per_s": batch / step, "floor_ms": 1000 * floor["seconds"],
                       "bound": floor["bound"], "share_of_floor": floor["seconds"] / step,
                       "mean_context": mean_context}
        if ran_pipelined:
            rows[batch]["serial_step_ms"] = 1000 * mean_step(runner, batch, context, steps, pipelined=False)[0]
    return {"device": str(runner.device), "dtype": str(runner.dtype).removeprefix("torch."),
            "uses_graphs": runner.graphs is not None, "loop": "pipelined" if ran_pipelined else "serial",
            "context": context, "steps": steps,
            "matmul_peak_gflop_per_s": peak / 1e9, "memory_bandwidth_gb_per_s": bandwidth / 1e9,
            "formula": DECODE_FORMULA, "batches": rows}


def print_table(result: dict, model: str) -> None:
    print(f"decode steps of {model}, context {result['context']}, {result['dtype']} on {result['device']} "
          f"({'CUDA graphs' if result['uses_graphs'] else 'eager'}); memory "
          f"{result['memory_bandwidth_gb_per_s']:,.0f} GB/s, matmul {result['matmul_peak_gflop_per_s']:,.0f} "
          f"GFLOP/s, {result['loop']} loop, mean of {result['steps']} steps:", flush=True)
    print(f"{'batch':>5}  {'step ms':>9}  {'tok/s':>10}  {'floor ms':>9}  {'of floor':>8}", flush=True)
    for batch, row in result["batches"].items():
        serial = row.get("serial_step_ms")
        versus = f"; serial loop {serial:.3f} ms = {serial / row['step_ms']:.2f}x" if serial else ""
        print(f"{batch:>5}  {row['step_ms']:>9.3f}  {row['tok_per_s']:>10,.0f}  {row['floor_ms']:>9.3f}  "
              f"{100 * row['share_of_floor']:>7.1f}%  ({row['bound']}-bound{versus})", flush=True)
    print(f"floor: {result['formula']}", flush=True)


def bench_decode_floor(args) -> int:
    from llmserve.model_store import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    result = measure_decode_floor(model_dir, args.engine.worker.runner, sorted(set(args.batch)), args.context,
                                  args.steps, args.calibrate_s, args.engine.scheduling.async_scheduling)
    model = model_label(model_dir)
    print_table(result, model)
    report = {"kind": "decode-floor", "model": model, "machine": machine_info(),
              "command": " ".join(args.argv), **result}
    save_report(report, args.output_dir, f"decode-floor-{model}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    return 0
