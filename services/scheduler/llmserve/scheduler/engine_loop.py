"""The engine loop: schedule a step, send it to the worker, apply its result; forever.

No request can stop it. A failure is pinned on the requests it concerns and the loop
goes on:

    schedule()            raises -> no request to blame: the engine halts (below)
    worker.execute(plan)  WorkerLost -> run() raises it: the engine session drops the
                          worker (all its requests fail)
                          anything else (the plan could not be encoded or sent, or the
                          reply read) -> the plan's requests fail; the loop goes on
    update_from_output()  raises -> the plan's requests fail; the loop goes on
    a failure of the failure handling itself, or of the loop's own bookkeeping
                          -> the engine halts

Halting is never silent: run() raises EngineHalted, and the engine session
(engine_session.py) logs why, turns health NOT_SERVING, fails every live request
(UNAVAILABLE) and refuses new ones until a worker registers again.

The loop reports to one narrow interface, StepObserver (outputs to deliver, a step's
start and end); how it stopped is what run() raises, not a callback.

With async_scheduling (SchedulerConfig) the loop is pipelined: it plans step N+1 while
the worker runs step N, sends it, and only then applies N's result, so the worker finds
its next plan queued when it finishes one. N's outputs are delivered once N+2 is sent,
so that between N's result and N+2's plan (the step's critical path) only the update
runs; they still go before anything else is delivered or applied.

    serial:     schedule N | run N ......... | apply N | schedule N+1 | run N+1 ...
    pipelined:  schedule N | send N | schedule N+1 | send N+1 | apply N | schedule N+2 | send N+2 | deliver N ...
                                    (worker runs N)      (worker runs N+1 ...................)

The tokens N samples are placeholders in N+1 (Sample.num_pending_tokens): the worker
computes them from its own copy. A sequence that ends at N has its N+1 token ignored
(its blocks may be freed at once: the worker runs plans in order, so N+1's write into
them comes before any later plan's use). When N+1 cannot be planned exactly without
N's tokens (Scheduler.can_schedule_ahead) the loop waits for N first: a serial step.
A failed N fails N+1 too (it was built on N's placeholders and blocks); a plan that
could not be sent is applied (failed) before anything else is planned.

Before each step the requests whose deadline has passed end (Scheduler.expire): a queued
one is never scheduled, a running one stops at this step. With nothing to run, the loop
waits for work or for the next deadline, whichever comes first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from llmserve.contract.outputs import RequestOutput
from llmserve.contract.plan import StepPlan, StepResult
from llmserve.scheduler.scheduler import Scheduler
from llmserve.scheduler.worker_link import WorkerLost
from llmserve.telemetry import step_phases

logger = logging.getLogger(__name__)


class StepExecutor(Protocol):
    """A worker (or a TP x PP group of workers) that runs step plans in the order sent."""

    async def execute(self, plan: StepPlan) -> StepResult: ...

    # A pipelined loop needs the two halves of execute as well:
    async def send(self, plan: StepPlan) -> None: ...

    async def receive(self, plan: StepPlan) -> StepResult:
        """The result of `plan`, the oldest plan sent and not answered yet."""


@dataclass
class _InFlight:
    """A plan sent (or that failed to be sent: `result` is then its error) and not applied."""

    plan: StepPlan
    span: object
    start: float  # perf_counter() when it was planned.
    result: StepResult | None = None
    after: int | None = None  # The failed step it was planned behind: it fails too.


class StepObserver(Protocol):
    """What the loop tells its owner, synchronously, between its awaits."""

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Outputs of a step, of expired requests or of failed ones: to their clients."""

    def step_started(self, plan: StepPlan, start_ns: int) -> object:
        """A non-empty plan is about to be sent (it may add trace contexts); its span."""

    def step_finished(self, plan: StepPlan, result: StepResult, span: object, seconds: float) -> None:
        """The plan's result was applied (its outputs delivered, or held: see EngineLoop)."""


class EngineHalted(RuntimeError):
    """An error no request can be blamed for: the scheduler's state cannot be trusted."""


