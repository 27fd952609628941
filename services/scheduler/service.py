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
from dataclasses import dataclass

import grpc

from llmserve import wire
from llmserve.grpc_server import ServiceServer
from llmserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from llmserve.outputs import FinishReason, RequestOutput
from llmserve.scheduler.scheduler import Scheduler, SchedulerConfig
from llmserve.scheduler.worker_link import WorkerLink, WorkerLost

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerServiceConfig:
    host: str = "0.0.0.0"
    port: int = 50052
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    preemption_mode: str = "auto"  # swap | recompute | auto
    log_stats_interval_s: float = 10.0


class RouterSession:
    """One router's stream: outputs of its requests are queued here for writing."""

    _ids = itertools.count()

    def __init__(self):
        self.id = next(self._ids)
        self.updates: asyncio.Queue[scheduler_pb2.SchedulerUpdate | None] = asyncio.Queue()
        self.request_ids: set[str] = set()


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, config: SchedulerServiceConfig, server: ServiceServer):
        self.config = config
        self.server = server
        self.core: Scheduler | None = None
        self.worker: WorkerLink | None = None
        self._owners: dict[str, RouterSession] = {}
        self._work = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._num_worker_failures = 0

    # --- worker registration -------------------------------------------------

    async def RegisterWorker(self, request, context):
        info = wire.worker_info_from_pb(request.info)
        if self.worker is not None:
            # A restarted worker replaces the old one; requests on the old one are lost.
            await self._drop_worker("replaced by a new registration")
        core_config = SchedulerConfig(
            block_size=info.block_size,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_model_len=info.max_model_len,
            enable_chunked_prefill=self.config.enable_chunked_prefill,
            enable_prefix_caching=self.config.enable_prefix_caching,
            preemption_mode=self.config.preemption_mode,
        )
        self.core = Scheduler(core_config, num_blocks=info.num_kv_blocks, eos_token_ids=info.eos_token_ids,
                              num_cpu_blocks=info.num_cpu_blocks)
        self.worker = WorkerLink(request.address, info)
        self._loop_task = asyncio.create_task(self._engine_loop(), name="engine-loop")
        await self.server.set_serving(True)
        logger.info(
            "worker %s registered: %s, %d KV blocks of %d tokens (%d tokens), %d CPU swap blocks,"
            " max_model_len %d", request.address, info.model, info.num_kv_blocks, info.block_size,
            info.num_kv_blocks * info.block_size, info.num_cpu_blocks, info.max_model_len,
        )
        return scheduler_pb2.RegisterWorkerResponse()

    async def _drop_worker(self, reason: str) -> None:
        await self.server.set_serving(False)
        if self.core is not None:
            ids = [r for r in self._owners]
            self._dispatch(self.core.fail_requests(ids, f"worker lost: {reason}"))
        if self._loop_task is not None and self._loop_task is not asyncio.current_task():
            self._loop_task.cancel()
        if self.worker is not None:
            await self.worker.close()
        self.worker = None
        self._loop_task = None

    # --- router sessions -----------------------------------------------------

    async def Session(self, request_iterator, context):
        session = RouterSession()
        reader = asyncio.create_task(self._read_router(session, context))
        try:
            while True:
                update = await session.updates.get()
                if update is None:
                    break
                await context.write(update)
        finally:
            reader.cancel()
            # The router is gone (or its stream broke): nobody can receive these outputs.
            self._abort(list(session.request_ids))

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
        if self.core is None or self.worker is None:
            self._send(session, RequestOutput(request_id, finish_reason=FinishReason.ERROR,
                                              error="no worker is registered"))
            return
        if request_id in self._owners:
            self._send(session, RequestOutput(request_id, finish_reason=FinishReason.ERROR,
                                              error=f"request id {request_id!r} is already running"))
            return
        try:
            self.core.add_request(request_id, list(add.prompt_token_ids), wire.sampling_from_pb(add.sampling),
                                  n=add.n or 1, priority=add.priority)
        except ValueError as err:
            self._send(session, RequestOutput(request_id, finish_reason=FinishReason.ERROR, error=str(err)))
            return
        self._owners[request_id] = session
        session.request_ids.add(request_id)
        self._work.set()

    def _abort(self, request_ids: list[str]) -> None:
        if self.core is None:
            return
        live = [r for r in request_ids if r in self._owners]
        if live:
            self._dispatch(self.core.abort_requests(live))
            self._work.set()  # The worker must drop their state at the next step.

    def _send(self, session: RouterSession, output: RequestOutput) -> None:
        session.updates.put_nowait(scheduler_pb2.SchedulerUpdate(outputs=[wire.request_output_to_pb(output)]))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Groups a step's outputs by owning router, one update message per router."""
        per_session: dict[int, tuple[RouterSession, list]] = {}
        ended: list[str] = []
        for out in outputs:
            session = self._owners.get(out.request_id)
            if session is None:
                continue
            per_session.setdefault(session.id, (session, []))[1].append(wire.request_output_to_pb(out))
            if out.finished:
                ended.append(out.request_id)
        # NOTE: after the loop: several samples of one request may end in one step.
        for request_id in ended:
            if request_id in self._owners and (self.core is None or self.core.get_group(request_id) is None):
                self._owners.pop(request_id).request_ids.discard(request_id)
        for session, pbs in per_session.values():
            session.updates.put_nowait(scheduler_pb2.SchedulerUpdate(outputs=pbs))

    # --- the engine loop -----------------------------------------------------

    async def _engine_loop(self) -> None:
        core, worker = self.core, self.worker
        while True:
            if not core.has_unfinished_requests():
                self._work.clear()
                await self._work.wait()
                continue
            plan = core.schedule()
            if plan.is_empty:
                # Nothing can run until an abort or a new request changes the picture.
                self._work.clear()
                await self._work.wait()
                continue
            try:
                result = await worker.execute(plan)
            except WorkerLost as err:
                logger.error("%s", err)
                self._num_worker_failures += 1
                await self._drop_worker(str(err))
                return
            try:
                self._dispatch(core.update_from_output(plan, result))
            except Exception as err:  # A bug must fail the step's requests, not hang them.
                logger.exception("applying step %d failed", plan.step_id)
                ids = [r.request_id for r in plan.new_requests + plan.cached_requests]
                self._dispatch(core.fail_requests(ids, f"internal scheduler error: {err}"))
            if result.error:
                logger.error("step %d failed on the worker: %s", plan.step_id, result.error)
            # Let session readers run between steps so aborts and adds land promptly.
            await asyncio.sleep(0)

    # --- introspection -------------------------------------------------------

    async def GetStats(self, request, context):
        if self.core is None:
            return scheduler_pb2.SchedulerStats(worker_ready=False)
        return wire.scheduler_stats_to_pb(self.core.stats(), worker_ready=self.worker is not None)

    async def GetServingInfo(self, request, context):
        if self.worker is None or self.core is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no worker is registered yet")
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
                    " swapped-out blocks: %d, cached blocks: %d",
                    s.num_running, s.num_waiting, s.num_swapped, 100 * s.kv_cache_usage,
                    100 * (1 - s.num_free_cpu_blocks / s.num_cpu_blocks) if s.num_cpu_blocks else 0.0,
                    100 * s.prefix_cache_hit_rate, s.num_preemptions_recompute, s.num_preemptions_swap,
                    s.num_swapped_out_blocks, s.num_cached_blocks,
                )

    async def shutdown(self) -> None:
        if self.core is not None:
            self._abort(list(self._owners))
        if self._loop_task is not None:
            self._loop_task.cancel()
        if self.worker is not None:
            await self.worker.close()


async def serve(config: SchedulerServiceConfig, stop_event: asyncio.Event) -> None:
    server = ServiceServer("llmserve.internal.v1.Scheduler", config.host, config.port)
    servicer = SchedulerServicer(config, server)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server.server)
    await server.start()
    stats_task = asyncio.create_task(servicer.log_stats_forever())
    try:
        await stop_event.wait()
    finally:
        stats_task.cancel()
        await servicer.shutdown()
        await server.stop(grace=2.0)
