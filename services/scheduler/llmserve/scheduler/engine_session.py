"""One registered worker (group) and everything that exists only because it does: the
scheduler core sized from its KV cache, the engine loop that drives it, its readiness
probe, its health watchdog and its step watchdog (step_watchdog.py).

    RegisterWorker ──▶ EngineSession(core, worker, loop) ── readiness step ran ──▶ SERVING
                              │                                   │
                              │ lost (stream broke, health checks │ halted (an error no
                              │ or a step went unanswered,        │ request can be blamed for)
                              │ replaced)                         │
                              ▼                                   ▼
                            LOST ◀──── lost later ──────────── HALTED

A session never comes back: a new registration makes a new one. LOST and HALTED keep
the core (its stats stay readable); every request still in it has failed.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable

from llmserve.contract.outputs import ErrorCode, FinishReason, RequestOutput
from llmserve.contract.plan import StepPlan, StepResult
from llmserve.contract.sampling import SamplingParams
from llmserve.contract.worker_info import WorkerInfo
from llmserve.scheduler.config import SchedulerServiceConfig, StepWatchdogConfig
from llmserve.scheduler.engine_loop import EngineHalted, EngineLoop
from llmserve.scheduler.kv_events import KvEventLog
from llmserve.scheduler.request import Request
from llmserve.scheduler.routers import RouterHub, RouterSession, owned_by_router
from llmserve.scheduler.scheduler import KVCacheShape, Scheduler
from llmserve.scheduler import step_budget
from llmserve.scheduler.step_watchdog import Stall, StepWatchdog
from llmserve.scheduler.telemetry import SchedulerTelemetry
from llmserve.scheduler.worker_link import WorkerGroup, WorkerLink, WorkerLost

logger = logging.getLogger(__name__)


# The readiness request's id (an id no router sends: routers use uuid4 hex or the client's).
READINESS_REQUEST_ID = "__llmserve_readiness__"
WORKER_HEALTH_POLL_S = 0.5


def core_for(config: SchedulerServiceConfig, info: WorkerInfo) -> Scheduler:
    """A scheduler core for a worker whose registration says `info`, its step budget
    resolved for the worker's device (logged: it decides the step sizes)."""
    cache = KVCacheShape(num_blocks=info.num_kv_blocks, block_size=info.block_size,
                         max_model_len=info.max_model_len, num_cpu_blocks=info.num_cpu_blocks,
                         sliding_window=info.sliding_window)
    scheduling, budget = step_budget.config_for(config.scheduling, info)
    how = "set by --async-scheduling" if config.scheduling.async_scheduling is not None else "by device"
    logger.info("%s; engine loop: %s (%s)", budget.describe(),
                "pipelined" if scheduling.async_scheduling else "serial", how)
    return Scheduler(scheduling, cache, eos_token_ids=info.eos_token_ids)


class EngineState(enum.Enum):
    """Where an engine session stands (the diagram above)."""

    STARTING = enum.auto()  # Registered; the readiness step has not run yet.
    SERVING = enum.auto()  # The readiness step ran.
    HALTED = enum.auto()  # The engine cannot go on (see engine_loop.py); the worker is kept.
    LOST = enum.auto()  # The worker is gone (or replaced); its link is closed.


