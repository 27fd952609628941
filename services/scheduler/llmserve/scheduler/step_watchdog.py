"""The step watchdog: a worker that stops answering mid-step is noticed in seconds.

A worker frozen mid-step (a hung GPU, a stuck collective, SIGSTOP) keeps its TCP
connection, so nothing breaks: its Execute stream waits for gRPC's keepalive (about a
minute), and its health check times out, which counts as "busy", not "gone". The engine
loop, though, knows what it waits for: the watchdog hears each plan sent and each result
applied (EngineSession forwards the StepObserver calls), learns how long steps take,
and when the oldest plan in flight has not been answered within its bound it reports a
Stall, and the session drops the worker.

    bound(plan) = max(floor, factor x p99(recent seconds per step) x plan.num_steps)
    floor       = the largest that applies of: floor_s; warmup_floor_s while fewer than
                  warmup_steps steps have been answered (lazy compilation, first
                  allocations); prefill_floor_s for a prefill-heavy plan (half its
                  tokens or more from prompts: decode steps say little about it)

Prefill-heavy steps and the others are timed apart (a few long prefills must not stretch
every decode step's bound), and warm-up steps not at all (they are slow for reasons
that pass).

A step's time runs from when the worker could start it: its send, or the answer to the
plan before it, whichever is later (with two plans in flight the second waits for the
first on the worker). Results come back in order on one stream, so an answer to step N
also answers any older plan still listed (one whose result the loop never applied).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from operator import attrgetter

from llmserve.contract.plan import StepPlan, StepResult
from llmserve.scheduler.config import StepWatchdogConfig

RECENT_STEPS = 256  # Steps whose times the bound is learned from.
PERCENTILE = 0.99  # A high percentile, not the maximum: one odd step must not set it forever.
MIN_SAMPLES = 8  # Fewer recent steps than this: only the floors apply.
POLL_S = 0.25  # How often the watchdog looks; a stall is reported at most this late.
# A watchdog tick this much later than due means the scheduler itself was stalled (GC, an
# overloaded host): an answer may be waiting unread, so that tick reports nothing.
LATE_TICK_S = 1.0
_SCHEDULED, _DRAFTS = attrgetter("num_scheduled_tokens"), attrgetter("draft_token_ids")


@dataclass(frozen=True)
class Stall:
    """A plan in flight past its bound."""

    step_id: int
    num_steps: int
    running_s: float  # Since the worker could start it.
    bound_s: float

    def describe(self, address: str) -> str:
        steps = f" ({self.num_steps} steps)" if self.num_steps > 1 else ""
        return (f"the worker at {address} stopped answering: step {self.step_id}{steps} has run "
                f"{self.running_s:.1f} s without a result (its bound: {self.bound_s:.1f} s)")


def token_counts(plan: StepPlan) -> tuple[int, int]:
    """(tokens the plan computes, of which prompt tokens): beyond one per row and its
    drafts, a row computes prompt (or recomputed) tokens, whose cost decode steps do not
    predict."""
    # NOTE: map/sum iterate in C: this runs once per step, over every row.
    rows = (plan.new_requests, plan.cached_requests)
    total = sum(sum(map(_SCHEDULED, r)) for r in rows)
    beyond = total - len(plan.new_requests) - len(plan.cached_requests)
    if beyond <= 0:  # One token a row: a decode step (the common case), no drafts to count.
        return total, 0
    drafts = sum(sum(map(len, map(_DRAFTS, r))) for r in rows)
    return total, max(0, beyond - drafts)


def prefill_heavy(plan: StepPlan) -> bool:
    total, prompt = token_counts(plan)
    return total > 0 and 2 * prompt >= total


def percentile(values, q: float) -> float:
    """The q-quantile of `values` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass
class _InFlight:
    plan: StepPlan
    sent_at: float
    warming_up: bool  # Sent during the warm-up steps.
    heavy: bool | None = None  # prefill_heavy(plan) once asked: it reads every row.

    def prefill_heavy(self) -> bool:
        if self.heavy is None:
            self.heavy = prefill_heavy(self.plan)
        return self.heavy


