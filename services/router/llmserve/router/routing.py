"""Routing policies: which data-parallel replica runs a request.

Each policy sees the replicas that may take the request, with their load and how much
of this prompt each is expected to hold in its prefix cache, and picks one:

- round-robin: in turn, whatever they hold;
- least-load: the fewest requests in flight;
- cache-aware (default): the longest cached prefix (a prompt's KV computed once per
  replica instead of once per request), ties to the lighter replica, unless the
  replicas' loads have drifted apart, when the lightest one takes it. The balance check
  is SGLang's router's: one hot prefix would otherwise pile every request on the replica
  that cached it first, while the others idle.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

ROUTING_POLICIES = ("cache-aware", "least-load", "round-robin")

# Loads count requests in flight. Imbalanced means both: the busiest replica has this many
# more than the idlest, and more than this many times as many.
BALANCE_ABS_THRESHOLD = 8
BALANCE_REL_THRESHOLD = 1.5


@dataclass(frozen=True)
class Candidate:
    """A replica as a policy sees it."""

    name: str
    load: int  # Requests in flight there.
    cached_tokens: int  # Prompt tokens expected in its prefix cache.


class RoutingPolicy(Protocol):
    """Picks one of the replicas that may take a request (--routing-policy names it)."""

    name: str

    def choose(self, candidates: Sequence[Candidate]) -> Candidate: ...


def least_loaded(candidates: Sequence[Candidate]) -> Candidate:
    return min(candidates, key=lambda c: (c.load, c.name))


class RoundRobin:
    """In turn, whatever the replicas hold or run."""

    name = "round-robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        ordered = sorted(candidates, key=lambda c: c.name)  # The same order whatever the set's order.
        return ordered[next(self._turn) % len(ordered)]


class LeastLoad:
    """The fewest requests in flight."""

    name = "least-load"

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        return least_loaded(candidates)


class CacheAware:
    """The longest cached prefix, unless the loads have drifted apart (see the module's
    docstring)."""

    name = "cache-aware"

    def __init__(self, abs_threshold: int = BALANCE_ABS_THRESHOLD, rel_threshold: float = BALANCE_REL_THRESHOLD):
        self.abs_threshold = abs_threshold
        self.rel_threshold = rel_threshold

    def imbalanced(self, candidates: Sequence[Candidate]) -> bool:
        loads = [c.load for c in candidates]
        busiest, idlest = max(loads), min(loads)
        return busiest - idlest > self.abs_threshold and busiest > self.rel_threshold * idlest

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        if self.imbalanced(candidates):
            return least_loaded(candidates)
        best = max(candidates, key=lambda c: (c.cached_tokens, -c.load, c.name))
        return best if best.cached_tokens > 0 else least_loaded(candidates)


def make_policy(name: str) -> RoutingPolicy:
    policies = {"cache-aware": CacheAware, "least-load": LeastLoad, "round-robin": RoundRobin}
    if name not in policies:
        raise ValueError(f"unknown routing policy {name!r}; use one of {', '.join(ROUTING_POLICIES)}")
    return policies[name]()
