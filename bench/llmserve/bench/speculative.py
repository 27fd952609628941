"""`llmserve bench speculative`: speculative decoding (n-gram drafts, --speculative-tokens)
against plain decoding on the same weights, side by side in one run.

Two latency workloads, each request alone (batch 1, the case speculation is for):
  - copy: chat requests asking the model to repeat a passage word for word (paragraphs
    of quality.py's standard-library docstrings): output that copies its input, which
    prompt lookup drafts;
  - random: random-id prompts, eos ignored: output with little to copy.
Request i runs plain then speculative, request i + 1 the other way round, so a drift of
a shared machine lands on both. TPOT per request = (last token's time - first token's)
/ (tokens - 1), timed around the in-process engine (scheduler + worker in one process);
the figures are medians. Greedy outputs must be identical.

Then throughput: the reference workload (64 requests at once, random ids), plain and
speculative in turns: what speculation costs when the batch is full.

Every engine is fresh (its own scheduler: no prefix-cache hits across settings) over one
ModelRunner, so both settings run the same weights and KV cache.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from pathlib import Path

from llmserve.bench.workloads import BenchRequest, random_workload, reference_workload
from llmserve.contract.sampling import SamplingParams

COPY_INSTRUCTION = "Repeat the following text exactly, word for word:\n\n"


def copy_workload(model_dir: Path, num_requests: int, min_tokens: int = 40, max_tokens: int = 120) -> list[BenchRequest]:
    """Chat prompts asking to repeat a docstring paragraph of min..max tokens; each may
    generate the paragraph's length plus a margin (it stops at its own eos)."""
    from transformers import AutoTokenizer

    from llmserve.bench.quality import stdlib_docstrings

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    requests = []
    for paragraph in stdlib_docstrings().split("\n\n"):
        length = len(tokenizer(paragraph, add_special_tokens=False)["input_ids"])
        if not min_tokens <= length <= max_tokens:
            continue
        messages = [{"role": "user", "content": COPY_INSTRUCTION + paragraph}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        requests.append(BenchRequest(prompt, length + 16))
        if len(requests) == num_requests:
            break
    return requests


def _engine(runner, scheduling, k: int):
    from llmserve.launcher.engine import InProcessEngine

    runner.reset_requests()
    return InProcessEngine(runner, replace(scheduling, num_speculative_tokens=k))


def timed_request(runner, scheduling, k: int, request: BenchRequest, ignore_eos: bool) -> dict:
    """One request alone: its tokens, TPOT and the engine's speculation counters."""
    engine = _engine(runner, scheduling, k)
    times: list[tuple[float, int]] = []
    sampling = SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=ignore_eos)
    done = engine.run([("r", request.prompt_token_ids, sampling)],
                      on_output=lambda out: times.append((time.perf_counter(), len(out.new_token_ids))))
    tokens = done["r"].output_token_ids
    stats = engine.scheduler.stats()
    tpot = (times[-1][0] - times[0][0]) / (len(tokens) - 1) if len(tokens) > 1 else float("nan")
    return {"tokens": tokens, "tpot_s": tpot, "steps": stats.num_steps, "drafted": stats.spec_num_draft_tokens,
            "accepted": stats.spec_num_accepted_tokens, "drafts": stats.spec_num_drafts}


def compare_latency(runner, scheduling, k: int, requests: list[BenchRequest], ignore_eos: bool) -> dict:
    """Each request plain and speculative, in alternating order; medians and totals."""
    runs: dict[int, list[dict]] = {0: [], k: []}
    for i, request in enumerate(requests):
        for setting in ((0, k) if i % 2 == 0 else (k, 0)):
            runs[setting].append(timed_request(runner, scheduling, setting, request, ignore_eos))
    plain, spec = runs[0], runs[k]
    tpot_plain = statistics.median(r["tpot_s"] for r in plain)
    tpot_spec = statistics.median(r["tpot_s"] for r in spec)
    drafted, accepted, drafts = (sum(r[key] for r in spec) for key in ("drafted", "accepted", "drafts"))
    return {
        "num_requests": len(requests),
        "output_tokens": sum(len(r["tokens"]) for r in plain),
        "tpot_plain_ms": 1000 * tpot_plain,
        "tpot_speculative_ms": 1000 * tpot_spec,
        "tpot_plain_over_speculative": tpot_plain / tpot_spec,
        "per_request_ratio": [a["tpot_s"] / b["tpot_s"] for a, b in zip(plain, spec)],
        "identical_outputs": sum(a["tokens"] == b["tokens"] for a, b in zip(plain, spec)) / len(requests),
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": 1 + accepted / drafts if drafts else 1.0,
        "steps_plain": sum(r["steps"] for r in plain),
        "steps_speculative": sum(r["steps"] for r in spec),
    }


