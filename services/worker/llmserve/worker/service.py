"""The worker service: holds the model and its KV cache, executes step plans.

    scheduler ──StepPlan──▶ Execute stream ──▶ ModelRunner.launch, finish ──▶ StepResult ──▶ scheduler

At start-up it loads the model, sizes its KV cache from the memory budget, starts
serving, then registers with the scheduler (address + block count). It never
allocates blocks: block ids arrive in the plan.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import time
from dataclasses import dataclass

import grpc

from llmserve.contract import wire
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.worker.config import WorkerConfig
from llmserve.contract.grpc_server import SERVING, ServiceServer, channel
from llmserve.contract.heap import freeze_startup_heap
from llmserve.contract.peers import SCHEDULER, PeerCheck
from llmserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2_grpc
from llmserve.contract.plan import StepPlan, StepResult
from llmserve.contract.startup_errors import StartupError, rpc_cause
from llmserve.telemetry import WorkerMetrics, setup_metrics, setup_tracing, shutdown_metrics, shutdown_tracing
from llmserve.telemetry import step_phases, tracing

logger = logging.getLogger(__name__)

REREGISTER_POLL_S = 2.0
REGISTER_ATTEMPT_S = 5.0  # One registration call; a scheduler that answers at all answers in ms.
REGISTER_RETRY_S = 0.5  # Between attempts: the scheduler is found within this of its start.
REGISTER_REPORT_S = 5.0  # How often a worker that cannot register says so.


def new_compute_thread() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread that runs every torch computation of this worker: loading (with its
    profiling forward) and every step.

    NOTE: OpenMP (libgomp) keeps a thread team per calling thread. A second team, even an
    idle one, makes the process manage more OpenMP threads than there are cores, and
    libgomp then cuts its spin-wait short: the team's threads sleep in futex between
    parallel regions and the worker stops filling its cores. So loading and the steps
    share one thread (what the second team cost: docs/benchmarks.md, "Design measurements
    quoted from the code")."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")


def _wait_quietly(launched) -> None:
    """launched.wait(); its failure is finish's to report."""
    try:
        launched.wait()
    except Exception:  # noqa: BLE001 (raised again by the runner's finish)
        pass


@dataclass
class _Step:
    """A plan in the worker's hands, from its launch to its reply."""

    step_id: int
    start: float  # perf_counter() at its launch
    plan: StepPlan | None = None
    span: object = tracing.trace.INVALID_SPAN
    launched: object = None  # The runner's LaunchedStep (None: the launch failed)
    device_done: asyncio.Future | None = None  # Done when launched's device work is (LaunchedStep.wait)
    result: StepResult | None = None  # Set by a failed launch, a failed step before it, or the finish
    # Its own launch or finish failed (not only the step before it): the step behind it fails too.
    failed: bool = False
    # runner.finish's (result, None) or (None, error), when it ran on the compute thread
    # right after the next plan's launch (one hop for both); None: not finished yet.
    finished: tuple[StepResult | None, Exception | None] | None = None


