"""`llmserve bench structured`: what one structured-output request costs the plain
requests batched with it (issue #33: one json_schema request among 63 plain ones may cost
them at most 10% TPOT).

Two batches on the same weights, in process (scheduler + worker in one process, every
request added at once):
  plain: `--batch` plain decode requests (random-id prompts, eos ignored, greedy);
  mixed: the same minus one, plus one json_schema request (a chat prompt; its schema
         asks for one string of at least MIN_CHARS characters, so its grammar is still
         constraining every step of the run: it pays the matcher and the mask throughout).
Rounds alternate the order (plain then mixed, then mixed then plain) so a drift of a
shared machine lands on both. TPOT per plain request = (its last token's time - its
first's) / (tokens - 1); a round's figure is the median over the plain requests, the
report's the median round (and the ratio of each batch's best round, which other load on
a shared host moves least). Each run is a fresh engine over one ModelRunner; a warm-up
pays the tokenizer's grammar tables and the schema's compilation before the first round.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

from llmserve.bench.workloads import BenchRequest, random_workload
from llmserve.contract.sampling import SamplingParams, StructuredOutput

MIN_CHARS = 2000  # More characters than a few hundred tokens hold: the grammar does not complete in a run.
SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": MIN_CHARS}},
          "required": ["story"], "additionalProperties": False}
QUESTION = "Tell a long story, as JSON."
CONSTRAINED_ID = "constrained"


def constrained_request(model_dir: Path, output_len: int) -> tuple[list[int], SamplingParams]:
    """The json_schema request: a chat prompt and greedy sampling under SCHEMA."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                         tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    sampling = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True,
                              structured_output=StructuredOutput("json_schema", json.dumps(SCHEMA)))
    return prompt, sampling


def timed_batch(runner, scheduling, plain: list[BenchRequest],
                constrained: tuple[list[int], SamplingParams] | None) -> dict:
    """One batch through a fresh engine: the plain requests' median TPOT (seconds) and the
    tokens every request generated."""
    from llmserve.launcher.engine import InProcessEngine

    runner.reset_requests()
    engine = InProcessEngine(runner, scheduling)
    requests = [(f"plain{i}", r.prompt_token_ids, SamplingParams(max_tokens=r.output_len, temperature=0.0,
                                                                  ignore_eos=True)) for i, r in enumerate(plain)]
    if constrained is not None:
        requests.append((CONSTRAINED_ID, *constrained))
    times: dict[str, list[float]] = defaultdict(list)  # request id -> a time per output token
    done = engine.run(requests, on_output=lambda out: times[out.request_id].extend(
        [time.perf_counter()] * len(out.new_token_ids)))
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for rid, t in times.items() if rid != CONSTRAINED_ID and len(t) > 1]
    return {"tpot_s": statistics.median(tpots), "tokens": {rid: c.output_token_ids for rid, c in done.items()}}


def compare(runner, scheduling, plain: list[BenchRequest], constrained: tuple[list[int], SamplingParams],
            rounds: int) -> dict:
    """`rounds` of the all-plain batch and the mixed one (the last plain request swapped for
    the constrained one), in alternating order; per-round figures and their medians."""
    timed_batch(runner, scheduling, plain[:2], constrained)  # Warm-up: grammar tables, compiled schema.
    runs: dict[str, list[dict]] = {"plain": [], "mixed": []}
    for r in range(rounds):
        for name in (("plain", "mixed") if r % 2 == 0 else ("mixed", "plain")):
            batch = (plain, None) if name == "plain" else (plain[:-1], constrained)
            runs[name].append(timed_batch(runner, scheduling, *batch))
    ratios = [m["tpot_s"] / p["tpot_s"] for p, m in zip(runs["plain"], runs["mixed"])]
    plain_s, mixed_s = ([r["tpot_s"] for r in runs[name]] for name in ("plain", "mixed"))
    mixed_tokens = runs["mixed"][0]["tokens"]
    return {
        "tpot_plain_ms": 1000 * statistics.median(plain_s),
        "tpot_mixed_ms": 1000 * statistics.median(mixed_s),
        "ratio": statistics.median(ratios),
        "rounds_ratio": ratios,
        # Each batch's least disturbed round: on a shared host, the figure other load moves least.
        "best_ratio": min(mixed_s) / min(plain_s),
        # The plain requests' greedy tokens do not depend on the constrained one beside them.
        "same_plain_tokens": all(mixed_tokens[rid] == runs["plain"][0]["tokens"][rid] for rid in mixed_tokens
                                 if rid != CONSTRAINED_ID),
        "constrained_tokens": mixed_tokens[CONSTRAINED_ID],
    }


def bench_structured(args) -> int:
    from transformers import AutoTokenizer

    from llmserve.bench.report import machine_info, save_report
    from llmserve.model_store import resolve_model_dir
    from llmserve.worker.model_runner import ModelRunner

    model_dir = resolve_model_dir(args.model)
    runner = ModelRunner(model_dir, args.engine.worker.runner)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    plain = random_workload(args.batch, (args.context, args.context), (args.output_len, args.output_len), vocab,
                            seed=args.seed)
    constrained = constrained_request(model_dir, args.output_len)
    load_before = os.getloadavg()[0]
    result = compare(runner, args.engine.scheduling, plain, constrained, args.rounds)
    load = {"load_1min_before": load_before, "load_1min_after": os.getloadavg()[0], "cpus": os.cpu_count()}
    story = AutoTokenizer.from_pretrained(str(model_dir)).decode(result.pop("constrained_tokens"))
    print(f"{args.batch} requests at once, context {args.context}, {args.output_len} tokens each, {runner.info.dtype} "
          f"on {runner.device}, {args.rounds} rounds; load {load['load_1min_before']:.2f} -> "
          f"{load['load_1min_after']:.2f} on {load['cpus']} CPUs", flush=True)
    print(f"tpot_plain_ms={result['tpot_plain_ms']:.2f} ({args.batch} plain)", flush=True)
    print(f"tpot_mixed_ms={result['tpot_mixed_ms']:.2f} (the {args.batch - 1} plain beside 1 json_schema)", flush=True)
    print(f"ratio={result['ratio']:.3f} (target <= 1.10; rounds: "
          f"{', '.join(f'{r:.3f}' for r in result['rounds_ratio'])}; best round of each: {result['best_ratio']:.3f})"
          f"; same_plain_tokens={result['same_plain_tokens']}"
          f"; constrained output {story[:60]!r}...", flush=True)
    report = {"kind": "structured", "machine": machine_info(), "command": " ".join(args.argv), "batch": args.batch,
              "context": args.context, "output_len": args.output_len, "rounds": args.rounds,
              "dtype": runner.info.dtype, "load": load, "constrained_output": story, **result}
    save_report(report, args.output_dir, f"structured-{time.strftime('%Y%m%d-%H%M%S')}.json")
    return 0
