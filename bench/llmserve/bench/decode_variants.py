"""`llmserve bench decode-variants`: decode tokens/s per weight format (float32,
bfloat16, int8 W8A8, weight-only int8 ...), at each batch size, side by side in one run.

Each variant is a model runner of its own (its own weights, KV cache of exactly the
largest batch). The timing is `decode_graphs.time_modes`: at each batch size every
variant gets the same random prompts, past their prefill; the timed steps are whole
engine steps (schedule, inputs, forward, sampling, update); the variants take turns in
chunks so a drift of a shared machine lands on all of them; a cell is its median step.
Beside each cell: the speed over bfloat16 that bytes alone allow (`roofline_over_bfloat16`),
issue #34's "where the roofline allows" for int8.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from llmserve.bench.decode_graphs import SPARE_TOKENS, time_modes
from llmserve.bench.flops import ModelBytes
from llmserve.bench.profile_step import decode_kv_blocks
from llmserve.bench.report import machine_info, save_report

# name -> (dtype, quantization): int8 is W8A8 where the CPU has VNNI; int8-wo keeps
# bfloat16 activations (weight-only); int8-fp32 runs int8 with float32 activations.
VARIANTS = {"float32": ("float32", "none"), "bfloat16": ("bfloat16", "none"), "int8": ("bfloat16", "int8"),
            "int8-wo": ("bfloat16", "int8-weight-only"), "int8-fp32": ("float32", "int8")}


def step_bytes(config, name: str, batch: int, context: int) -> int:
    """Bytes one decode step of variant `name` reads: the linear weights, the LM head, and
    the K/V of `batch` sequences of `context` tokens (ModelBytes: int8 weights one byte
    each). The activations, by a rough count ~7% of an int8 step's bytes at batch 16
    (SmolLM2-135M, context 256), are left out."""
    dtype, quantization = VARIANTS[name]
    model_bytes = ModelBytes.from_config(config, getattr(torch, dtype), quantization)
    return model_bytes.linear_bytes + model_bytes.lm_head_bytes + model_bytes.kv_bytes_per_token * batch * context


def roofline_over_bfloat16(config, name: str, batch: int, context: int) -> float:
    """bfloat16's step bytes over variant `name`'s: the most it can gain on a step bound by
    streaming memory."""
    return step_bytes(config, "bfloat16", batch, context) / step_bytes(config, name, batch, context)


def variant_runners(model_dir, base, names: list[str], max_batch: int, context: int, max_new_tokens: int) -> dict:
    """{name: ModelRunner} with each variant's dtype and quantization."""
    from llmserve.worker.model_runner import ModelRunner

    blocks = decode_kv_blocks(max_batch, context, max_new_tokens, base.block_size)
    runners = {}
    for name in names:
        dtype, quantization = VARIANTS[name]
        settings = replace(base, dtype=dtype, quantization=quantization, num_kv_blocks=blocks, swap_space=0,
                           max_num_seqs=max_batch)
        runners[name] = ModelRunner(model_dir, settings)
    return runners


def compare_variants(model_dir, base, names: list[str], batches: list[int], context: int, steps: int) -> dict:
    """Per batch size: each variant's median step (ms), tokens/s, and speed over bfloat16."""
    runners = variant_runners(model_dir, base, names, max(batches), context, steps + SPARE_TOKENS)
    device, config = next(iter(runners.values())).device, next(iter(runners.values())).config
    print(f"decode tok/s (x bfloat16; what bytes allow), context {context}, on {device}, median of {steps} steps "
          "per cell:", flush=True)
    print(f"{'batch':>5}  " + "  ".join(f"{n:>26}" for n in names), flush=True)
    rows = {}
    for batch in batches:
        seconds = time_modes(runners, batch, context, steps)
        rows[batch] = {name: {"step_ms": 1000 * s, "tok_per_s": batch / s,
                              "roofline_over_bfloat16": roofline_over_bfloat16(config, name, batch, context)}
                       for name, s in seconds.items()}
        if "bfloat16" in seconds:
            for name, s in seconds.items():
                rows[batch][name]["over_bfloat16"] = seconds["bfloat16"] / s
        print_row(batch, rows[batch], names)
    return {"device": str(device), "variants": {n: dict(zip(("dtype", "quantization"), VARIANTS[n])) for n in names},
            "context": context, "steps": steps, "batches": rows}


def print_row(batch: int, row: dict, names: list[str]) -> None:
    cells = [f"{row[n]['tok_per_s']:>9.1f} ({row[n].get('over_bfloat16', float('nan')):.2f}x; "
             f"{row[n]['roofline_over_bfloat16']:.2f}x)" for n in names]
    print(f"{batch:>5}  " + "  ".join(f"{c:>26}" for c in cells), flush=True)


def bench_decode_variants(args) -> int:
    from llmserve.model_store import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    result = compare_variants(model_dir, args.engine.worker.runner, args.variants, sorted(set(args.batch)),
                              args.context, args.steps)
    report = {"kind": "decode-variants", "machine": machine_info(), "command": " ".join(args.argv), **result}
    save_report(report, args.output_dir, f"decode-variants-{time.strftime('%Y%m%d-%H%M%S')}.json")
    return 0
