"""The scheduler's share of the per-step phases `llmserve bench overhead` reports
(llmserve.telemetry.step_phases), recorded only when LLMSERVE_STEP_PHASES_DIR is set.

It times the calls the engine loop makes, wherever the loop makes them (the serial loop
and the pipelined one call the same methods), so the loop itself carries no timing code:

    schedule   Scheduler.expire + Scheduler.schedule (building the plan)
    encode     wire.plan_command_to_pb (plan -> protobuf) + wire.step_result_from_pb
    round_trip WorkerLink.send + .receive: from writing a plan to its decoded result
               (WorkerLink.execute where there is no send / receive)
    update     Scheduler.update_from_output (applying the result)
    dispatch   RouterHub.dispatch (outputs onto their routers' streams)
"""

from __future__ import annotations

import functools
import inspect
import time

from llmserve.contract import wire
from llmserve.telemetry import step_phases

_installed = False


def install() -> bool:
    """Wraps the timed calls once per process when recording is on; True if on."""
    global _installed
    if not step_phases.start("scheduler") or _installed:
        return step_phases.enabled()
    from llmserve.scheduler.routers import RouterHub
    from llmserve.scheduler.scheduler import Scheduler
    from llmserve.scheduler.worker_link import WorkerLink

    _wrap(Scheduler, "expire", "schedule")
    _wrap(Scheduler, "schedule", "schedule", count="plans")
    _wrap(Scheduler, "update_from_output", "update")
    _wrap(RouterHub, "dispatch", "dispatch")
    _wrap(wire, "plan_command_to_pb", "encode")
    _wrap(wire, "step_result_from_pb", "encode")
    if hasattr(WorkerLink, "send") and hasattr(WorkerLink, "receive"):
        _time_round_trips(WorkerLink)  # Plans may overlap (the pipelined loop): per plan.
    else:
        _wrap(WorkerLink, "execute", "round_trip", count="round_trips")
    _installed = True
    return True


def _time_round_trips(link_class) -> None:
    """round_trip: from the start of a plan's send to the end of its result's receive,
    whatever else the loop did in between (with two plans in flight, a reply may wait
    for the scheduler to come back to it: that wait is in the round trip)."""
    sent: dict[int, float] = {}
    send, receive = link_class.send, link_class.receive

    @functools.wraps(send)
    async def timed_send(self, plan, *args, **kwargs):
        sent[plan.step_id] = time.perf_counter()
        return await send(self, plan, *args, **kwargs)

    @functools.wraps(receive)
    async def timed_receive(self, plan, *args, **kwargs):
        try:
            return await receive(self, plan, *args, **kwargs)
        finally:
            start = sent.pop(plan.step_id, None)
            if start is not None:
                step_phases.add("round_trip", time.perf_counter() - start)
                step_phases.add("round_trips", 1)

    link_class.send, link_class.receive = timed_send, timed_receive


def _wrap(owner, name: str, phase: str, count: str | None = None) -> None:
    original = getattr(owner, name)
    if inspect.iscoroutinefunction(original):
        @functools.wraps(original)
        async def timed_async(*args, **kwargs):
            start = time.perf_counter()
            try:
                return await original(*args, **kwargs)
            finally:
                step_phases.add(phase, time.perf_counter() - start)
                if count:
                    step_phases.add(count, 1)
        setattr(owner, name, timed_async)
        return

    @functools.wraps(original)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            step_phases.add(phase, time.perf_counter() - start)
            if count:
                step_phases.add(count, 1)
    setattr(owner, name, timed)
