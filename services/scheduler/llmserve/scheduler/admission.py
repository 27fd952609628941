"""Admission control: a bounded queue in front of the batch (vLLM / SGLang's
--max-queued-requests), the retry hint a refused client gets, and saturation.

    new request ──▶ fits the bounds? ── yes ──────────────────────────────▶ queued
                          │ no
                          ├─ queued requests of worse priority, not started yet,
                          │  whose leaving makes it fit? ── yes ──▶ they are refused, it is queued
                          └─ refused now: RESOURCE_EXHAUSTED + retry_after_ms

"Queued" means waiting or swapped out: every request with no sample running. The
request bound counts those beyond the free seats (max_num_seqs - running samples),
which the next step admits: a burst arriving between two steps is not refused while
seats are free. The token bound counts what queued requests must still compute before
their next token (a new request: its prompt); a request that finds the queue empty is
always queued, whatever its size, so the token bound never makes a prompt unservable.

The retry hint is how long the queue ahead took to drain lately: queued requests /
requests admitted per second and queued tokens / prompt tokens admitted per second over
the last RATE_WINDOW_S, the larger, within [RETRY_MIN_MS, RETRY_MAX_MS].

Saturated: from a refusal until the queue has drained to half of both bounds (the gap
keeps health from flapping while the queue hovers at its bound).

Unset, the bounds follow the batch (queue_bounds). A queued request waits for a seat,
and with every seat taken seats free up at max_num_seqs / (a request's lifetime) per
second; so max_num_seqs requests waiting means the last one waits about one request
lifetime at a full batch: under any overload TTFT stays within that plus its prefill,
where an unbounded queue grows it without limit. The token bound, 64 step budgets of
prompt tokens, keeps long prompts to at most 64 full prefill steps of backlog. Tighter
TTFT needs a smaller queue: about (target wait x the sustainable request rate), which
`llmserve bench overload` measures (docs/benchmarks.md, "Overload").
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from llmserve.scheduler.queues import Queues
from llmserve.scheduler.request import Request

if TYPE_CHECKING:
    from llmserve.scheduler.config import SchedulerConfig

RATE_WINDOW_S = 10.0  # Admissions older than this do not count towards the drain rate.
MIN_RATE_SPAN_S = 0.5  # A rate is taken over at least this long (start-up bursts).
RETRY_MIN_MS = 50  # Never 0: a refused client must not retry at once.
RETRY_MAX_MS = 30_000  # Also the hint while nothing has been admitted lately (a stalled queue).
LOW_WATERMARK = 0.5  # Saturation ends once the queue is at most this share of both bounds.
QUEUED_TOKENS_PER_STEP_BUDGET = 64  # The unset token bound, in max_num_batched_tokens.

REFUSAL_REASONS = ("queued_requests", "queued_tokens", "displaced")


def queue_bounds(config: "SchedulerConfig") -> tuple[int, int]:
    """(max queued requests, max queued tokens): the settings, or their batch-sized defaults."""
    requests = config.max_queued_requests or config.max_num_seqs
    tokens = config.max_queued_tokens or QUEUED_TOKENS_PER_STEP_BUDGET * config.max_num_batched_tokens
    return requests, tokens


class QueueFull(Exception):
    """A new request does not fit the queue bounds (and could not displace anyone)."""

    def __init__(self, reason: str, message: str, retry_after_ms: int) -> None:
        super().__init__(message)
        self.reason = reason  # "queued_requests" or "queued_tokens".
        self.retry_after_ms = retry_after_ms


class DrainRate:
    """Requests and prompt tokens leaving the queue per second, over a sliding window."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        """No admissions seen yet."""
        self.window_s = window_s
        self._events: collections.deque[tuple[float, int, int]] = collections.deque()  # (time, requests, tokens)
        self._requests = 0  # Sums over _events.
        self._tokens = 0
        self._since: float | None = None  # The first observation.

    def record(self, now: float, requests: int, tokens: int) -> None:
        """`requests` (with `tokens` prompt tokens) left the queue at `now`: one call per step."""
        if self._since is None:
            self._since = now
        if requests:
            self._events.append((now, requests, tokens))
            self._requests += requests
            self._tokens += tokens
        self._prune(now)

    def _prune(self, now: float) -> None:
        while self._events and self._events[0][0] <= now - self.window_s:
            _, requests, tokens = self._events.popleft()
            self._requests -= requests
            self._tokens -= tokens

    def rates(self, now: float) -> tuple[float, float]:
        """(requests/s, prompt tokens/s) admitted over the window (0 when none)."""
        self._prune(now)
        if self._since is None or not self._requests:
            return 0.0, 0.0
        span = max(MIN_RATE_SPAN_S, min(self.window_s, now - self._since))
        return self._requests / span, self._tokens / span

    def retry_after_ms(self, now: float, queued_requests: int, queued_tokens: int) -> int:
        """How long the current queue would take to drain at the recent rate, bounded."""
        requests_per_s, tokens_per_s = self.rates(now)
        if not requests_per_s:
            return RETRY_MAX_MS
        wait_s = queued_requests / requests_per_s
        if tokens_per_s:
            wait_s = max(wait_s, queued_tokens / tokens_per_s)
        return int(min(RETRY_MAX_MS, max(RETRY_MIN_MS, math.ceil(1000 * wait_s))))


class Admission:
    """Decides whether a new request may queue; tracks refusals and saturation."""

    def __init__(self, max_requests: int, max_tokens: int, queues: Queues, clock: Callable[[], float]) -> None:
        """Bound the requests in `queues` (waiting or swapped) to `max_requests` and their
        tokens to compute to `max_tokens`; `clock` is time.monotonic or a test's."""
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.queues = queues
        self.clock = clock
        self.drain = DrainRate()
        self.refused: dict[str, int] = dict.fromkeys(REFUSAL_REASONS, 0)  # Lifetime, by reason.
        self._saturated = False

    def queued(self) -> list[Request]:
        """The queued requests (no sample running), in no particular order."""
        requests = dict.fromkeys(s.request for s in self.queues.waiting)
        for unit in self.queues.swapped:
            requests.update(dict.fromkeys(s.request for s in unit))
        return list(requests)

    def load(self) -> tuple[int, int]:
        """(queued requests, tokens they must compute before their next token)."""
        queued = self.queued()
        return len(queued), sum(cost(r) for r in queued)

    def free_seats(self) -> int:
        """Seats the next step can give queued requests."""
        return max(0, self.queues.max_num_seqs - len(self.queues.running))

    def make_room(self, num_tokens: int, priority: int) -> list[Request]:
        """Make room for a new request of `num_tokens` prompt tokens and `priority`.

        Returns the queued requests it displaces (worst first; empty when it fits as
        is): requests of strictly worse priority that have not started yet, which the
        caller must end. Raises QueueFull (changing nothing but the counts) when it does
        not fit even without them."""
        queued = self.queued()
        count, tokens = len(queued), sum(cost(r) for r in queued)
        seats = self.free_seats()
        if self._fits(count, seats, tokens, num_tokens):
            return []
        reason = "queued_requests" if count - seats >= self.max_requests else "queued_tokens"
        what = (f"--max-queued-requests ({self.max_requests}) reached"
                if reason == "queued_requests" else
                f"--max-queued-tokens ({self.max_tokens}) reached: queued requests have {tokens} tokens to "
                f"compute, this one {num_tokens}")
        self._saturated = True
        victims = []
        for request in sorted(queued, key=lambda r: r.key, reverse=True):  # Worst first.
            if request.priority <= priority:
                break  # Everyone left is at least as important as the newcomer.
            if request.admitted:
                continue  # Started, then preempted: its client has tokens already; keep it.
            victims.append(request)
            count, tokens = count - 1, tokens - cost(request)
            if self._fits(count, seats, tokens, num_tokens):
                self.refused["displaced"] += len(victims)
                return victims
        self.refused[reason] += 1
        retry_ms = self.retry_after_ms()
        raise QueueFull(reason, f"the scheduler is saturated: {what}; retry in {retry_ms} ms", retry_ms)

    def _fits(self, count: int, seats: int, tokens: int, num_tokens: int) -> bool:
        return count - seats < self.max_requests and (count == 0 or tokens + num_tokens <= self.max_tokens)

    def retry_after_ms(self) -> int:
        """The hint for a request refused now (see the module docstring)."""
        count, tokens = self.load()
        return self.drain.retry_after_ms(self.clock(), count, tokens)

    @property
    def saturated(self) -> bool:
        """True from a refusal until the queue has drained to LOW_WATERMARK of both bounds."""
        if self._saturated:
            count, tokens = self.load()
            if (count - self.free_seats() <= LOW_WATERMARK * self.max_requests
                    and tokens <= LOW_WATERMARK * self.max_tokens):
                self._saturated = False
        return self._saturated


def cost(request: Request) -> int:
    """Tokens the request must compute before its next token (a new one: its prompt)."""
    return sum(s.num_uncomputed_tokens for s in request.samples)
