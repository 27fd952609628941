"""`llmserve bench decode`: decode tokens/s with CUDA graphs against eager steps
(`--enforce-eager`), at each batch size, side by side in one run.

Two runners share one copy of the weights: one captures its decode graphs (the ladder up
to the largest batch asked for), the other runs every step eagerly. At each batch size
both get `batch` sequences of `context` prompt tokens, past their prefill, and the timed
steps are pure decode steps, whole engine steps (schedule, inputs, forward, sampling,
update): what a client's tokens/s sees. The two modes take turns in chunks, so a drift
of the machine lands on both. A cell's figure is its median step: steady state, not a
one-off stall. On the CPU there are no graphs: both columns run eagerly (the mode runs,
its ratio is ~1).

With `--mixed CHUNK DECODES`, one more cell: steps that each prefill a new CHUNK-token
prompt beside DECODES decode rows (issue #31's mixed step: piecewise graphs on CUDA,
everything but attention replayed), with graphs against eager, the same way.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import replace

import torch

from llmserve.bench.clock import now
from llmserve.bench.profile_step import decode_kv_blocks, prefilled_engine
from llmserve.bench.report import machine_info, save_report
from llmserve.contract.arith import cdiv
from llmserve.contract.sampling import SamplingParams

MODES = ("graphs", "eager")
# Untimed steps first, per mode and batch size: one per context length modulo 16, so
# that every variant Triton compiles for an integer argument (it specializes on
# divisibility by 16) is compiled before the clock starts, not inside one mode's cells.
WARMUP_STEPS = 17
# Tokens each sequence may generate beyond the timed steps: its prefill's token, the
# warm-up steps', and a margin, so that no sequence finishes while being timed.
SPARE_TOKENS = 1 + WARMUP_STEPS + 2
# The mixed cell's decode rows are prefilled in steps of at most this many tokens (rows
# done early decode meanwhile: their token allowance counts those steps).
MIXED_PREFILL_TOKENS = 4096


def graph_and_eager_runners(model_dir, base, max_batch: int, context: int, max_new_tokens: int, model=None) -> dict:
    """{"graphs": runner, "eager": runner} over one copy of the weights (`model`'s where
    given), each with a KV cache of exactly `max_batch` sequences (no profiling: the two
    caches must both fit)."""
    from llmserve.worker.model_runner import ModelRunner

    settings = replace(base, num_kv_blocks=decode_kv_blocks(max_batch, context, max_new_tokens, base.block_size),
                       swap_space=0, max_num_seqs=max_batch)
    graphs = ModelRunner(model_dir, replace(settings, enforce_eager=False), model=model)
    eager = ModelRunner(model_dir, replace(settings, enforce_eager=True), model=graphs.model)
    return {"graphs": graphs, "eager": eager}


def time_modes(runners: dict, batch: int, context: int, steps: int, chunks: int = 4) -> dict[str, float]:
    """Median seconds of one decode step at `batch` in each mode, over `steps` steps taken
    in `chunks` turns per mode (after WARMUP_STEPS each)."""
    engines = {mode: prefilled_engine(runner, batch, context, steps + SPARE_TOKENS) for mode, runner in runners.items()}
    times: dict[str, list[float]] = {mode: [] for mode in engines}
    for engine in engines.values():
        for _ in range(WARMUP_STEPS):  # The first steps at a new batch size pay for kernel choices.
            engine.step()
    for chunk in range(chunks):
        for mode, engine in engines.items():
            device = engine.runner.device
            for _ in range(steps // chunks + (chunk < steps % chunks)):
                start = now(device)
                engine.step()
                times[mode].append(now(device) - start)
    for runner in runners.values():
        runner.reset_requests()  # The next batch size starts from a fresh scheduler.
    return {mode: statistics.median(t) for mode, t in times.items()}


def time_mixed(runners: dict, chunk: int, decodes: int, context: int, steps: int, chunks: int = 4) -> dict[str, float]:
    """Median seconds of a mixed step in each mode: a new `chunk`-token prompt (its whole
    prefill, one sampled token) beside `decodes` decode rows of ~`context` tokens, over
    `steps` steps taken in `chunks` turns per mode (after WARMUP_STEPS each)."""
    engines = {mode: prefilled_engine(runner, decodes, context, _mixed_allowance(decodes, context, steps),
                                      max_num_batched_tokens=MIXED_PREFILL_TOKENS) for mode, runner in runners.items()}
    prompts, request_ids = torch.Generator().manual_seed(0), itertools.count()
    times: dict[str, list[float]] = {mode: [] for mode in engines}

    def mixed_step(mode: str, engine) -> float:
        vocab = engine.runner.config.vocab_size
        prompt = torch.randint(3, vocab, (chunk,), generator=prompts).tolist()  # random: no prefix hits
        engine.add_request(f"mixed-{next(request_ids)}", prompt,
                           SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        start = now(engine.runner.device)
        engine.step()
        return now(engine.runner.device) - start

    for mode, engine in engines.items():
        for _ in range(WARMUP_STEPS):
            mixed_step(mode, engine)
    for chunk_index in range(chunks):
        for mode, engine in engines.items():
            for _ in range(steps // chunks + (chunk_index < steps % chunks)):
                times[mode].append(mixed_step(mode, engine))
    for runner in runners.values():
        runner.reset_requests()
    return {mode: statistics.median(t) for mode, t in times.items()}


def _mixed_allowance(decodes: int, context: int, steps: int) -> int:
    """Tokens a mixed cell's decode row may generate: the steps of its own prefill, the
    warm-up and timed steps, and a margin."""
    return cdiv(decodes * context, MIXED_PREFILL_TOKENS) + steps + SPARE_TOKENS


def compare_mixed(model_dir, base, chunk: int, decodes: int, context: int, steps: int, model) -> dict:
    """The mixed cell: each mode's median step (ms), and graphs / eager."""
    runners = graph_and_eager_runners(model_dir, base, decodes + 1, max(context, chunk),
                                      _mixed_allowance(decodes, context, steps), model=model)
    seconds = time_mixed(runners, chunk, decodes, context, steps)
    return {"chunk": chunk, "decodes": decodes, "uses_piecewise": runners["graphs"].piecewise is not None,
            **{f"{m}_step_ms": 1000 * seconds[m] for m in MODES},
            "graphs_over_eager": seconds["eager"] / seconds["graphs"]}


