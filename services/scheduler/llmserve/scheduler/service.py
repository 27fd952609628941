"""The scheduler service: request queues, the paged KV cache's block tables, and the
engine loop that drives the worker.

    router ──Session(add/abort)──▶ ┌──────────── engine loop ────────────┐
                                   │ schedule() → StepPlan               │──Execute──▶ worker
    router ◀──SchedulerUpdate───── │ update_from_output(plan, result)    │◀─StepResult─
                                   └─────────────────────────────────────┘

Everything touching the Scheduler core runs on one asyncio loop, so the core needs no
locks: aborts and adds interleave with steps only at the `await` on the worker.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import grpc

from llmserve.contract import wire
from llmserve.contract.grpc_server import ServiceServer
from llmserve.contract.peers import ROUTER, WORKER, PeerCheck
from llmserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from llmserve.contract.outputs import ErrorCode, FinishReason, RequestOutput
from llmserve.scheduler.config import SchedulerServiceConfig
from llmserve.scheduler.engine_loop import EngineLoop, LoopHooks
from llmserve.scheduler.kv_events import KvEventLog
from llmserve.scheduler.request import Request
from llmserve.scheduler.scheduler import KVCacheShape, QueueFull, Scheduler
from llmserve.scheduler.stream_interval import OutputCoalescer
from llmserve.scheduler.worker_link import WorkerGroup, WorkerLink, WorkerLost
from llmserve.contract.sampling import SamplingParams
from llmserve.telemetry import SchedulerMetrics, setup_metrics, setup_tracing, shutdown_metrics, shutdown_tracing
from llmserve.telemetry import tracing
from llmserve.telemetry.requests import SchedulerRequests

logger = logging.getLogger(__name__)

# The readiness request's id (an id no router sends: routers use uuid4 hex or the client's).
READINESS_REQUEST_ID = "__llmserve_readiness__"
WORKER_HEALTH_POLL_S = 0.5


class RouterSession:
    """One router's stream: outputs of its requests are queued here for writing."""

    _ids = itertools.count()

    def __init__(self):
        self.id = next(self._ids)
        self.updates: asyncio.Queue[scheduler_pb2.SchedulerUpdate | None] = asyncio.Queue()
        self.owned: dict[Request, None] = {}  # Its live requests' records (an ordered set).


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, config: SchedulerServiceConfig, server: ServiceServer):
        self.config = config
        self.server = server
        self.core: Scheduler | None = None
        self.worker: WorkerLink | None = None
        # The live requests' records by public id (routers name them by id). Each record
        # carries its owning session and held tokens (Request.stream).
        self._live: dict[str, Request] = {}
        self._work = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._engine: EngineLoop | None = None
        self.halted: str | None = None  # Why the engine loop stopped (engine_loop.py), until a new worker.
        self._num_worker_failures = 0
        # A TP x PP group registers rank by rank: rank -> (address, info), until complete.
        self._pending_ranks: dict[int, tuple[str, object]] = {}
        self._pending_topology: tuple[int, int] | None = None
        self.metrics = SchedulerMetrics(setup_metrics("scheduler", config.server.metrics_port, config.server.host))
        self.requests = SchedulerRequests(self.metrics)
        self.draining = False  # After SIGTERM: no new requests.
        self._probe: asyncio.Future | None = None  # The readiness request's outcome.
        self.ready = False  # A worker is registered and its readiness step has run.
        self.coalescer = OutputCoalescer(config.stream_interval)
        # Admission control: every open session hears when saturation changes.
        self._sessions: set[RouterSession] = set()
        self._saturated = False  # As last told to the sessions.
        self.peers = PeerCheck(enforce=not config.security.insecure)
        # The prefix cache's block events for cache-aware routers (kv_events.py).
        self.kv_events = KvEventLog()

    # --- worker registration -------------------------------------------------

    async def RegisterWorker(self, request, context):
        # Only a worker may register: anyone else would replace the live worker.
        await self.peers.require(context, WORKER, "RegisterWorker")
        info = wire.worker_info_from_pb(request.info)
        tp, pp = max(1, request.tp_size), max(1, request.pp_size)
        group = None
        if tp * pp > 1:
            group = await self._register_rank(request, info, tp, pp, context)
            if group is None:  # the group is not complete yet
                return scheduler_pb2.RegisterWorkerResponse()
            info = group.info
        if self.worker is not None:
            # A restarted worker replaces the old one; requests on the old one are lost.
            await self._drop_worker("replaced by a new registration")
        self._forget_cached_blocks()  # The new core starts empty: so must subscribers' view.
        cache = KVCacheShape(num_blocks=info.num_kv_blocks, block_size=info.block_size,
                             max_model_len=info.max_model_len, num_cpu_blocks=info.num_cpu_blocks)
        self.core = Scheduler(self.config.scheduling, cache, eos_token_ids=info.eos_token_ids)
        self.worker = group or WorkerLink(request.address, info, self.config.security,
                                          self.config.server.max_message_bytes)
        self.halted = None
        self.metrics.model_name = info.model  # Every metric's model_name label, from now on.
        self.metrics.orphaned_blocks = self.core.audit().num_orphaned_blocks  # 0: the gauge exists from now.
        self._start_engine_loop()
        asyncio.create_task(self._prove_ready(self.worker), name="readiness-probe")
        asyncio.create_task(self._watch_worker(self.worker), name="worker-watchdog")
        logger.info(
            "worker %s registered: %s, %d KV blocks of %d tokens (%d tokens), %d CPU swap blocks,"
            " max_model_len %d", request.address, info.model, info.num_kv_blocks, info.block_size,
            info.num_kv_blocks * info.block_size, info.num_cpu_blocks, info.max_model_len,
        )
        return scheduler_pb2.RegisterWorkerResponse()

    async def _register_rank(self, request, info, tp: int, pp: int, context) -> WorkerGroup | None:
        """One rank of a TP x PP group. Returns the group once all tp*pp ranks have
        registered (plans then go to every rank; tokens come from the last stage's TP
        rank 0), None before. Ranks serving another model are refused."""
        world = tp * pp
        if not 0 <= request.rank < world:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"rank {request.rank} outside 0..{world - 1}")
        if self._pending_topology != (tp, pp):  # a new group (or a re-started one) begins
            self._pending_ranks, self._pending_topology = {}, (tp, pp)
        for rank, (_, other) in self._pending_ranks.items():
            if rank != request.rank and other.model_path != info.model_path:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"rank {request.rank} serves {info.model_path!r} but rank {rank} serves "
                                    f"{other.model_path!r}: every rank of a group must load the same model")
        self._pending_ranks[request.rank] = (request.address, info)
        missing = [r for r in range(world) if r not in self._pending_ranks]
        if missing:
            logger.info("rank %d of a tp=%d x pp=%d group registered (%s); waiting for rank(s) %s",
                        request.rank, tp, pp, request.address, missing)
            return None
        ranks, self._pending_ranks, self._pending_topology = self._pending_ranks, {}, None
        links = [WorkerLink(*ranks[r], self.config.security, self.config.server.max_message_bytes)
                 for r in range(world)]
        logger.info("worker group complete: tp=%d x pp=%d, driver rank %d", tp, pp, (pp - 1) * tp)
        return WorkerGroup(links, driver=(pp - 1) * tp, step_timeout_s=self.config.step_timeout_s)

    async def _prove_ready(self, worker: WorkerLink) -> None:
        """Readiness: one 1-token request through the worker before turning SERVING, so
        SERVING means a step has run (model, KV cache and the Execute stream all work)."""
        self._probe = asyncio.get_running_loop().create_future()
        self.core.add_request(READINESS_REQUEST_ID, [worker.info.bos_token_id if worker.info.bos_token_id >= 0 else 0],
                              SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        self._work.set()
        error = await self._probe
        if self.worker is not worker:
            return  # Replaced or lost meanwhile.
        if error:
            logger.error("readiness step failed: %s", error)
            await self._drop_worker(f"readiness step failed: {error}")
            return
        self.ready = True
        if not self.draining:
            await self.server.set_serving(True)
        logger.info("readiness step ran: serving")

    async def _watch_worker(self, worker: WorkerLink) -> None:
        """Notices a lost worker while idle too (a step would notice it only when one runs):
        two failed health checks in a row drop it, and health turns NOT_SERVING."""
        failures = 0
        while self.worker is worker:
            await asyncio.sleep(WORKER_HEALTH_POLL_S)
            if self.worker is not worker:
                return  # Dropped or replaced meanwhile (its channel is closed).
            failures = 0 if await worker.alive() else failures + 1
            if failures >= 2 and self.worker is worker:
                logger.error("worker %s stopped answering health checks", worker.address)
                self._num_worker_failures += 1
                await self._drop_worker("it stopped answering health checks")

    async def _drop_worker(self, reason: str) -> None:
        self.ready = False
        await self.server.set_serving(False)
        if self._probe is not None and not self._probe.done():
            self._probe.set_result(f"worker lost: {reason}")
        if self.core is not None:
            ids = list(self._live)
            self._dispatch(self.core.fail_requests(ids, f"worker lost: {reason}", ErrorCode.UNAVAILABLE))
            self._forget_cached_blocks()  # The worker's KV went with it.
        if self._loop_task is not None and self._loop_task is not asyncio.current_task():
            self._loop_task.cancel()
        if self.worker is not None:
            await self.worker.close()
        self.worker = None
        self._loop_task = None

    # --- router sessions -----------------------------------------------------

    async def Session(self, request_iterator, context):
        # Requests arrive here validated by a router: nobody else may submit them.
        await self.peers.require(context, ROUTER, "Session")
        session = RouterSession()
        self._sessions.add(session)
        session.updates.put_nowait(scheduler_pb2.SchedulerUpdate(saturated=self._saturated))
        reader = asyncio.create_task(self._read_router(session, context))
        try:
            while True:
                update = await session.updates.get()
                if update is None:
                    break
                await context.write(update)
        finally:
            self._sessions.discard(session)
            reader.cancel()
            # The router is gone (or its stream broke): nobody can receive these outputs.
            self._abort([request.request_id for request in session.owned])

    async def _read_router(self, session: RouterSession, context) -> None:
        try:
            while True:
                message = await context.read()
                if message == grpc.aio.EOF:
                    break
                kind = message.WhichOneof("kind")
                if kind == "add":
                    self._add(session, message.add)
                elif kind == "abort":
                    self._abort(list(message.abort.request_ids))
        finally:
            await session.updates.put(None)

    def _add(self, session: RouterSession, add) -> None:
        request_id = add.request_id
        if self.draining:
            self._refuse(session, request_id, ErrorCode.UNAVAILABLE, "unavailable: the scheduler is shutting down")
            return
        if self.core is None or self.worker is None:
            self._refuse(session, request_id, ErrorCode.UNAVAILABLE, "no worker is registered")
            return
        if self.halted is not None:
            self._refuse(session, request_id, ErrorCode.UNAVAILABLE, f"the engine halted: {self.halted}")
            return
        if request_id in self._live:
            self._refuse(session, request_id, ErrorCode.ALREADY_EXISTS, f"request id {request_id!r} is already running")
            return
        # The client's deadline, as a budget relative to now: the clocks need not agree.
        deadline = time.monotonic() + add.deadline_ms / 1000 if add.deadline_ms else None
        try:
            request, displaced = self.core.submit(request_id, list(add.prompt_token_ids),
                                                  wire.sampling_from_pb(add.sampling), n=add.n or 1,
                                                  priority=add.priority, deadline=deadline)
        except ValueError as err:
            self._refuse(session, request_id, ErrorCode.INVALID_ARGUMENT, str(err))
            return
        except QueueFull as full:
            self._refuse(session, request_id, ErrorCode.RESOURCE_EXHAUSTED, str(full), full.retry_after_ms)
            self._publish_saturation()
            return
        self._dispatch(displaced)
        request.stream.owner = session
        self._live[request_id] = request
        session.owned[request] = None
        self.requests.added(request_id, add.trace_context, len(add.prompt_token_ids), add.n or 1)
        self._work.set()
        # A multi-step run in flight ends after its current step, so this request's prompt
        # waits for one decode step, not for the whole run.
        self.worker.interrupt()

    def _abort(self, request_ids: list[str]) -> None:
        if self.core is None:
            return
        live = [r for r in request_ids if r in self._live]
        if live:
            self._dispatch(self.core.abort_requests(live))
            self._work.set()  # The worker must drop their state at the next step.

    def _refuse(self, session: RouterSession, request_id: str, code: ErrorCode, error: str,
                retry_after_ms: int = 0) -> None:
        """Ends a request that was never queued."""
        self._send(session, RequestOutput(request_id, finish_reason=FinishReason.ERROR, error=error, error_code=code,
                                          retry_after_ms=retry_after_ms))

    def _send(self, session: RouterSession, output: RequestOutput) -> None:
        session.updates.put_nowait(scheduler_pb2.SchedulerUpdate(outputs=[wire.request_output_to_pb(output)]))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Groups a step's outputs by owning router, one update message per router."""
        per_session: dict[int, tuple[RouterSession, list]] = {}
        ended: list[Request] = []
        for out in outputs:
            if out.request_id == READINESS_REQUEST_ID:
                if out.finished and self._probe is not None and not self._probe.done():
                    self._probe.set_result(out.error if out.finish_reason == FinishReason.ERROR else "")
                continue
            if out.new_token_ids:
                self.requests.produced(out.request_id)
            request = self._live.get(out.request_id)
            if out.finished and (request is None or request.is_finished):
                self.requests.finished(out.request_id, out.finish_reason.name.lower(), out.error)
            if request is None:
                continue
            out = self.coalescer.push(out, request.stream)
            if out is None:
                continue  # Held until the sample's next N tokens or its end.
            session = request.stream.owner
            per_session.setdefault(session.id, (session, []))[1].append(wire.request_output_to_pb(out))
            if out.finished:
                ended.append(request)
        # NOTE: after the loop: several samples of one request may end in one step.
        for request in ended:
            if request.is_finished and self._live.get(request.request_id) is request:
                del self._live[request.request_id]
                request.stream.owner.owned.pop(request, None)
                self.coalescer.forget(request.stream)
        for session, pbs in per_session.values():
            session.updates.put_nowait(scheduler_pb2.SchedulerUpdate(outputs=pbs))
        self._publish_saturation()
        # NOTE: every engine step ends here (outputs or not), and so do aborts, expiries
        # and failures: one KV event batch per step that changed the cache.
        self._publish_kv_events()

    # --- KV events and load (for cache- and load-aware routing) -------------------

    def _publish_kv_events(self) -> None:
        """Sends the core's block events since the last call as one batch (if any)."""
        if self.core is not None:
            self.kv_events.publish(self.core.take_block_events(), self.core.cache.block_size)

    def _forget_cached_blocks(self) -> None:
        """The worker's KV content is gone: the core's cache is cleared, and subscribers
        hear it (no `cleared` when nothing was cached). Events still pending go first: the
        core may be replaced next, and a pending `removed` must not be lost with it."""
        self._publish_kv_events()
        if self.core is not None and self.core.kv.pool.num_cached_blocks:
            self.core.reset_prefix_cache()
            self._publish_kv_events()

    def _kv_snapshot(self):
        """(stored events for every cached block, block size) for a new subscriber."""
        if self.core is None:
            return [], 0
        return self.core.cached_block_events(), self.core.cache.block_size

    async def SubscribeKvEvents(self, request, context):
        # Open to any cluster certificate (the router's included), like GetStats.
        self._publish_kv_events()  # A snapshot must not precede a batch of what it shows.
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
        serving = (self.core is not None and self.worker is not None and self.ready and not self.draining
                   and self.halted is None)
        if self.core is None:
            return scheduler_pb2.Load(serving=False)
        stats = self.core.stats()
        return scheduler_pb2.Load(
            num_running=stats.num_running, num_waiting=stats.num_waiting, num_swapped=stats.num_swapped,
            num_free_blocks=stats.num_free_blocks, num_total_blocks=stats.num_total_blocks,
            kv_usage=stats.kv_cache_usage, num_waiting_tokens=self.core.num_waiting_prompt_tokens(),
            serving=serving)

    # --- admission control ---------------------------------------------------

    def _publish_saturation(self) -> None:
        """Tells every router when the core's saturation changes (it drops with the queue,
        which steps, ends and aborts all shrink: every one of them dispatches)."""
        saturated = self.core is not None and self.core.saturated
        if saturated == self._saturated:
            return
        self._saturated = saturated
        if saturated:
            logger.warning("saturated: the waiting queue is at its bounds, refusing new requests")
        else:
            logger.info("no longer saturated: the waiting queue drained")
        for session in self._sessions:
            session.updates.put_nowait(scheduler_pb2.SchedulerUpdate(saturated=saturated))

    # --- the engine loop (engine_loop.py) -------------------------------------

    def _start_engine_loop(self) -> None:
        hooks = LoopHooks(dispatch=self._dispatch, step_started=self._step_span, step_finished=self._step_done,
                          worker_lost=self._worker_lost, halt=self._halt)
        self._engine = EngineLoop(self.core, self.worker, hooks, self._work)
        self._loop_task = asyncio.create_task(self._engine.run(), name="engine-loop")

    async def _worker_lost(self, err: WorkerLost) -> None:
        logger.error("%s", err)
        self._num_worker_failures += 1
        await self._drop_worker(str(err))

    async def _halt(self, reason: str) -> None:
        """The engine cannot go on (see engine_loop.py): never a silent hang with SERVING.
        Every live request fails, new ones are refused until a worker registers again."""
        self.halted = reason
        self.ready = False
        logger.error("engine halted: %s; health NOT_SERVING until a worker registers again", reason)
        await self.server.set_serving(False)
        if self._probe is not None and not self._probe.done():
            self._probe.set_result(f"engine halted: {reason}")
        try:
            self._dispatch(self.core.fail_requests(list(self._live), f"unavailable: the engine halted ({reason})",
                                                   ErrorCode.UNAVAILABLE))
        except Exception:  # The core is what broke: end the streams without it.
            logger.exception("failing the live requests through the scheduler failed; ending their streams")
            for request_id, request in list(self._live.items()):
                for index in range(request.n):
                    self._send(request.stream.owner, RequestOutput(
                        request_id, index=index, finish_reason=FinishReason.ERROR, error_code=ErrorCode.UNAVAILABLE,
                        error=f"unavailable: the engine halted ({reason})"))
                request.stream.owner.owned.pop(request, None)
            self._live.clear()

    def _step_done(self, plan, result, span, seconds: float) -> None:
        if result.error:
            span.set_status(tracing.trace.Status(tracing.trace.StatusCode.ERROR, result.error))
        span.end()
        self.metrics.step_time.record(seconds)
        self.metrics.step_tokens.record(plan.total_scheduled_tokens * result.num_steps)
        self.metrics.stats = self.core.stats()

    def _step_span(self, plan, start_ns: int):
        """The step's span (linked to its requests); puts trace contexts into the plan."""
        public_ids = []
        for r in plan.new_requests + plan.cached_requests:
            sample = self.core.get_sample(r.seq_id)
            public_ids.append(sample.request.request_id if sample is not None else "")
        self.requests.scheduled(public_ids)
        if not tracing.enabled():
            return tracing.trace.INVALID_SPAN
        prefill = sum(r.num_scheduled_tokens for r in plan.new_requests)
        # NOTE: the span starts where the step did, before schedule(), as the step time metric does.
        span = tracing.start_span("scheduler.step", parent=tracing.otel_context.Context(), start_time=start_ns,
                                  links=self.requests.links(dict.fromkeys(public_ids)), attributes={
            "llmserve.step_id": plan.step_id,
            "llmserve.batch_size": len(plan.new_requests) + len(plan.cached_requests),
            "llmserve.num_new_requests": len(plan.new_requests),
            "llmserve.num_scheduled_tokens": plan.total_scheduled_tokens,
            "llmserve.num_new_request_tokens": prefill,
            "llmserve.num_swap_out": len(plan.swap_out), "llmserve.num_swap_in": len(plan.swap_in)})
        plan.trace_context = tracing.context_to_map(span)
        for r, public_id in zip(plan.new_requests, public_ids):
            r.trace_context = self.requests.prefill_context(public_id)
        return span

    # --- introspection -------------------------------------------------------

    async def GetStats(self, request, context):
        if self.core is None:
            return scheduler_pb2.SchedulerStats(worker_ready=False)
        stats = wire.scheduler_stats_to_pb(self.core.stats(), worker_ready=self.worker is not None)
        stats.num_orphaned_blocks = self.core.audit().num_orphaned_blocks
        return stats

    async def GetBlockAudit(self, request, context):
        if self.core is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no worker has registered: there are no blocks")
        stats = self.core.stats()
        return wire.block_audit_to_pb(self.core.audit(), stats.num_total_blocks, stats.num_free_blocks)

    async def audit_blocks_forever(self, interval_s: float = 5.0) -> None:
        """Feeds the orphaned-blocks gauge; a leak is logged with what the audit found."""
        reported = False
        while True:
            await asyncio.sleep(interval_s)
            if self.core is None:
                continue
            audit = self.core.audit()
            self.metrics.orphaned_blocks = audit.num_orphaned_blocks
            if not audit.ok and not reported:
                logger.error("KV block audit: %s", "; ".join(audit.problems[:10]))
            reported = not audit.ok

    async def GetServingInfo(self, request, context):
        if self.worker is None or self.core is None or not self.ready:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no worker is ready yet")
        return scheduler_pb2.ServingInfo(
            worker=wire.worker_info_to_pb(self.worker.info),
            num_kv_blocks=self.core.stats().num_total_blocks,
        )

    async def log_stats_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.log_stats_interval_s)
            if self.core is not None and self.core.has_unfinished_requests():
                s = self.core.stats()
                logger.info(
                    "running: %d, waiting: %d, swapped: %d, KV cache usage: %.1f%%, CPU swap usage:"
                    " %.1f%%, prefix cache hit rate: %.1f%%, preemptions: %d recompute / %d swap,"
                    " swapped-out blocks: %d, cached blocks: %d, queued: %d requests / %d tokens, refused: %d,"
                    " expired: %d",
                    s.num_running, s.num_waiting, s.num_swapped, 100 * s.kv_cache_usage,
                    100 * (1 - s.num_free_cpu_blocks / s.num_cpu_blocks) if s.num_cpu_blocks else 0.0,
                    100 * s.prefix_cache_hit_rate, s.num_preemptions_recompute, s.num_preemptions_swap,
                    s.num_swapped_out_blocks, s.num_cached_blocks, s.num_queued_requests, s.num_queued_tokens,
                    sum(s.num_refused.values()), s.num_expired,
                )
                if s.spec_num_drafts:
                    logger.info("speculative decoding: %d drafted steps, %d of %d draft tokens accepted (%.1f%%), "
                                "mean accepted length %.2f, accepted by position %s",
                                s.spec_num_drafts, s.spec_num_accepted_tokens, s.spec_num_draft_tokens,
                                100 * s.spec_acceptance_rate, s.spec_mean_accepted_length,
                                list(s.spec_accepted_per_position))

    async def drain(self) -> None:
        """SIGTERM: refuse new requests, let running ones finish for up to the shutdown
        timeout, then fail the rest (their routers answer UNAVAILABLE)."""
        self.draining = True
        await self.server.set_serving(False)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.server.shutdown_timeout
        while self._live and self.worker is not None and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self._live and self.core is not None:
            left = list(self._live)
            logger.warning("shutdown timeout: failing %d requests", len(left))
            self._dispatch(self.core.fail_requests(
                left, f"unavailable: the scheduler is shutting down (still running after the"
                      f" {self.config.server.shutdown_timeout:.0f} s shutdown timeout)", ErrorCode.UNAVAILABLE))
        await asyncio.sleep(0.1)  # Let the session writers send the last outputs.
        self.requests.close_all("scheduler shut down")

    async def shutdown(self) -> None:
        if self.core is not None:
            self._abort(list(self._live))
        if self._loop_task is not None:
            self._loop_task.cancel()
        if self.worker is not None:
            await self.worker.close()


async def serve(config: SchedulerServiceConfig, stop_event: asyncio.Event) -> None:
    setup_tracing("llmserve-scheduler")
    server = ServiceServer("llmserve.internal.v1.Scheduler", config.server.host, config.server.port, config.security,
                           max_message_bytes=config.server.max_message_bytes,
                           health_port=config.server.health_port)
    servicer = SchedulerServicer(config, server)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server.server)
    await server.start()
    stats_task = asyncio.create_task(servicer.log_stats_forever())
    audit_task = asyncio.create_task(servicer.audit_blocks_forever())
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
