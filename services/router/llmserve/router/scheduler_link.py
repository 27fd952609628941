"""The router's end of the scheduler Session stream.

Adds and aborts go out on one long-lived bidirectional stream; the reader task hands
each request's outputs to that request's own queue, so streams stay isolated
(vLLM's per-request output queues, over gRPC instead of ZMQ). The queues live on the
requests' records (placements.py): the link keeps no table of its own. The reader
acknowledges what it has handed over when an update asks (RouterMessage.consumed): the
scheduler sends a lagging router fewer updates, each merging several steps, rather than
queueing them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from llmserve.contract import wire
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.contract.grpc_server import MAX_MESSAGE_BYTES, SERVING, channel
from llmserve.contract.security import SecurityOptions
from llmserve.contract.startup_errors import rpc_cause
from llmserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from llmserve.contract.sampling import SamplingParams
from llmserve.contract.step_budget import StepBudget
from llmserve.contract.worker_info import WorkerInfo
from llmserve.router.placements import Placements

logger = logging.getLogger(__name__)
WAIT_REPORT_S = 5.0  # How often a router waiting for its scheduler at start-up says why.
WAIT_REPORT_IDLE_S = 30.0  # ... and later, while other replicas serve or after its deadline.


class SchedulerUnavailable(RuntimeError):
    """The link has no session open (its scheduler is lost): the request goes elsewhere."""


class SchedulerLink:
    """The router's connection to one replica's scheduler. `address`: the gRPC target;
    `placements`: the router's requests, whose records hold the output queues;
    `tls_name`: the name its certificate carries when `address` is a resolved one;
    `name`: how logs and errors call it."""

    def __init__(self, address: str, security: SecurityOptions, placements: Placements,
                 max_message_bytes: int = MAX_MESSAGE_BYTES, tls_name: str | None = None, name: str | None = None):
        self.address = address
        self.name = name or address
        self.placements = placements
        self.waiting = self.fix = ""  # Why it is not serving yet, and what to check.
        # Mutual TLS: the router's certificate.
        self._channel = channel(address, security, max_message_bytes, tls_name=tls_name)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._call = None
        self._reader: asyncio.Task | None = None
        self.connected = asyncio.Event()
        self.disconnected = asyncio.Event()
        # grpc.aio allows one write in flight per call; many requests share this one.
        self._write_lock = asyncio.Lock()
        # The scheduler's saturation, as its session last said (admission control).
        self.saturated = False
        self.saturation_changed = asyncio.Event()

    async def wait_serving_info(self, deadline: float | None = None) -> tuple[WorkerInfo, int, StepBudget]:
        """Polls until the scheduler has a worker; returns (worker info, KV blocks, the step
        budget it resolved; zeros from a scheduler that predates it). While
        it waits, `waiting` says why (and `fix` what to check); every few seconds it says
        so in the log, with the time left before `deadline` (a loop.time()) if there is one."""
        loop = asyncio.get_running_loop()
        next_report = loop.time() + WAIT_REPORT_S  # A scheduler starting beside us is not news.
        while True:
            try:
                # No wait_for_ready: a refused connection fails at once with its reason.
                info = await self._stub.GetServingInfo(scheduler_pb2.GetServingInfoRequest(), timeout=5)
                self.waiting = self.fix = ""
                budget = StepBudget(info.max_num_batched_tokens, info.max_num_seqs, info.step_budget_reason)
                return wire.worker_info_from_pb(info.worker), info.num_kv_blocks, budget
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    self.waiting = f"the scheduler at {self.name} has no worker yet"
                    self.fix = "is a worker starting? it registers with --scheduler"
                else:
                    self.waiting = (f"cannot reach the scheduler at {self.name}: "
                                    f"{rpc_cause(err.code().name, err.details(), 5)}")
                    self.fix = "is the scheduler running? --scheduler sets its address"
                    if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        self.fix = "the scheduler refused the router: see its log"
            if loop.time() >= next_report:
                left = "" if deadline is None else f"; waiting {max(0.0, deadline - loop.time()):.0f} s more"
                logger.warning("router: %s (%s)%s", self.waiting, self.fix, left)
                next_report = loop.time() + (WAIT_REPORT_S if deadline is not None and loop.time() < deadline
                                             else WAIT_REPORT_IDLE_S)
            await asyncio.sleep(0.5)

    async def load(self) -> scheduler_pb2.Load | None:
        """The scheduler's load now; None if it cannot say (down, or too old for GetLoad)."""
        try:
            return await self._stub.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=2)
        except grpc.aio.AioRpcError:
            return None

    def kv_events(self, after_sequence: int, instance_id: str):
        """The scheduler's KV event batches, from a snapshot or after `after_sequence`."""
        return self._stub.SubscribeKvEvents(
            scheduler_pb2.SubscribeKvEventsRequest(after_sequence=after_sequence, instance_id=instance_id))

    async def connect(self) -> None:
        """Opens a new Session stream (after a lost one, too)."""
        self.disconnected.clear()
        self._call = self._stub.Session()
        self._reader = asyncio.create_task(self._read_forever(self._call), name="scheduler-reader")
        self.connected.set()

    async def _read_forever(self, call) -> None:
        reason = "scheduler closed the session"
        acks = Acknowledger(lambda message: self._locked_write(call, message))
        try:
            while True:
                update = await call.read()
                if update == grpc.aio.EOF:
                    break
                if update.HasField("saturated") and update.saturated != self.saturated:
                    self.saturated = update.saturated
                    self.saturation_changed.set()
                for out_pb in update.outputs:
                    queue = self.placements.queue_of(out_pb.request_id, self)
                    if queue is not None:
                        queue.put_nowait(wire.request_output_from_pb(out_pb))
                acks.read_one(update.acknowledge)
        except grpc.aio.AioRpcError as err:
            reason = f"scheduler unavailable: {err.code().name} {err.details()}"
        except asyncio.CancelledError:
            return
        self.connected.clear()
        if self.saturated:  # Whatever the next session says; until then health is NOT_SERVING anyway.
            self.saturated = False
            self.saturation_changed.set()
        logger.error("%s", reason)
        self._fail_all(reason)
        self.disconnected.set()

    def _fail_all(self, reason: str) -> None:
        for record in self.placements.on(self):
            record.fail(reason)

    async def add(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                  n: int = 1, priority: int = 0, trace_context: dict[str, str] | None = None,
                  deadline_ms: int = 0, cache_salt: str = "") -> None:
        """Queue a request of `n` samples, already placed here (Placements.place): its
        outputs (every sample's) land in its record's queue. `deadline_ms`: what is left
        of the client's deadline (0: none); `cache_salt`: its prefix-cache isolation."""
        if not self.connected.is_set():
            raise SchedulerUnavailable(f"not connected to scheduler {self.address}")
        add = wire.add_request_to_pb(request_id, prompt_token_ids, sampling, n, priority, trace_context, deadline_ms,
                                     cache_salt)
        await self._write(scheduler_pb2.RouterMessage(add=add))

    async def _write(self, message: scheduler_pb2.RouterMessage) -> None:
        """Writes on the shared Session stream. NOTE: a caller may be cancelled mid-write
        (its client went away); a write cut halfway would leave the stream that every
        request shares unusable, so the write runs as a task of its own and a cancelled
        caller only stops waiting for it (its abort, written next, follows it in order)."""
        task = asyncio.ensure_future(self._locked_write(self._call, message))
        task.add_done_callback(_retrieve)
        await asyncio.shield(task)

    async def _locked_write(self, call, message: scheduler_pb2.RouterMessage) -> None:
        async with self._write_lock:
            await call.write(message)

    async def abort(self, request_ids: list[str]) -> None:
        """Ends these requests in the scheduler (their KV blocks freed); their outputs
        stop reaching them once their records are unplaced."""
        if request_ids and self.connected.is_set():
            try:
                await self._write(
                    scheduler_pb2.RouterMessage(abort=scheduler_pb2.AbortRequests(request_ids=request_ids))
                )
            except grpc.aio.AioRpcError as err:
                logger.warning("abort of %s not delivered: %s", request_ids, err.details())

    async def scheduler_serving(self) -> bool:
        """The scheduler's own health: SERVING only while it has a worker."""
        try:
            reply = await health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=2
            )
        except grpc.aio.AioRpcError:
            return False
        return reply.status == SERVING

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._call is not None:
            self._call.cancel()
        await self._channel.close()


