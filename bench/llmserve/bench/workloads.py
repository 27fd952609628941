"""Benchmark workloads: lists of (prompt token ids, output length), reproducible by seed."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int  # Generated exactly: eos is ignored.


def random_workload(num_requests: int, input_range: tuple[int, int], output_range: tuple[int, int],
                    vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """Lengths uniform in the (inclusive) ranges, random token ids.

    The draw order (prompt length, output length, then the prompt's ids, per request)
    is that of the reference workload in shared/NOTES.md, so figures are comparable.
    """
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt_len = rng.randint(*input_range)
        output_len = rng.randint(*output_range)
        ids = [rng.randrange(vocab_size) for _ in range(prompt_len)]
        requests.append(BenchRequest(ids, output_len))
    return requests


def reference_workload(vocab_size: int) -> list[BenchRequest]:
    """The named preset: 64 requests, prompts 32-256, outputs 16-128, seed 0."""
    return random_workload(64, (32, 256), (16, 128), vocab_size, seed=0)


def summary(requests: list[BenchRequest]) -> dict:
    return {
        "num_requests": len(requests),
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
        "output_tokens": sum(r.output_len for r in requests),
    }


def prefix_workload(num_requests: int, num_prefixes: int, prefix_len: int, suffix_range: tuple[int, int],
                    output_range: tuple[int, int], vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """N distinct long shared prefixes (think system prompts), each request one of them
    plus a unique suffix: what prefix caching is for."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab_size) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    requests = []
    for i in range(num_requests):
        suffix = [rng.randrange(vocab_size) for _ in range(rng.randint(*suffix_range))]
        requests.append(BenchRequest(prefixes[i % num_prefixes] + suffix, rng.randint(*output_range)))
    return requests


def sharegpt_workload(path, tokenize, num_requests: int, max_len: int, seed: int = 0) -> list[BenchRequest]:
    """Conversations from a local ShareGPT-format JSON file: the first human turn is the
    prompt, the first reply's token count is the output length (vLLM's convention).

    `tokenize(text) -> list[int]`. Pairs whose prompt + output exceed max_len, or whose
    prompt or reply is shorter than 4 tokens, are skipped.
    """
    import json
    from pathlib import Path

    data = json.loads(Path(path).read_text())
    rng = random.Random(seed)
    rng.shuffle(data)
    requests = []
    for item in data:
        turns = item.get("conversations") or item.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, reply = tokenize(turns[0]["value"]), tokenize(turns[1]["value"])
        if len(prompt) < 4 or len(reply) < 4 or len(prompt) + len(reply) > max_len:
            continue
        requests.append(BenchRequest(prompt, len(reply)))
        if len(requests) == num_requests:
            break
    if not requests:
        raise ValueError(f"{path}: no usable conversations")
    return requests


def add_workload_flags(parser) -> None:
    parser.add_argument("--workload", default="reference", choices=["reference", "random", "prefix", "sharegpt"],
                        help="reference = 64 requests, prompts 32-256, outputs 16-128, seed 0 (shared/NOTES.md)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    parser.add_argument("--num-prefixes", type=int, default=4, help="prefix workload: distinct shared prefixes")
    parser.add_argument("--prefix-len", type=int, default=512, help="prefix workload: tokens per shared prefix")
    parser.add_argument("--dataset", default=None, help="sharegpt workload: a local ShareGPT-format JSON file")
    parser.add_argument("--seed", type=int, default=0)


def workload_from_args(args, model_dir) -> list[BenchRequest]:
    import json
    from pathlib import Path

    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    if args.workload == "reference":
        return reference_workload(vocab)
    if args.workload == "random":
        return random_workload(args.num_requests, tuple(args.input_len), tuple(args.output_len), vocab, args.seed)
    if args.workload == "prefix":
        return prefix_workload(args.num_requests, args.num_prefixes, args.prefix_len, tuple(args.input_len),
                               tuple(args.output_len), vocab, args.seed)
    if not args.dataset:
        raise SystemExit("--workload sharegpt needs --dataset FILE.json")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return sharegpt_workload(args.dataset, lambda t: tokenizer(t)["input_ids"], args.num_requests,
                             max_len=2048, seed=args.seed)