def _fail_behind(step: _Step, behind: _Step) -> None:
    """`behind` was launched on `step`'s placeholders: it fails if `step` failed.
    NOTE: as the scheduler, which fails N+1 when the worker fails N, but not N+2 when
    N+1 failed only for that."""
    if step.failed and behind.result is None:
        behind.result = StepResult(step_id=behind.step_id, error=f"step {step.step_id} before it failed: "
                                                                  f"{step.result.error}")


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """The Worker gRPC service in front of one ModelRunner: `Execute` takes one scheduler's
    stream of step plans (and interrupts), launches and finishes each plan on the compute
    thread (the next plan launched before the last is finished where it can be) and
    streams back one StepResult per plan, in order; `Describe` says what it serves. A
    failed plan fails its step, not the worker, unless it broke a parallel group."""

    def __init__(self, runner, peers: PeerCheck, metrics: WorkerMetrics | None = None, on_fatal=None,
                 compute_thread: concurrent.futures.ThreadPoolExecutor | None = None):
        self.runner = runner
        self.peers = peers
        # Called when this rank's process group broke (a peer died, a collective timed
        # out): the group cannot step again, so the worker shuts down.
        self.on_fatal = on_fatal
        self.metrics = metrics
        # One scheduler drives a worker; a second concurrent stream would interleave plans.
        self._stream_lock = asyncio.Lock()
        # Every step runs on the thread that loaded the model (see `new_compute_thread`).
        self._compute_thread = compute_thread or new_compute_thread()
        # Waits for a launched step's device work (no torch compute, so no OpenMP team).
        self._device_waiter = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="device-wait")
        # Arrival times of the queued plans, while step phases are recorded (bench overhead).
        self._arrivals: collections.deque[float] = collections.deque()

    @property
    def driven(self) -> bool:
        """True while a scheduler's Execute stream is open."""
        return self._stream_lock.locked()

    async def Execute(self, request_iterator, context):
        await self.peers.require(context, SCHEDULER, "Execute")  # Only the scheduler drives a worker.
        if self._stream_lock.locked():
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "another scheduler stream is active")
        async with self._stream_lock:
            # A new stream means a new (or restarted) scheduler: it will resend every
            # request in full, so stale per-request state must go.
            await self._on_compute(self.runner.reset_requests)
            plans: asyncio.Queue = asyncio.Queue()
            # NOTE: commands are read while a step runs, so an interrupt reaches a
            # multi-step plan between two of its steps.
            reader = asyncio.create_task(self._read_commands(request_iterator, plans))
            try:
                async with contextlib.aclosing(self._overlapped(plans)) as results:
                    async for result in results:
                        start = time.perf_counter()
                        reply = wire.step_result_to_pb(result)
                        step_phases.add("encode", time.perf_counter() - start)
                        yield reply
            finally:
                reader.cancel()

    async def _overlapped(self, plans: asyncio.Queue):
        """Each plan's result, in plan order, with the device kept busy: once step N is
        launched, plan N+1 is launched before N is finished if it is queued, or arrives,
        before N's device work is done; otherwise N is finished when its device work is.

            plan N+1 queued:   launch N | launch N+1 | finish N, reply N | ...
            none yet:          launch N | (wait: N's device work or a plan) | finish N, reply N
            N's ids on the host already when N+1 is taken: finish N, reply N | launch N+1

        The last case is every step on the CPU, whose launch computes the forward: replying
        after N+1's launch would hold N's result a whole forward, and the scheduler could
        plan N+2 only once N+1 is done (the worker then waits a round trip every other step).
        """
        in_flight: _Step | None = None
        next_plan: asyncio.Task | None = None
        try:
            while True:
                next_plan = next_plan or asyncio.ensure_future(plans.get())
                if in_flight is not None and not next_plan.done():
                    if in_flight.device_done is not None:  # (None: its launch failed, no device work)
                        # NOTE: the wait is on a thread of its own, never the compute thread.
                        await asyncio.wait({next_plan, in_flight.device_done}, return_when=asyncio.FIRST_COMPLETED)
                    if not next_plan.done():  # N's device work is done first: reply N.
                        yield await self._finish(in_flight)
                        in_flight = None
                        continue
                plan_pb = await next_plan
                next_plan = None
                if plan_pb is None:
                    break
                replied = None
                if in_flight is not None and in_flight.launched is not None and in_flight.launched.device_done():
                    yield await self._finish(in_flight)
                    replied, in_flight = in_flight, None
                step = await self._launch(plan_pb, then_finish=in_flight)
                if replied is not None:
                    _fail_behind(replied, step)
                if in_flight is not None:
                    yield await self._finish(in_flight, behind=step)
                in_flight = step
            if in_flight is not None:
                yield await self._finish(in_flight)
        finally:
            if next_plan is not None:
                next_plan.cancel()

    async def _read_commands(self, request_iterator, plans: asyncio.Queue) -> None:
        """Queues plans in order; passes interrupts to the runner at once. None ends the queue."""
        try:
            async for command in request_iterator:
                if command.WhichOneof("kind") == "interrupt":
                    self.runner.interrupt(command.interrupt.step_id)
                elif command.WhichOneof("kind") == "plan":
                    if step_phases.enabled():
                        self._arrivals.append(time.perf_counter())
                    plans.put_nowait(command.plan)
        finally:
            plans.put_nowait(None)

    async def _on_compute(self, fn, *args):
        """fn(*args) on the compute thread. In a thread: torch releases the GIL, so health
        checks stay responsive."""
        return await asyncio.get_running_loop().run_in_executor(self._compute_thread, fn, *args)

    async def _launch(self, plan_pb, then_finish: _Step | None = None) -> _Step:
        """Decodes and launches the plan; a launch that fails fails the step (its result is
        the error). `then_finish`: the step launched before it, finished on the compute
        thread right after this launch (saving a hop there and back per step)."""
        start = time.perf_counter()
        if self._arrivals:
            # How long the plan sat behind an earlier one before its launch: not transport.
            step_phases.add("queued", max(0.0, start - self._arrivals.popleft()))
        step = _Step(plan_pb.step_id, start)
        try:
            step.plan = wire.step_plan_from_pb(plan_pb)
            step_phases.add("encode", time.perf_counter() - start)
            step.span = self._step_span(step.plan)
            step.launched = await self._on_compute(self._launch_then_finish, step.plan, then_finish)
            step.device_done = asyncio.get_running_loop().run_in_executor(self._device_waiter, _wait_quietly,
                                                                          step.launched)
        except Exception as exc:  # A bad plan or a failed forward fails the step, not the worker.
            step.result, step.failed = self._failed(step.step_id, exc), True
        return step

    def _launch_then_finish(self, plan: StepPlan, earlier: _Step | None):
        """On the compute thread: runner.launch(plan), then (launched or not) the earlier
        step's runner.finish, its outcome kept on it for _finish."""
        try:
            return self.runner.launch(plan)
        finally:
            if earlier is not None and earlier.launched is not None:
                earlier.finished = self._finish_outcome(earlier.launched)

    def _finish_outcome(self, launched) -> tuple[StepResult | None, Exception | None]:
        try:
            return self.runner.finish(launched), None
        except Exception as exc:  # Reported by _finish, on the event loop.
            return None, exc

    async def _finish(self, step: _Step, behind: _Step | None = None) -> StepResult:
        """The step's result, once its sampled ids are read back. `behind`: the step
        launched after it, on its placeholders: it fails too if this one fails."""
        if step.launched is not None:  # (read back even when a failed step before it decided the result)
            if step.finished is None:
                step.finished = await self._on_compute(self._finish_outcome, step.launched)
            result, exc = step.finished
            if exc is not None:
                result, step.failed = self._failed(step.step_id, exc), True
            step.result = step.result or result
        if behind is not None:
            _fail_behind(step, behind)
        end = time.perf_counter()
        step_phases.add("execute", end - step.start)
        if self.metrics is not None:
            self.metrics.step_time.record(end - step.start)
        if step.span.is_recording():
            self._end_spans(step.span, step.plan, step.result)
        return step.result

    def _failed(self, step_id: int, exc: Exception) -> StepResult:
        logger.exception("step %d failed", step_id, exc_info=exc)
        # NOTE: a plan is rejected (ValueError) identically on every rank, before any
        # collective; anything else may have left the ranks out of step.
        if not isinstance(exc, ValueError) and self._in_group() and self.on_fatal is not None:
            logger.error("rank %d: the parallel group is broken; stopping", self.runner.parallel.rank)
            self.on_fatal()
        return StepResult(step_id=step_id, error=f"{type(exc).__name__}: {exc}")

    @staticmethod
    def _step_span(plan):
        if not tracing.enabled():
            return tracing.trace.INVALID_SPAN
        return tracing.start_span("worker.step", parent=tracing.context_from_map(plan.trace_context) or
                                  tracing.otel_context.Context(), attributes={
            "llmserve.step_id": plan.step_id,
            "llmserve.batch_size": len(plan.new_requests) + len(plan.cached_requests),
            "llmserve.num_new_requests": len(plan.new_requests),
            "llmserve.num_scheduled_tokens": plan.total_scheduled_tokens,
        })

    @staticmethod
    def _end_spans(span, plan, result: StepResult) -> None:
        """Ends the step span and, for each request first seen here, a worker.prefill span
        in that request's own trace (same interval as the step)."""
        start_ns = span.start_time
        for r in plan.new_requests:
            if r.trace_context:
                prefill = tracing.start_span("worker.prefill", parent=tracing.context_from_map(r.trace_context),
                                             start_time=start_ns, attributes={
                    "llmserve.seq_id": r.seq_id, "llmserve.step_id": plan.step_id,
                    "llmserve.num_scheduled_tokens": r.num_scheduled_tokens,
                    "llmserve.num_computed_tokens": r.num_computed_tokens})
                prefill.end()
        span.set_attribute("llmserve.num_sampled", len(result.sampled))
        span.set_attribute("llmserve.num_steps", result.num_steps)  # Of a multi-step plan: the steps that ran.
        if result.error:
            span.set_status(tracing.trace.Status(tracing.trace.StatusCode.ERROR, result.error))
        span.end()

    def _in_group(self) -> bool:
        parallel = getattr(self.runner, "parallel", None)
        return parallel is not None and parallel.world.size > 1

    async def Describe(self, request, context):
        return wire.worker_info_to_pb(self.runner.info)