def compare_throughput(runner, scheduling, k: int, requests: list[BenchRequest], rounds: int) -> dict:
    """All requests at once, plain and speculative in turns; output tok/s per round."""
    rates: dict[int, list[float]] = {0: [], k: []}
    acceptance = []
    for r in range(rounds):
        for setting in ((0, k) if r % 2 == 0 else (k, 0)):
            engine = _engine(runner, scheduling, setting)
            sampling = [SamplingParams(temperature=0.0, max_tokens=q.output_len, ignore_eos=True) for q in requests]
            start = time.perf_counter()
            done = engine.run([(str(i), q.prompt_token_ids, s) for i, (q, s) in enumerate(zip(requests, sampling))])
            seconds = time.perf_counter() - start
            rates[setting].append(sum(len(c.output_token_ids) for c in done.values()) / seconds)
            if setting:
                acceptance.append(engine.scheduler.stats().spec_acceptance_rate)
    ratios = [b / a for a, b in zip(rates[0], rates[k])]
    return {"plain_tok_per_s": rates[0], "speculative_tok_per_s": rates[k], "speculative_over_plain": ratios,
            "speculative_over_plain_median": statistics.median(ratios), "acceptance_rate": acceptance}


def _print_latency(name: str, row: dict, k: int) -> None:
    print(f"{name:<7} {row['num_requests']:>3} requests, batch 1: TPOT plain {row['tpot_plain_ms']:.1f} ms, "
          f"K={k} {row['tpot_speculative_ms']:.1f} ms: {row['tpot_plain_over_speculative']:.2f}x lower; "
          f"acceptance {100 * row['acceptance_rate']:.0f}%, mean accepted length {row['mean_accepted_length']:.2f}, "
          f"steps {row['steps_plain']} -> {row['steps_speculative']}, identical outputs "
          f"{100 * row['identical_outputs']:.0f}%", flush=True)


def bench_speculative(args) -> int:
    import json

    from llmserve.bench.report import machine_info, save_report
    from llmserve.model_store import resolve_model_dir
    from llmserve.worker.model_runner import ModelRunner

    model_dir = resolve_model_dir(args.model)
    k = args.engine.scheduling.num_speculative_tokens or 4
    scheduling = args.engine.scheduling
    runner = ModelRunner(model_dir, args.engine.worker.runner)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    print(f"speculative decoding K={k} (n-grams {scheduling.speculative_ngram_min}..{scheduling.speculative_ngram_max})"
          f" vs plain, {runner.info.dtype} on {runner.device}", flush=True)
    report = {"kind": "speculative", "machine": machine_info(), "command": " ".join(args.argv), "k": k,
              "dtype": runner.info.dtype}
    copy = copy_workload(model_dir, args.num_requests)
    report["copy"] = compare_latency(runner, scheduling, k, copy, ignore_eos=False)
    _print_latency("copy", report["copy"], k)
    rand = random_workload(args.num_requests, (32, 256), (64, 64), vocab, seed=args.seed)
    report["random"] = compare_latency(runner, scheduling, k, rand, ignore_eos=True)
    _print_latency("random", report["random"], k)
    if args.throughput_rounds:
        report["reference_throughput"] = row = compare_throughput(runner, scheduling, k, reference_workload(vocab),
                                                                  args.throughput_rounds)
        print(f"reference workload (64 at once): plain {statistics.median(row['plain_tok_per_s']):.1f} tok/s, "
              f"K={k} {statistics.median(row['speculative_tok_per_s']):.1f} tok/s: "
              f"{row['speculative_over_plain_median']:.3f}x (rounds: "
              f"{', '.join(f'{r:.3f}' for r in row['speculative_over_plain'])}); acceptance "
              f"{', '.join(f'{100 * a:.0f}%' for a in row['acceptance_rate'])}", flush=True)
    save_report(report, args.output_dir, f"speculative-{time.strftime('%Y%m%d-%H%M%S')}.json")
    return 0