class EngineSession:
    """A registered worker (group), the core planning for it and the loop driving both.

    Made by the servicer when a registration completes; the loop's StepObserver. Health
    turns SERVING once a readiness step has run (and the service is not draining)."""

    def __init__(self, core: Scheduler, worker: WorkerLink | WorkerGroup, server, routers: RouterHub,
                 telemetry: SchedulerTelemetry, kv_events: KvEventLog, draining: Callable[[], bool],
                 step_watchdog: StepWatchdogConfig | None = None):
        """`core` plans for `worker` (core_for(config, worker.info) builds one); `server`
        carries the health status; outputs go through `routers`; `draining()` says
        whether the service refuses new requests (then health stays NOT_SERVING);
        `step_watchdog` bounds how long a step may go unanswered (step_watchdog.py)."""
        self.core = core
        self.worker = worker
        self.state = EngineState.STARTING
        self.halted: str | None = None  # Why the engine loop stopped.
        self.server, self.routers, self.telemetry, self.kv_events = server, routers, telemetry, kv_events
        self._draining = draining
        self._work = asyncio.Event()  # Set when a request arrives or ends.
        self.loop = EngineLoop(self.core, worker, self, self._work)
        self._loop_task: asyncio.Task | None = None
        self._probe: asyncio.Future | None = None  # The readiness request's outcome.
        step_watchdog = StepWatchdogConfig() if step_watchdog is None else step_watchdog
        self.step_watchdog = StepWatchdog(step_watchdog) if step_watchdog.enabled else None
        self._step_watch: asyncio.Task | None = None

    def start(self) -> None:
        """Starts the loop, the readiness step and the watchdog."""
        self.start_loop()
        asyncio.create_task(self._prove_ready(), name="readiness-probe")
        asyncio.create_task(self._watch_worker(), name="worker-watchdog")
        if self.step_watchdog is not None:
            self._step_watch = asyncio.create_task(self.step_watchdog.watch(self._stalled), name="step-watchdog")

    def start_loop(self) -> asyncio.Task:
        """Starts the engine loop only (tests drive readiness themselves); its task."""
        self._loop_task = asyncio.create_task(self._run_loop(), name="engine-loop")
        return self._loop_task

    @property
    def lost(self) -> bool:
        return self.state is EngineState.LOST

    # --- requests --------------------------------------------------------------

    def submit(self, owner: RouterSession, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
               n: int, priority: int, deadline: float | None, cache_salt: str = "") -> Request:
        """Queues a router's request, owned by `owner`; raises as Scheduler.submit does."""
        request, displaced = self.core.submit(request_id, prompt_token_ids, sampling, n=n, priority=priority,
                                              deadline=deadline, cache_salt=cache_salt)
        request.stream.owner = owner
        self.loop.deliver(displaced)
        self._work.set()
        # A multi-step run in flight ends after its current step, so this request's prompt
        # waits for one decode step, not for the whole run.
        self.worker.interrupt()
        return request

    def abort(self, request_ids: list[str]) -> None:
        """Aborts the routers' requests among `request_ids` (others are ignored)."""
        live = [r for r in request_ids if owned_by_router(self.core, r) is not None]
        if live:
            self.loop.deliver(self.core.abort_requests(live))
            self._work.set()  # The worker must drop their state at the next step.

    def router_request_ids(self, owner: RouterSession | None = None) -> list[str]:
        """The unfinished requests routers own (only `owner`'s when given), oldest first."""
        return [r.request_id for r in self.core.unfinished_requests()
                if r.stream.owner is not None and (owner is None or r.stream.owner is owner)]

    def fail_router_requests(self, error: str) -> None:
        self.loop.deliver(self.core.fail_requests(self.router_request_ids(), error, ErrorCode.UNAVAILABLE))

    # --- StepObserver (engine_loop.py) --------------------------------------------

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Outputs to their routers (the readiness step's to its probe), then saturation
        and the cache's block events. NOTE: the session's own deliveries go through
        self.loop.deliver, which sends the outputs the loop holds first."""
        for out in outputs:
            if out.request_id == READINESS_REQUEST_ID and out.finished and self._probe is not None:
                if not self._probe.done():
                    self._probe.set_result(out.error if out.finish_reason == FinishReason.ERROR else "")
        self.routers.dispatch(self.core, outputs)
        self.routers.publish_saturation(self.core.saturated)
        # NOTE: every engine step ends here (outputs or not), and so do aborts, expiries
        # and failures: one KV event batch per step that changed the cache.
        self.publish_kv_events()

    def step_started(self, plan: StepPlan, start_ns: int):
        if self.step_watchdog is not None:
            self.step_watchdog.started(plan)
        return self.telemetry.step_started(self.core, plan, start_ns)

    def step_finished(self, plan: StepPlan, result: StepResult, span, seconds: float) -> None:
        if self.step_watchdog is not None:
            self.step_watchdog.finished(plan, result)
        self.telemetry.step_finished(self.core, plan, result, span, seconds)

    # --- KV events ----------------------------------------------------------------

    def publish_kv_events(self) -> None:
        """Sends the core's block events since the last call as one batch (if any)."""
        self.kv_events.publish(self.core.take_block_events(), self.core.cache.block_size)

    def forget_cached_blocks(self) -> None:
        """The worker's KV content is gone: the core's cache is cleared, and subscribers
        hear it (no `cleared` when nothing was cached). Events still pending go first: the
        core may be replaced next, and a pending `removed` must not be lost with it."""
        self.publish_kv_events()
        if self.core.kv.pool.num_cached_blocks:
            self.core.reset_prefix_cache()
            self.publish_kv_events()

    # --- life and death -------------------------------------------------------------

    async def _run_loop(self) -> None:
        try:
            await self.loop.run()
        except WorkerLost as err:
            logger.error("%s", err)
            await self.drop(str(err))
        except EngineHalted as err:
            await self._halt(str(err))

    async def _prove_ready(self) -> None:
        """Readiness: one 1-token request through the worker before turning SERVING, so
        SERVING means a step has run (model, KV cache and the Execute stream all work)."""
        self._probe = asyncio.get_running_loop().create_future()
        bos = self.worker.info.bos_token_id
        self.core.add_request(READINESS_REQUEST_ID, [bos if bos >= 0 else 0],
                              SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        self._work.set()
        error = await self._probe
        if self.lost:
            return  # Replaced or lost meanwhile.
        if error:
            logger.error("readiness step failed: %s", error)
            await self.drop(f"readiness step failed: {error}")
            return
        # NOTE: health before the state routers wait on (GetServingInfo): the other way
        # round, a router could connect, and turn SERVING itself, while this scheduler's
        # health still said NOT_SERVING (start-up order is worker, scheduler, router).
        if not self._draining():
            await self.server.set_serving(True)
        if self.lost:  # Dropped while health was being set: it says so again.
            await self.server.set_serving(False)
            return
        self.state = EngineState.SERVING
        logger.info("readiness step ran: serving")

    async def _watch_worker(self) -> None:
        """Notices a lost worker while idle too (a step would notice it only when one runs):
        two failed health checks in a row drop it, and health turns NOT_SERVING."""
        failures = 0
        while not self.lost:
            await asyncio.sleep(WORKER_HEALTH_POLL_S)
            if self.lost:
                return  # Dropped or replaced meanwhile (its channel is closed).
            failures = 0 if await self.worker.alive() else failures + 1
            if failures >= 2 and not self.lost:
                logger.error("worker %s stopped answering health checks", self.worker.address)
                await self.drop("it stopped answering health checks")

    async def _stalled(self, stall: Stall) -> None:
        """A step went unanswered past its bound: the worker is as good as gone (a frozen
        process keeps its connection, so nothing else would notice for a minute)."""
        if self.state not in (EngineState.STARTING, EngineState.SERVING):
            return  # Halted (its requests failed already) or dropped meanwhile.
        reason = stall.describe(self.worker.address)
        logger.error("%s; dropping it (it may register again)", reason)
        await self.drop(reason)

    async def drop(self, reason: str) -> None:
        """The worker is gone (or replaced): its requests fail, its link closes."""
        if self.lost:
            return
        self.state = EngineState.LOST  # From now on new requests are refused.
        await self.server.set_serving(False)
        if self._probe is not None and not self._probe.done():
            self._probe.set_result(f"worker lost: {reason}")
        self.loop.deliver(self.core.fail_requests(self.router_request_ids(), f"worker lost: {reason}",
                                             ErrorCode.UNAVAILABLE))
        self.forget_cached_blocks()  # The worker's KV went with it.
        for task in (self._loop_task, self._step_watch):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        await self.worker.close()

    async def close(self) -> None:
        """Shutdown: the routers' requests are aborted; the loop and the link stop."""
        self.loop.release_held()  # (outputs of requests that ended at the last step)
        self.abort(self.router_request_ids())
        for task in (self._loop_task, self._step_watch):
            if task is not None:
                task.cancel()
        if not self.lost:
            self.state = EngineState.LOST
            await self.worker.close()

    async def _halt(self, reason: str) -> None:
        """The engine cannot go on (see engine_loop.py): never a silent hang with SERVING.
        Every live request fails, new ones are refused until a worker registers again."""
        self.halted, self.state = reason, EngineState.HALTED
        if self._step_watch is not None:
            self._step_watch.cancel()  # No step runs any more: none can stall.
        logger.error("engine halted: %s; health NOT_SERVING until a worker registers again", reason)
        await self.server.set_serving(False)
        if self._probe is not None and not self._probe.done():
            self._probe.set_result(f"engine halted: {reason}")
        error = f"unavailable: the engine halted ({reason})"
        try:
            self.fail_router_requests(error)
        except Exception:  # The core is what broke: end the streams without it.
            logger.exception("failing the live requests through the scheduler failed; ending their streams")
            self._end_streams_without_core(error)

    def _end_streams_without_core(self, error: str) -> None:
        """Every router's request gets its ERROR ends straight from here, and stops being
        a router's (its record stays in the broken core, owned by nobody)."""
        for request in self.core.unfinished_requests():
            owner = request.stream.owner
            if owner is None:
                continue
            for index in range(request.n):
                owner.send(RequestOutput(request.request_id, index=index, finish_reason=FinishReason.ERROR,
                                         error_code=ErrorCode.UNAVAILABLE, error=error))
            request.stream.owner = None
