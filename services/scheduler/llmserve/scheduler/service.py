"""The scheduler service: request queues, the paged KV cache's block tables, and the
engine loop that drives the worker.

    router ──Session(add/abort)──▶ ┌──────────── engine loop ────────────┐
                                   │ schedule() → StepPlan               │──Execute──▶ worker
    router ◀──SchedulerUpdate───── │ update_from_output(plan, result)    │◀─StepResult─
                                   └─────────────────────────────────────┘

Everything touching the Scheduler core runs on one asyncio loop, so the core needs no
locks: aborts and adds interleave with steps only at the `await` on the worker.

Who does what:

    service.py         SchedulerServicer: the gRPC handlers, request intake, drain
    membership.py      GroupAssembly: a TP x PP group's ranks until it is complete
    engine_session.py  EngineSession: one registered worker's core, loop, readiness, health
    engine_loop.py     EngineLoop: schedule → execute → update_from_output, forever
    routers.py         RouterHub: routers' Session streams, outputs to their owners
    telemetry.py       SchedulerTelemetry: request and step spans, metrics, the stats log
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from llmserve.contract import wire
from llmserve.contract.grpc_server import ServiceServer
from llmserve.contract.heap import freeze_startup_heap
from llmserve.contract.outputs import ErrorCode
from llmserve.contract.peers import ROUTER, WORKER, PeerCheck
from llmserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from llmserve.scheduler.config import SchedulerServiceConfig
from llmserve.scheduler.engine_session import EngineSession, EngineState, core_for
from llmserve.scheduler import step_budget
from llmserve.scheduler.kv_events import KvEventLog
from llmserve.scheduler.membership import GroupAssembly
from llmserve.scheduler.routers import RouterHub, RouterSession, owned_by_router
from llmserve.scheduler.scheduler import QueueFull, Scheduler
from llmserve.scheduler.stream_interval import OutputCoalescer
from llmserve.scheduler.telemetry import SchedulerTelemetry
from llmserve.scheduler.worker_link import WorkerGroup, WorkerLink
from llmserve.telemetry import SchedulerMetrics, setup_metrics, setup_tracing, shutdown_metrics, shutdown_tracing

logger = logging.getLogger(__name__)


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    """The scheduler's gRPC face. Workers register here (each complete registration
    makes a new EngineSession); routers open Sessions here and their requests enter the
    current engine; the rest is introspection (stats, load, KV events, block audit).

    Before the first registration `engine` is None; after that it is the latest
    session, whatever its state (a lost one keeps its core's stats readable)."""

    def __init__(self, config: SchedulerServiceConfig, server: ServiceServer):
        self.config = config
        self.server = server
        self.engine: EngineSession | None = None
        self.assembly = GroupAssembly(config)
        self.telemetry = SchedulerTelemetry(
            SchedulerMetrics(setup_metrics("scheduler", config.server.metrics_port, config.server.host)))
        self.routers = RouterHub(OutputCoalescer(config.stream_interval), self.telemetry)
        self.draining = False  # After SIGTERM: no new requests.
        self.peers = PeerCheck(enforce=not config.security.insecure)
        # The prefix cache's block events for cache-aware routers (kv_events.py).
        self.kv_events = KvEventLog()

    @property
    def core(self) -> Scheduler | None:
        """The latest engine's core (None before any worker registered)."""
        return self.engine.core if self.engine is not None else None

    # --- worker registration -------------------------------------------------

    async def RegisterWorker(self, request, context):
        # Only a worker may register: anyone else would replace the live worker.
        await self.peers.require(context, WORKER, "RegisterWorker")
        if request.info.wire_revision != wire.WIRE_REVISION:
            # NOTE: a plan field moved between revisions would parse as absent on the other side.
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"worker {request.address} speaks step wire revision {request.info.wire_revision} "
                                f"but this scheduler speaks {wire.WIRE_REVISION}: run the same llmserve release on both")
        info = wire.worker_info_from_pb(request.info)
        tp, pp = max(1, request.tp_size), max(1, request.pp_size)
        if tp * pp > 1:
            worker = await self.assembly.add_rank(request, info, tp, pp, context)
            if worker is None:  # the group is not complete yet
                return scheduler_pb2.RegisterWorkerResponse()
            info = worker.info
        else:
            worker = self.assembly.link(request.address, info)
        if self.engine is not None:
            # A restarted worker replaces the old one; requests on the old one are lost.
            await self.engine.drop("replaced by a new registration")
            self.engine.forget_cached_blocks()  # The new core starts empty: so must subscribers' view.
        self.new_engine(core_for(self.config, info), worker)
        metrics = self.telemetry.metrics
        metrics.model_name = info.model  # Every metric's model_name label, from now on.
        metrics.orphaned_blocks = self.engine.core.num_orphaned_blocks()  # 0: the gauge exists from now.
        self.engine.start()
        logger.info(
            "worker %s registered: %s, %d KV blocks of %d tokens (%d tokens), %d CPU swap blocks,"
            " max_model_len %d", request.address, info.model, info.num_kv_blocks, info.block_size,
            info.num_kv_blocks * info.block_size, info.num_cpu_blocks, info.max_model_len,
        )
        return scheduler_pb2.RegisterWorkerResponse()

    def new_engine(self, core: Scheduler, worker: WorkerLink | WorkerGroup) -> EngineSession:
        """The engine session of a newly registered worker (not started yet)."""
        self.engine = EngineSession(core, worker, self.server, self.routers, self.telemetry, self.kv_events,
                                    draining=lambda: self.draining, step_watchdog=self.config.step_watchdog)
        return self.engine

    # --- router sessions -----------------------------------------------------

    async def Session(self, request_iterator, context):
        # Requests arrive here validated by a router: nobody else may submit them.
        await self.peers.require(context, ROUTER, "Session")
        await self.routers.serve(context, self)

    def add(self, session: RouterSession, add) -> None:
        """A router's AddRequest: queued in the engine, or refused with why."""
        request_id, engine = add.request_id, self.engine
        if self.draining:
            session.refuse(request_id, ErrorCode.UNAVAILABLE, "unavailable: the scheduler is shutting down")
            return
        if engine is None or engine.lost:
            session.refuse(request_id, ErrorCode.UNAVAILABLE, "no worker is registered")
            return
        if engine.state is EngineState.HALTED:
            session.refuse(request_id, ErrorCode.UNAVAILABLE, f"the engine halted: {engine.halted}")
            return
        if owned_by_router(engine.core, request_id) is not None:
            session.refuse(request_id, ErrorCode.ALREADY_EXISTS, f"request id {request_id!r} is already running")
            return
        # The client's deadline, as a budget relative to now: the clocks need not agree.
        deadline = time.monotonic() + add.deadline_ms / 1000 if add.deadline_ms else None
        try:
            request = engine.submit(session, request_id, list(add.prompt_token_ids),
                                    wire.sampling_from_pb(add.sampling), n=add.n or 1,
                                    priority=add.priority, deadline=deadline, cache_salt=add.cache_salt)
        except ValueError as err:
            session.refuse(request_id, ErrorCode.INVALID_ARGUMENT, str(err))
            return
        except QueueFull as full:
            session.refuse(request_id, ErrorCode.RESOURCE_EXHAUSTED, str(full), full.retry_after_ms)
            self.routers.publish_saturation(engine.core.saturated)
            return
        self.telemetry.request_added(request, add.trace_context, len(add.prompt_token_ids), add.n or 1)

    def abort(self, request_ids: list[str]) -> None:
        """A router's AbortRequest (a client went away, or the router migrates them)."""
        if self.engine is not None:
            self.engine.abort(request_ids)

    def closed(self, session: RouterSession) -> None:
        """The router is gone (or its stream broke): nobody can receive its outputs."""
        if self.engine is not None:
            self.engine.abort(self.engine.router_request_ids(owner=session))

    # --- KV events and load (for cache- and load-aware routing) -------------------

    def _kv_snapshot(self):
        """(stored events for every cached block, block size) for a new subscriber."""
        if self.engine is None:
            return [], 0
        return self.engine.core.cached_block_events(), self.engine.core.cache.block_size

    async def SubscribeKvEvents(self, request, context):
        # Open to any cluster certificate (the router's included), like GetStats.
        if self.engine is not None:
            self.engine.publish_kv_events()  # A snapshot must not precede a batch of what it shows.
        first, subscriber = self.kv_events.subscribe(request.after_sequence, request.instance_id,
                                                     self._kv_snapshot)
        try:
            for batch in first:
                await context.write(batch)
            while (batch := await subscriber.queue.get()) is not None:
                await context.write(batch)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"this KV event subscriber fell {self.kv_events.queue_batches} batches behind and "
                                f"was dropped; resubscribe (after_sequence resumes while the batches are buffered)")
        finally:
            self.kv_events.unsubscribe(subscriber)

    async def GetLoad(self, request, context):
        # Open to any cluster certificate (the router's included), like GetStats.
        if self.engine is None:
            return scheduler_pb2.Load(serving=False)
        core, stats = self.engine.core, self.engine.core.stats()
        return scheduler_pb2.Load(
            num_running=stats.num_running, num_waiting=stats.num_waiting, num_swapped=stats.num_swapped,
            num_free_blocks=stats.num_free_blocks, num_total_blocks=stats.num_total_blocks,
            kv_usage=stats.kv_cache_usage, num_waiting_tokens=core.num_waiting_prompt_tokens(),
            serving=self.engine.state is EngineState.SERVING and not self.draining)

    # --- introspection -------------------------------------------------------

    async def GetStats(self, request, context):
        if self.engine is None:
            return scheduler_pb2.SchedulerStats(worker_ready=False)
        core = self.engine.core
        stats = wire.scheduler_stats_to_pb(core.stats(), worker_ready=not self.engine.lost)
        stats.num_orphaned_blocks = core.num_orphaned_blocks()
        return stats

    async def GetBlockAudit(self, request, context):
        if self.engine is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no worker has registered: there are no blocks")
        core = self.engine.core
        stats = core.stats()
        return wire.block_audit_to_pb(core.audit(), stats.num_total_blocks, stats.num_free_blocks)

    async def GetServingInfo(self, request, context):
        if self.engine is None or self.engine.state is not EngineState.SERVING:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no worker is ready yet")
        # The budget core_for resolved (a pure function of the config and the worker's info).
        budget = step_budget.budget_for(self.config.scheduling, self.engine.worker.info)
        return scheduler_pb2.ServingInfo(
            worker=wire.worker_info_to_pb(self.engine.worker.info),
            num_kv_blocks=self.engine.core.stats().num_total_blocks,
            max_num_batched_tokens=budget.max_num_batched_tokens, max_num_seqs=budget.max_num_seqs,
            step_budget_reason=budget.reason,
        )

    # --- shutdown ------------------------------------------------------------

    async def drain(self) -> None:
        """SIGTERM: refuse new requests, let running ones finish for up to the shutdown
        timeout, then fail the rest (their routers answer UNAVAILABLE)."""
        self.draining = True
        await self.server.set_serving(False)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.server.shutdown_timeout
        engine = self.engine
        while engine is not None and not engine.lost and engine.router_request_ids() and loop.time() < deadline:
            await asyncio.sleep(0.05)
            engine = self.engine
        if engine is not None and (left := engine.router_request_ids()):
            logger.warning("shutdown timeout: failing %d requests", len(left))
            engine.fail_router_requests(
                f"unavailable: the scheduler is shutting down (still running after the"
                f" {self.config.server.shutdown_timeout:.0f} s shutdown timeout)")
        await asyncio.sleep(0.1)  # Let the session writers send the last outputs.
        self.telemetry.close_all(self.core, "scheduler shut down")

    async def shutdown(self) -> None:
        if self.engine is not None:
            await self.engine.close()


async def serve(config: SchedulerServiceConfig, stop_event: asyncio.Event) -> None:
    setup_tracing("llmserve-scheduler")
    server = ServiceServer("llmserve.internal.v1.Scheduler", config.server.host, config.server.port, config.security,
                           max_message_bytes=config.server.max_message_bytes,
                           health_port=config.server.health_port)
    servicer = SchedulerServicer(config, server)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server.server)
    await server.start()
    freeze_startup_heap()  # Modules and the server's objects: out of every full collection's walk.
    core_of = lambda: servicer.core  # noqa: E731 (the latest engine's, read at each tick)
    stats_task = asyncio.create_task(servicer.telemetry.log_stats_forever(core_of, config.log_stats_interval_s))
    audit_task = asyncio.create_task(servicer.telemetry.audit_blocks_forever(core_of))
    try:
        await stop_event.wait()
        await servicer.drain()
    finally:
        stats_task.cancel()
        audit_task.cancel()
        await servicer.shutdown()
        await server.stop(grace=2.0)
        shutdown_metrics()
        shutdown_tracing()