class EngineLoop:
    """Drives one core and one worker (group) step by step; see the module docstring."""

    def __init__(self, core: Scheduler, worker: StepExecutor, observer: StepObserver, work: asyncio.Event):
        self.core, self.worker, self.observer = core, worker, observer
        self.work = work  # Set when a request arrives or ends.
        self.num_failed_steps = 0  # Steps whose requests were failed, lifetime.
        # NOTE: an executor with execute() only (a test double) gets the serial loop.
        self.pipelined = core.config.async_scheduling and callable(getattr(worker, "receive", None))
        self._in_flight: deque[_InFlight] = deque()  # Oldest first; at most two (pipelined).
        # A step's outputs applied but not delivered yet (pipelined: until the next plan is
        # sent); None when no delivery is owed. Any delivery sends them first.
        self._held: list[RequestOutput] | None = None
        # perf_counter() when the last result was read, until the next plan is built: the
        # critical path `bench overhead` reports (pipelined loop only).
        self._result_read_at: float | None = None

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Outputs to the observer, after the ones held (a request's outputs keep their
        order): the owner's own deliveries (aborts, failures) go through here too."""
        if self._held is not None:
            outputs, self._held = self._held + outputs, None
        self.observer.deliver(outputs)

    def release_held(self) -> None:
        """Delivers the held outputs, if a delivery is owed."""
        if self._held is not None:
            self.deliver([])

    async def run(self) -> None:
        """Steps until cancelled; raises WorkerLost when the worker is lost, and
        EngineHalted (its message: why) when the engine cannot go on."""
        try:
            while True:
                if not await self._step():
                    self.work.clear()
                    await self._idle()
                elif not self.pipelined:
                    # Let session readers run between steps so aborts and adds land promptly.
                    await asyncio.sleep(0)
                # NOTE: pipelined, the next plan is built at once: the outputs just delivered
                # are written to their routers (and readers run) while it is being sent, not
                # between the result and the next plan (off the critical path).
        except (asyncio.CancelledError, WorkerLost):
            raise
        except Exception as err:  # EngineHalted, or a bug in the loop itself.
            logger.exception("the engine loop cannot go on")
            raise EngineHalted(f"{type(err).__name__}: {err}") from err

    async def _idle(self) -> None:
        """Waits until work arrives or the earliest deadline passes (a queued request
        must end then even if nothing else happens)."""
        deadline = self.core.next_deadline()
        if deadline is None:
            await self.work.wait()
            return
        try:
            await asyncio.wait_for(self.work.wait(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            pass

    async def _step(self) -> bool:
        """One step; False when there was nothing to run (and nothing is in flight)."""
        if not self.pipelined:
            return await self._serial_step()
        if self._in_flight and not self.core.can_schedule_ahead(self._in_flight[-1].plan):
            await self._finish_oldest()  # A serial step: N+1 needs N's real tokens.
        plan, span, start = self._plan()
        self._count_critical(plan is not None)
        if plan is None:
            self.release_held()
            if not self._in_flight:
                return False
            await self._finish_oldest()
            return True
        entry = _InFlight(plan, span, start)
        self._in_flight.append(entry)
        entry.result = await self._send(plan)
        self.release_held()  # The previous step's outputs: this plan is on its way.
        if entry.result is not None:
            # Unsent: the worker never saw it, so nothing may be planned on top of it.
            while self._in_flight:
                await self._finish_oldest()
        elif len(self._in_flight) > 1:
            # NOTE: N+1 is sent first: applying N overlaps N+1, and N's outputs are held
            # until N+2 is sent (the next _step).
            await self._finish_oldest(hold=True)
        return True

    def _count_critical(self, planned: bool) -> None:
        """`bench overhead`'s critical path: from the last result read to the next plan
        built (its encode and write follow; nothing when no plan followed)."""
        if self._result_read_at is not None:
            if planned:
                step_phases.add("critical", time.perf_counter() - self._result_read_at)
                step_phases.add("critical_steps", 1)
            self._result_read_at = None

    def _plan(self) -> tuple[StepPlan | None, object, float]:
        """Ends expired requests and builds the next plan: (None, ...) when there is
        nothing to send; else the plan, its span (step_started) and its start time."""
        core = self.core
        if not core.has_unfinished_requests():
            return None, None, 0.0
        start, start_ns = time.perf_counter(), time.time_ns()
        try:
            with step_phases.timed("schedule"):
                expired = core.expire(time.monotonic())
        except Exception as err:
            raise EngineHalted(f"ending requests past their deadline failed: {err}") from err
        if expired:
            self.deliver(expired)
        try:
            with step_phases.timed("schedule"):
                plan = core.schedule()
        except Exception as err:
            raise EngineHalted(f"building step failed: {err}") from err
        if plan.is_empty:
            # Nothing can run until an abort or a new request changes the picture.
            return None, None, 0.0
        step_phases.add("plans", 1)
        return plan, self.observer.step_started(plan, start_ns), start

    async def _send(self, plan: StepPlan) -> StepResult | None:
        """Sends the plan; None when sent, else the error result to apply for it."""
        try:
            await self.worker.send(plan)
        except WorkerLost:
            self._end_spans()
            raise
        except Exception as err:
            logger.exception("step %d could not be sent to the worker", plan.step_id)
            return _unsent(plan, err)
        return None

    async def _finish_oldest(self, hold: bool = False) -> None:
        """Waits for the oldest plan in flight's result, applies it and delivers its
        outputs (`hold`: keeps them for the next delivery)."""
        entry = self._in_flight[0]
        if entry.result is None:
            try:
                entry.result = await self.worker.receive(entry.plan)
            except WorkerLost:
                self._end_spans()
                raise
            except Exception as err:
                logger.exception("step %d's result could not be read", entry.plan.step_id)
                entry.result = StepResult(entry.plan.step_id, error=f"internal error: step {entry.plan.step_id}'s "
                                                                    f"result could not be read: {err}")
            if step_phases.enabled():
                self._result_read_at = time.perf_counter()
        self._in_flight.popleft()
        if entry.result.error:
            # The plan behind it was built as if this one ran (its rows compute the
            # placeholders, it may read blocks this one wrote): it fails too, as the worker
            # would find its rows inconsistent anyway.
            for later in self._in_flight:
                if later.after is None:
                    later.after = entry.plan.step_id
        if entry.after is not None and not entry.result.error:
            entry.result = StepResult(entry.plan.step_id, error=f"internal error: step {entry.plan.step_id} "
                                                                f"followed step {entry.after}, which failed")
        self._apply(entry.plan, entry.result, hold)
        self.observer.step_finished(entry.plan, entry.result, entry.span, time.perf_counter() - entry.start)

    def _end_spans(self) -> None:
        """The worker is lost: the plans in flight end with it."""
        for entry in self._in_flight:
            _end(entry.span)

    async def _serial_step(self) -> bool:
        """One step of the serial loop; False when there was nothing to run."""
        plan, span, start = self._plan()
        if plan is None:
            return False
        try:
            result = await self.worker.execute(plan)
        except WorkerLost:
            _end(span)
            raise
        except Exception as err:
            logger.exception("step %d could not be sent to the worker", plan.step_id)
            result = _unsent(plan, err)
        self._apply(plan, result)
        self.observer.step_finished(plan, result, span, time.perf_counter() - start)
        return True

    def _apply(self, plan: StepPlan, result: StepResult, hold: bool = False) -> None:
        """Applies the result and delivers its outputs (`hold`: holds them); a failure
        fails the plan's requests, and only them."""
        # NOTE: the held outputs go first: what their delivery does (an abort on a client's
        # word) must land before this result is applied, as in the serial loop.
        self.release_held()
        try:
            with step_phases.timed("update"):
                outputs = self.core.update_from_output(plan, result)
        except Exception as err:
            logger.exception("applying step %d failed", plan.step_id)
            try:
                outputs = self.core.fail_step(plan, f"internal scheduler error: {type(err).__name__}: {err}")
            except Exception as fail_err:
                raise EngineHalted(f"failing the requests of step {plan.step_id} failed: {fail_err}") from fail_err
        if result.error:
            self.num_failed_steps += 1
            logger.error("step %d failed: %s", plan.step_id, result.error)
        if hold:
            self._held = outputs  # (none held: released above)
        else:
            self.deliver(outputs)


def _end(span) -> None:
    end = getattr(span, "end", None)
    if end is not None:
        end()


def _unsent(plan: StepPlan, err: Exception) -> StepResult:
    return StepResult(plan.step_id, error=f"internal error: step {plan.step_id} could not be sent "
                                          f"to the worker: {type(err).__name__}: {err}")
