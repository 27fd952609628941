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

Before each step the requests whose deadline has passed end (Scheduler.expire): a queued
one is never scheduled, a running one stops at this step. With nothing to run, the loop
waits for work or for the next deadline, whichever comes first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from llmserve.contract.outputs import RequestOutput
from llmserve.contract.plan import StepPlan, StepResult
from llmserve.scheduler.scheduler import Scheduler
from llmserve.scheduler.worker_link import WorkerLost

logger = logging.getLogger(__name__)


class StepExecutor(Protocol):
    """A worker (or a TP x PP group of workers) that runs step plans."""

    async def execute(self, plan: StepPlan) -> StepResult: ...


class StepObserver(Protocol):
    """What the loop tells its owner, synchronously, between its awaits."""

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Outputs of a step, of expired requests or of failed ones: to their clients."""

    def step_started(self, plan: StepPlan, start_ns: int) -> object:
        """A non-empty plan is about to be sent (it may add trace contexts); its span."""

    def step_finished(self, plan: StepPlan, result: StepResult, span: object, seconds: float) -> None:
        """The plan's result was applied (and its outputs delivered)."""


class EngineHalted(RuntimeError):
    """An error no request can be blamed for: the scheduler's state cannot be trusted."""


class EngineLoop:
    """Drives one core and one worker (group) step by step; see the module docstring."""

    def __init__(self, core: Scheduler, worker: StepExecutor, observer: StepObserver, work: asyncio.Event):
        self.core, self.worker, self.observer = core, worker, observer
        self.work = work  # Set when a request arrives or ends.
        self.num_failed_steps = 0  # Steps whose requests were failed, lifetime.

    async def run(self) -> None:
        """Steps until cancelled; raises WorkerLost when the worker is lost, and
        EngineHalted (its message: why) when the engine cannot go on."""
        try:
            while True:
                if not await self._step():
                    self.work.clear()
                    await self._idle()
                # Let session readers run between steps so aborts and adds land promptly.
                await asyncio.sleep(0)
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
        """One step; False when there was nothing to run."""
        core = self.core
        if not core.has_unfinished_requests():
            return False
        start, start_ns = time.perf_counter(), time.time_ns()
        try:
            expired = core.expire(time.monotonic())
        except Exception as err:
            raise EngineHalted(f"ending requests past their deadline failed: {err}") from err
        if expired:
            self.observer.deliver(expired)
        try:
            plan = core.schedule()
        except Exception as err:
            raise EngineHalted(f"building step failed: {err}") from err
        if plan.is_empty:
            # Nothing can run until an abort or a new request changes the picture.
            return False
        span = self.observer.step_started(plan, start_ns)
        try:
            result = await self.worker.execute(plan)
        except WorkerLost:
            _end(span)
            raise
        except Exception as err:
            logger.exception("step %d could not be sent to the worker", plan.step_id)
            result = StepResult(plan.step_id, error=f"internal error: step {plan.step_id} could not be sent "
                                                    f"to the worker: {type(err).__name__}: {err}")
        self._apply(plan, result)
        self.observer.step_finished(plan, result, span, time.perf_counter() - start)
        return True

    def _apply(self, plan: StepPlan, result: StepResult) -> None:
        """Applies the result; a failure fails the plan's requests, and only them."""
        try:
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
        self.observer.deliver(outputs)


def _end(span) -> None:
    end = getattr(span, "end", None)
    if end is not None:
        end()
