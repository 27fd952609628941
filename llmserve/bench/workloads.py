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