async def register_with_scheduler(config: WorkerConfig, address: str, runner) -> None:
    """Retries until the scheduler accepts the registration (it may start after us). Says
    what it tried and why it failed every few seconds, and gives up after
    --register-timeout with a StartupError."""
    parallel = runner.parallel
    request = scheduler_pb2.RegisterWorkerRequest(
        address=address, info=wire.worker_info_to_pb(runner.info),
        rank=parallel.rank, tp_size=parallel.tp.size, pp_size=parallel.pp.size,
    )
    target = config.scheduler_address
    loop = asyncio.get_running_loop()
    deadline = loop.time() + config.register_timeout_s
    next_report = loop.time()  # The first failure is reported at once.
    while True:
        # NOTE: a fresh channel per attempt and no wait_for_ready: a refused connection
        # fails at once with its reason (a reused channel waits out its reconnect backoff,
        # up to minutes, and a waiting call ends only as DEADLINE_EXCEEDED).
        async with channel(target, config.security) as to_scheduler:
            try:
                await scheduler_pb2_grpc.SchedulerStub(to_scheduler).RegisterWorker(
                    request, timeout=REGISTER_ATTEMPT_S)
                logger.info("registered with scheduler %s as %s", target, address)
                return
            except grpc.aio.AioRpcError as err:
                code, details = err.code(), err.details()
        cause = rpc_cause(code.name, details, REGISTER_ATTEMPT_S)
        fix = "is the scheduler running? --scheduler sets its address"
        if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise StartupError(f"the scheduler at {target} refused the registration: {cause}")
        left = deadline - loop.time()
        if left <= 0:
            raise StartupError(f"cannot register with scheduler at {target} after {config.register_timeout_s:.0f} s: "
                               f"{cause}", f"{fix}; --register-timeout sets how long to try")
        if loop.time() >= next_report:
            logger.warning("worker: cannot register with scheduler at %s: %s (%s); retrying for %.0f s more",
                           target, cause, fix, left)
            next_report = loop.time() + REGISTER_REPORT_S
        await asyncio.sleep(min(REGISTER_RETRY_S, left))