class StepWatchdog:
    """Plans in flight by step id, recent step times, and the bound of each plan.

    NOTE: started() is on the step's critical path (before the send) and does O(1)
    work; the bound (a sort of recent times) is computed only when a poll looks at the
    oldest plan, and a plan's rows are read once, when it is answered or looked at."""

    def __init__(self, config: StepWatchdogConfig, clock: Callable[[], float] = time.monotonic):
        self.config, self.clock = config, clock
        self._in_flight: dict[int, _InFlight] = {}  # Insertion order is send order.
        # Seconds per step of recent steps, prefill-heavy ones (True) apart from the others.
        self._recent = {heavy: deque(maxlen=RECENT_STEPS) for heavy in (False, True)}
        self._last_answer: float | None = None
        self.num_answered = 0  # Plans answered since registration.

    @property
    def in_flight(self) -> list[int]:
        """The step ids sent and not answered yet, oldest first."""
        return list(self._in_flight)

    def bound(self, plan: StepPlan, warming_up: bool | None = None) -> float:
        """Seconds the worker has for `plan` (the module docstring's formula); warm-up
        as of now unless `warming_up` says."""
        c = self.config
        heavy = prefill_heavy(plan)
        warming_up = self.num_answered < c.warmup_steps if warming_up is None else warming_up
        floor = max(c.floor_s, c.warmup_floor_s if warming_up else 0.0, c.prefill_floor_s if heavy else 0.0)
        recent = self._recent[heavy]
        if len(recent) < MIN_SAMPLES:
            return floor
        return max(floor, c.factor * percentile(recent, PERCENTILE) * max(1, plan.num_steps))

    def started(self, plan: StepPlan) -> None:
        """The plan is about to be sent."""
        self._in_flight[plan.step_id] = _InFlight(plan, self.clock(), self.num_answered < self.config.warmup_steps)

    def finished(self, plan: StepPlan, result: StepResult) -> None:
        """The plan's result was applied: its time joins the recent ones."""
        entry = self._in_flight.get(plan.step_id)
        if entry is None:
            return  # Not sent through started() (or already answered): nothing to learn.
        now = self.clock()
        while self._in_flight:  # It and every older plan (answers come in order).
            step_id = next(iter(self._in_flight))
            del self._in_flight[step_id]
            if step_id == plan.step_id:
                break
        began = self._began(entry)
        self._last_answer = now
        self.num_answered += 1
        # A failed step's time says nothing about how long steps take; a warm-up step's
        # says how long they took once.
        if not result.error and not entry.warming_up:
            self._recent[entry.prefill_heavy()].append((now - began) / max(1, result.num_steps))

    def _began(self, entry: _InFlight) -> float:
        """When the worker could start the plan: sent, and the plan before it answered."""
        return entry.sent_at if self._last_answer is None else max(entry.sent_at, self._last_answer)

    def check(self) -> Stall | None:
        """The oldest plan in flight if it is past its bound, else None."""
        if not self._in_flight:
            return None
        oldest = next(iter(self._in_flight.values()))
        running = self.clock() - self._began(oldest)
        if running <= self.config.floor_s:
            return None  # Every bound is at least the floor: no need to compute this one.
        bound = self.bound(oldest.plan, oldest.warming_up)
        if running <= bound:
            return None
        return Stall(oldest.plan.step_id, max(1, oldest.plan.num_steps), running, bound)

    async def watch(self, on_stall: Callable[[Stall], Awaitable[None]], poll_s: float = POLL_S) -> None:
        """Looks every `poll_s` until a plan stalls, then awaits on_stall(stall) and returns."""
        due = self.clock() + poll_s
        while True:
            await asyncio.sleep(poll_s)
            now = self.clock()
            late = now - due > LATE_TICK_S
            due = now + poll_s
            if late:
                continue
            stall = self.check()
            if stall is not None:
                await on_stall(stall)
                return