class Acknowledger:
    """Returns the scheduler's credits on one Session call: the count of updates read so
    far (RouterMessage.consumed), written after an update that asks for it. At most one
    such write is in flight, as a task of its own: the reader never waits behind a slow
    write, and the count a write takes when it starts covers every update read before it."""

    def __init__(self, write: Callable[[scheduler_pb2.RouterMessage], Awaitable[None]]):
        self._write = write  # Serialized with the call's other writes.
        self.read = 0  # Updates read on the call.
        self._owed = False  # An update read since the last write began asked for one.
        self._writing: asyncio.Task | None = None

    def read_one(self, acknowledge: bool) -> None:
        """One more update was read and handed to its requests; `acknowledge`: it asks
        for the count."""
        self.read += 1
        self._owed = self._owed or acknowledge
        if self._owed and self._writing is None:
            self._writing = asyncio.ensure_future(self._send())
            self._writing.add_done_callback(_retrieve)

    async def _send(self) -> None:
        # NOTE: never cancelled: a write cut halfway cancels the call. It ends with the
        # call, whose reader reports why.
        try:
            while self._owed:
                self._owed = False
                await self._write(scheduler_pb2.RouterMessage(consumed=self.read))
        finally:
            self._writing = None


def _retrieve(task: asyncio.Task) -> None:
    """Marks a shielded write's failure as seen: its caller, if still waiting, got it
    already; if cancelled meanwhile, the session's reader reports the broken stream."""
    if not task.cancelled():
        task.exception()