def load_runner(config: WorkerConfig):
    from llmserve.model_store import resolve_model_dir
    from llmserve.worker.distributed import DistInit
    from llmserve.worker.models.checkpoint import check_model_dir
    from llmserve.worker.model_runner import ModelRunner

    if config.simulated_step_ms > 0:
        return _simulated_runner(config)
    dist = None
    if config.tp_size * config.pp_size > 1:
        dist = DistInit.from_env(config.tp_size, config.pp_size, config.rank, config.dist_init, config.dist_timeout_s)

    model_dir = resolve_model_dir(config.model)
    check_model_dir(model_dir)  # A wrong directory fails in a line, before any weights load.
    return ModelRunner(model_dir, config.runner, model_name=config.served_model_name or model_dir.name, dist=dist)


def _simulated_runner(config: WorkerConfig):
    from llmserve.model_store import resolve_model_dir
    from llmserve.worker.simulated_runner import SimulatedRunner

    if config.tp_size * config.pp_size > 1:
        raise StartupError("--simulated-step-ms runs one worker process: it takes no --tp-size or --pp-size")
    model_dir = resolve_model_dir(config.model)  # Its config.json only: no weights are read.
    return SimulatedRunner(model_dir, config.runner, config.simulated_step_ms,
                           model_name=config.served_model_name or model_dir.name)


