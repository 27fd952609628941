"""Router sessions and dispatch: each router's Session stream, and outputs routed to the
session that owns their request (the owner is on the request's record).

    router A ──Session──▶ RouterSession A ◀─┐
    router B ──Session──▶ RouterSession B ◀─┤ dispatch(outputs): one update per session,
                                            │ tokens held back per --stream-interval
                          core's table ─────┘ (request.stream: owner, held tokens, spans)

Flow control: a router acknowledges the updates it has read (RouterMessage.consumed, a
running count) when an update asks it to; at most CREDITS of a session's updates are
sent and not acknowledged. While a router lags, its updates wait and go out merged into
one when a credit returns: it reads fewer, larger updates (each request's outputs of
several steps at once, which it forwards as one message per sample) instead of a
backlog in the transport.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import grpc

from llmserve.contract import wire
from llmserve.contract.outputs import ErrorCode, FinishReason, RequestOutput
from llmserve.internal.v1 import scheduler_pb2
from llmserve.scheduler.request import Request
from llmserve.scheduler.scheduler import Scheduler
from llmserve.scheduler.stream_interval import OutputCoalescer
from llmserve.scheduler.telemetry import SchedulerTelemetry
from llmserve.telemetry import step_phases

logger = logging.getLogger(__name__)
# Updates a session may have sent and not had acknowledged. Few: what waits beyond them
# waits here, where it can still be merged, not in the transport's buffers. An update
# sent with half of them spent asks for an acknowledgement, so a router that keeps up
# sends one every CREDITS // 2 updates and still has the next update at hand when it
# answers. (One per update cost the serial loop at batch 1 about 7 points of device-busy
# on a loaded 2-core host: 55% -> 48%.)
CREDITS = 4


class RouterSession:
    """One router's Session stream: the updates queued for writing to it. The requests it
    owns are those whose record names it (request.stream.owner)."""

    _ids = itertools.count()

    def __init__(self):
        self.id = next(self._ids)
        # What waits for writing: an update, a step's outputs (converted when written: off
        # the engine step's critical path), or None, the end.
        self.updates: asyncio.Queue[scheduler_pb2.SchedulerUpdate | list[RequestOutput] | None] = asyncio.Queue()
        self.sent = 0  # Updates taken for writing.
        # Updates the router said it consumed; None until it first says so (a router of
        # an earlier release never does: its session is not throttled).
        self.consumed: int | None = None
        self._credit = asyncio.Event()  # Set by each acknowledgement and by the stream's end.
        self._ending = False  # The router's side is done: credits no longer matter.
        self._ended = False  # The end was taken from the queue.

    def acknowledge(self, consumed: int) -> None:
        """The router has read `consumed` updates in all: the credits of those return."""
        self.consumed = consumed
        self._credit.set()

    def end(self) -> None:
        """The router's side of the stream is done: what is queued is written, then it ends."""
        self._ending = True
        self.updates.put_nowait(None)
        self._credit.set()

    async def next_update(self) -> scheduler_pb2.SchedulerUpdate | None:
        """The next update to write, or None once the stream ends. Waits for one, then for
        a credit; every update queued meanwhile goes out merged into it: outputs in
        order, `saturated` as the last one that set it (MergeFrom's rules). It asks for
        an acknowledgement once half the credits are spent."""
        first = None if self._ended else await self.updates.get()
        if first is None:
            return None
        while self._throttled():
            self._credit.clear()
            await self._credit.wait()
        update = scheduler_pb2.SchedulerUpdate()
        _merge_into(update, first)
        while not self.updates.empty():
            later = self.updates.get_nowait()
            if later is None:
                self._ended = True
                break
            _merge_into(update, later)
        self.sent += 1
        update.acknowledge = self._unacknowledged() >= CREDITS // 2
        return update

    def _unacknowledged(self) -> int:
        return self.sent - (self.consumed or 0)

    def _throttled(self) -> bool:
        return self.consumed is not None and not self._ending and self._unacknowledged() >= CREDITS

    def send(self, output: RequestOutput) -> None:
        self.updates.put_nowait([output])

    def refuse(self, request_id: str, code: ErrorCode, error: str, retry_after_ms: int = 0) -> None:
        """Ends a request that was never queued."""
        self.send(RequestOutput(request_id, finish_reason=FinishReason.ERROR, error=error, error_code=code,
                                retry_after_ms=retry_after_ms))


