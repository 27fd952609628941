"""Sampling settings as the engine sees them (the router resolves defaults first)."""

from __future__ import annotations

from dataclasses import dataclass, field


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded `seed`: seed + index, wrapped into
    int64 (the seed's type on every wire), so seed 2**63 - 1 with n = 2 gives sample 1
    the seed -2**63 rather than a number no proto field can carry."""
    return (seed + index - INT64_MIN) % 2**64 + INT64_MIN


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy.
    top_p: float = 1.0  # 1 means off.
    top_k: int = 0  # <= 0 means off.
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; 0: sampled token only; k: top k too.
    stop_token_ids: tuple[int, ...] = ()
    # Stop strings never leave the router; the engine stops on token ids only.
    stop: tuple[str, ...] = field(default=())