def compare_decode(model_dir, base, batches: list[int], context: int, steps: int,
                   mixed: tuple[int, int] | None = None) -> dict:
    """Per batch size: each mode's median step (ms) and tokens/s, and graphs / eager; with
    `mixed` (chunk, decodes), the mixed cell too."""
    runners = graph_and_eager_runners(model_dir, base, max(batches), context, steps + SPARE_TOKENS)
    graphs = runners["graphs"]
    rows = {}
    for batch in batches:
        seconds = time_modes(runners, batch, context, steps)
        rows[batch] = {**{f"{m}_step_ms": 1000 * seconds[m] for m in MODES},
                       **{f"{m}_tok_per_s": batch / seconds[m] for m in MODES},
                       "graphs_over_eager": seconds["eager"] / seconds["graphs"]}
    result = {"device": str(graphs.device), "dtype": str(graphs.dtype).removeprefix("torch."),
              "uses_graphs": graphs.graphs is not None, "context": context, "steps": steps, "batches": rows}
    if mixed is not None:
        result["mixed"] = compare_mixed(model_dir, base, *mixed, context, steps, graphs.model)
    return result


def print_table(result: dict) -> None:
    graphs = "CUDA graphs" if result["uses_graphs"] else "graphs (none here)"
    print(f"decode tok/s, context ~{result['context']}, {result['dtype']} on {result['device']}, "
          f"median of {result['steps']} steps per cell:", flush=True)
    print(f"{'batch':>5}  {graphs:>18}  {'eager':>10}  {'graphs/eager':>12}", flush=True)
    for batch, row in result["batches"].items():
        print(f"{batch:>5}  {row['graphs_tok_per_s']:>18.1f}  {row['eager_tok_per_s']:>10.1f}  "
              f"{row['graphs_over_eager']:>11.2f}x", flush=True)
    mixed = result.get("mixed")
    if mixed is not None:
        graphs = "piecewise graphs" if mixed["uses_piecewise"] else "graphs (none here)"
        print(f"mixed step ({mixed['chunk']}-token prefill + {mixed['decodes']} decodes), median ms: "
              f"{graphs} {mixed['graphs_step_ms']:.2f}, eager {mixed['eager_step_ms']:.2f} = "
              f"{mixed['graphs_over_eager']:.2f}x", flush=True)


def bench_decode(args) -> int:
    from llmserve.model_store import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    result = compare_decode(model_dir, args.engine.worker.runner, sorted(set(args.batch)), args.context, args.steps,
                            tuple(args.mixed) if args.mixed else None)
    print_table(result)
    report = {"kind": "decode", "machine": machine_info(), "command": " ".join(args.argv), **result}
    save_report(report, args.output_dir, f"decode-{result['dtype']}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    return 0
