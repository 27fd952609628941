"""End-to-end deadlines: the unfinished requests that carry one, earliest first.

The router passes what is left of the client's gRPC deadline as a relative budget; the
service turns it into a time.monotonic() deadline on the Request. Before each step the
scheduler ends every request whose deadline has passed (Scheduler.expire): a queued one
is never scheduled (again), a running one stops at this step; either way its blocks are
freed at once.

    heap [ (3.2, r7) (4.0, r2) (9.5, r4) ... ]      pop while deadline <= now
"""

from __future__ import annotations

import heapq
import itertools

from llmserve.scheduler.request import Request

# Finished requests stay in the heap until their deadline; past this many entries the
# heap is rebuilt from the live ones whenever it has doubled since the last rebuild.
COMPACT_AT = 64


class Deadlines:
    """A min-heap of (deadline, request). Requests that finish otherwise are dropped
    lazily, when they reach the top or when the heap is compacted."""

    def __init__(self) -> None:
        """No deadlines yet."""
        self._heap: list[tuple[float, int, Request]] = []
        self._order = itertools.count()  # Breaks ties between equal deadlines (Requests do not compare).
        self._compact_at = COMPACT_AT

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, request: Request) -> None:
        """Track the request's deadline (it must have one)."""
        assert request.deadline is not None
        heapq.heappush(self._heap, (request.deadline, next(self._order), request))
        if len(self._heap) >= self._compact_at:
            self._heap = [entry for entry in self._heap if not entry[2].is_finished]
            heapq.heapify(self._heap)
            self._compact_at = max(COMPACT_AT, 2 * len(self._heap))

    def due(self, now: float) -> list[Request]:
        """Remove and return the unfinished requests whose deadline is at or before `now`,
        earliest first."""
        due = []
        while self._heap and self._heap[0][0] <= now:
            request = heapq.heappop(self._heap)[2]
            if not request.is_finished:
                due.append(request)
        return due

    def next(self) -> float | None:
        """The earliest deadline of an unfinished request, or None."""
        while self._heap and self._heap[0][2].is_finished:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None
