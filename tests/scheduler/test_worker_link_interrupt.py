"""An arrival while a multi-step plan is still being written interrupts that plan: the
interrupt follows the plan's write (grpc.aio writes one message at a time)."""

from __future__ import annotations

import asyncio

from llmserve.contract.plan import CachedRequestData, StepPlan
from llmserve.contract.security import SecurityOptions
from llmserve.scheduler.worker_link import WorkerLink


class SlowCall:
    """An Execute stream whose first write takes until `release` is set."""

    def __init__(self):
        self.written: list[tuple[str, int]] = []
        self.writing, self.release = asyncio.Event(), asyncio.Event()

    async def write(self, command) -> None:
        kind = command.WhichOneof("kind")
        if not self.written and not self.release.is_set():
            self.writing.set()
            await self.release.wait()
        self.written.append((kind, command.plan.step_id if kind == "plan" else command.interrupt.step_id))


def run_plan(num_steps: int, interrupt_while_writing: bool) -> list[tuple[str, int]]:
    async def run():
        link = WorkerLink("127.0.0.1:9", None, SecurityOptions(insecure=True))
        link._call = call = SlowCall()
        try:
            plan = StepPlan(7, cached_requests=[CachedRequestData(1, [], 3, 1)], num_steps=num_steps)
            sending = asyncio.ensure_future(link.send(plan))
            await call.writing.wait()  # the plan's write is under way
            if interrupt_while_writing:
                link.interrupt()  # a request arrives now
            assert call.written == []  # nothing is written beside the plan
            call.release.set()
            await sending
            await asyncio.sleep(0.01)  # the interrupt's write
            return call.written
        finally:
            await link._channel.close()

    return asyncio.run(run())


def test_an_interrupt_asked_during_a_runs_write_follows_it():
    assert run_plan(32, interrupt_while_writing=True) == [("plan", 7), ("interrupt", 7)]


def test_no_interrupt_follows_a_run_nobody_interrupted_nor_a_single_step():
    assert run_plan(32, interrupt_while_writing=False) == [("plan", 7)]
    assert run_plan(1, interrupt_while_writing=True) == [("plan", 7)]
