"""The router's one record per request, and the one table that holds them.

A request's `Placement` lives from the claim of its id to its end: the replica running
it (and the ones that failed it), the queue that replica's outputs land in, the samples
its engine may still run, its telemetry and how it ended. `Placements` is the router's
only table of requests: each scheduler link finds a request's queue through it, a
replica's count of requests running there (`Replica.in_flight`) moves only with it, and
releasing a record is the whole clean-up.

    claim ─▶ place(replica) ─▶ [unplace ─▶ place(another replica)]* ─▶ release
             (a migration: the first replica failed it mid-stream)
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from llmserve.contract.outputs import ErrorCode, FinishReason, RequestOutput
from llmserve.router.limits import check_request_id
from llmserve.router.validation import RequestError
from llmserve.telemetry.requests import RouterRequest

if TYPE_CHECKING:  # NOTE: replicas.py imports this module (through scheduler_link.py).
    from llmserve.router.replicas import Replica
    from llmserve.router.scheduler_link import SchedulerLink


def unavailable(request_id: str, reason: str) -> RequestOutput:
    """The output that ends a request whose replica is lost (it may migrate)."""
    return RequestOutput(request_id, finish_reason=FinishReason.ERROR, error=reason, error_code=ErrorCode.UNAVAILABLE)


@dataclass(eq=False)
class Placement:
    """One request at the router, from the claim of its id to its end."""

    request_id: str
    telemetry: RouterRequest
    replica: Replica | None = None  # None until placed, and between a failed replica and the next.
    # The outputs of the replica running it: a fresh queue per placement, so a failed
    # replica's late outputs never reach the next attempt.
    queue: asyncio.Queue[RequestOutput] = field(default_factory=asyncio.Queue)
    tried: list[Replica] = field(default_factory=list)  # Replicas that failed it: a migration goes elsewhere.
    engine_live: set[int] = field(default_factory=set)  # Samples its replica may still run (aborted at the end).
    # (finish reason, error) for its metrics and span: an abort unless it ends by itself.
    outcome: tuple[str, str] = ("abort", "")

    def fail(self, reason: str) -> None:
        """Ends its stream with UNAVAILABLE (its replica's session is lost, or the router
        gave up on it at shutdown)."""
        self.queue.put_nowait(unavailable(self.request_id, reason))


class Placements:
    """Every request the router runs, by id: the claim of an id, its placement on a
    replica, and its release, which undoes both."""

    def __init__(self) -> None:
        self._records: dict[str, Placement] = {}

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[Placement]:
        return iter(list(self._records.values()))  # A copy: records come and go while a caller awaits.

    def get(self, request_id: str) -> Placement | None:
        return self._records.get(request_id)

    def claim(self, client_id: str, telemetry: RouterRequest) -> Placement:
        """A record for a new request, under the client's id or a fresh one. NOTE: check
        and add with no await between, or two calls with one id could both pass the
        check (and then collide in the engine)."""
        check_request_id(client_id)
        request_id = client_id or uuid.uuid4().hex
        if request_id in self._records:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request id {request_id!r} is already running")
        record = self._records[request_id] = Placement(request_id, telemetry)
        return record

    def place(self, record: Placement, replica: Replica, samples: set[int]) -> None:
        """Records that `replica` runs these samples of the request, before the add is
        written: its link delivers the outputs from then on."""
        record.replica, record.queue, record.engine_live = replica, asyncio.Queue(), set(samples)
        replica.in_flight += 1

    def unplace(self, record: Placement) -> Replica | None:
        """Detaches the request from its replica (whose outputs for it are dropped from
        now on); the replica it was on, if any."""
        replica, record.replica, record.engine_live = record.replica, None, set()
        if replica is not None:
            replica.in_flight -= 1
        return replica

    def release(self, record: Placement) -> None:
        """The request is over: its id is free again."""
        self.unplace(record)
        if self._records.get(record.request_id) is record:
            del self._records[record.request_id]

    def queue_of(self, request_id: str, link: SchedulerLink) -> asyncio.Queue[RequestOutput] | None:
        """Where `link`'s output for this request goes; None if it does not run there (any more)."""
        record = self._records.get(request_id)
        if record is None or record.replica is None or record.replica.link is not link:
            return None
        return record.queue

    def on(self, link: SchedulerLink) -> list[Placement]:
        """The requests running on `link`'s replica."""
        return [r for r in self._records.values() if r.replica is not None and r.replica.link is link]