async def load_servicer(config: WorkerConfig, metrics: WorkerMetrics | None = None, on_fatal=None) -> WorkerServicer:
    """Loads the model on the compute thread that will run its steps."""
    compute_thread = new_compute_thread()
    runner = await asyncio.get_running_loop().run_in_executor(compute_thread, load_runner, config)
    peers = PeerCheck(enforce=not config.security.insecure)
    return WorkerServicer(runner, peers, metrics, on_fatal=on_fatal, compute_thread=compute_thread)


async def serve(config: WorkerConfig, stop_event: asyncio.Event) -> None:
    setup_tracing("llmserve-worker")
    step_phases.start("worker")  # Per-phase host time, only when LLMSERVE_STEP_PHASES_DIR is set.
    metrics = WorkerMetrics(setup_metrics("worker", config.server.metrics_port, config.server.host))
    # The port first: one held by another process fails in a line, not after the model loads.
    server = ServiceServer("llmserve.internal.v1.Worker", config.server.host, config.server.port, config.security,
                           max_message_bytes=config.server.max_message_bytes,
                           health_port=config.server.health_port)
    start = time.perf_counter()
    try:
        servicer = await load_servicer(config, metrics, on_fatal=stop_event.set)
    except BaseException:
        await server.stop(grace=None)  # Bound, never started: let go of the port before the error is reported.
        raise
    runner = servicer.runner
    info = runner.info
    metrics.model_name = info.model
    logger.info(
        "model %s loaded in %.1f s (%s); # KV blocks: %d of %d tokens, max_model_len %d",
        info.model, time.perf_counter() - start, info.dtype, info.num_kv_blocks,
        info.block_size, info.max_model_len,
    )
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server.server)
    await server.start()
    freeze_startup_heap()  # The model and torch's objects: out of every full collection's walk.
    address = f"{config.advertise_host}:{server.port}"
    try:
        await register_with_scheduler(config, address, runner)
        # NOT_SERVING until the model is loaded and the scheduler knows this worker.
        await server.set_serving(True)
        watchdog = asyncio.create_task(_stay_registered(config, address, runner, servicer))
        await stop_event.wait()
        watchdog.cancel()
        await _drain(server, servicer, config.server.shutdown_timeout)
    finally:
        await server.stop(grace=2.0)
        shutdown_metrics()
        shutdown_tracing()


async def _drain(server: ServiceServer, servicer: WorkerServicer, timeout_s: float) -> None:
    """SIGTERM: keep executing steps while the scheduler drains its requests (it closes the
    stream when done), up to the shutdown timeout and a little more."""
    await server.set_serving(False)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s + 5.0
    if servicer.driven:
        logger.info("waiting for the scheduler to finish its requests (up to %.0f s)", timeout_s)
    while servicer.driven and loop.time() < deadline:
        await asyncio.sleep(0.05)


async def _stay_registered(config: WorkerConfig, address: str, runner, servicer: WorkerServicer) -> None:
    """Registers again when a restarted scheduler comes back without a worker."""
    async with channel(config.scheduler_address, config.security) as to_scheduler:
        health = health_pb2_grpc.HealthStub(to_scheduler)
        while True:
            await asyncio.sleep(REREGISTER_POLL_S)
            if servicer.driven:
                continue
            try:
                reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
            except grpc.aio.AioRpcError:
                continue  # The scheduler is down; try again later.
            if reply.status != SERVING:
                logger.warning("scheduler %s has no worker; registering again", config.scheduler_address)
                try:
                    await register_with_scheduler(config, address, runner)
                except StartupError as err:
                    logger.error("%s", err)