def _merge_into(update: scheduler_pb2.SchedulerUpdate, item: scheduler_pb2.SchedulerUpdate | list[RequestOutput]) -> None:
    """Appends a queued item to the update being written: a step's outputs, converted
    now (by the session's writer, while the engine loop awaits its next plan's send), or
    an update (MergeFrom: outputs appended, `saturated` taken where set)."""
    if isinstance(item, list):
        with step_phases.timed("dispatch"):
            update.outputs.extend([wire.request_output_to_pb(out) for out in item])
    else:
        update.MergeFrom(item)


def owned_by_router(core: Scheduler, request_id: str) -> Request | None:
    """The unfinished request of this id that a router owns, or None (unknown, or the
    core's own, such as the readiness probe)."""
    request = core.get_request(request_id)
    return request if request is not None and request.stream.owner is not None else None


class RouterHub:
    """Every open router session: serves their streams, routes outputs to their owners,
    and tells each one when saturation changes."""

    def __init__(self, coalescer: OutputCoalescer, telemetry: SchedulerTelemetry):
        self.coalescer = coalescer
        self.telemetry = telemetry
        self.sessions: set[RouterSession] = set()
        self.saturated = False  # As last told to the sessions.

    async def serve(self, context, intake) -> None:
        """One router's Session stream until it ends. `intake` (the servicer) takes the
        router's messages: add(session, add), abort(ids) and closed(session); the
        session takes its acknowledgements."""
        session = RouterSession()
        self.sessions.add(session)
        session.updates.put_nowait(scheduler_pb2.SchedulerUpdate(saturated=self.saturated))
        reader = asyncio.create_task(self._read(session, context, intake))
        try:
            while (update := await session.next_update()) is not None:
                await context.write(update)
        finally:
            self.sessions.discard(session)
            reader.cancel()
            intake.closed(session)

    @staticmethod
    async def _read(session: RouterSession, context, intake) -> None:
        try:
            while True:
                message = await context.read()
                if message == grpc.aio.EOF:
                    break
                kind = message.WhichOneof("kind")
                if kind == "add":
                    intake.add(session, message.add)
                elif kind == "abort":
                    intake.abort(list(message.abort.request_ids))
                elif kind == "consumed":
                    session.acknowledge(message.consumed)
        finally:
            session.end()

    def dispatch(self, core: Scheduler, outputs: list[RequestOutput]) -> None:
        """Groups outputs by owning router, one update message per router. Outputs of
        requests no router owns are dropped."""
        with step_phases.timed("dispatch"):
            self._dispatch(core, outputs)

    def _dispatch(self, core: Scheduler, outputs: list[RequestOutput]) -> None:
        ended = {r.request_id: r for r in core.take_ended()}
        # NOTE: once per output of a step (hundreds): lookups bound once.
        find, output, push = core.get_request, self.telemetry.output, self.coalescer.push
        per_session: dict[RouterSession, list[RequestOutput]] = {}
        finished: list[Request] = []
        for out in outputs:
            request = ended.get(out.request_id) or find(out.request_id)
            if request is None or (session := request.stream.owner) is None:
                continue
            output(request, out)
            if (out := push(out, request.stream)) is None:
                continue  # Held until the sample's next N tokens or its end.
            if (outs := per_session.get(session)) is None:
                outs = per_session[session] = []
            outs.append(out)
            if out.finished:
                finished.append(request)
        # NOTE: after the loop: several samples of one request may end in one step.
        for request in finished:
            if request.is_finished:
                self.coalescer.forget(request.stream)
        for session, outs in per_session.items():
            session.updates.put_nowait(outs)

    def publish_saturation(self, saturated: bool) -> None:
        """Tells every router when the core's saturation changes (it drops with the queue,
        which steps, ends and aborts all shrink: every one of them dispatches)."""
        if saturated == self.saturated:
            return
        self.saturated = saturated
        if saturated:
            logger.warning("saturated: the waiting queue is at its bounds, refusing new requests")
        else:
            logger.info("no longer saturated: the waiting queue drained")
        for session in self.sessions:
            session.updates.put_nowait(scheduler_pb2.SchedulerUpdate(saturated=saturated))
