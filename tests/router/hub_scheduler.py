"""A fake scheduler process whose Session stream is the real RouterHub's, for the flow
control test (test_flow_control.py): in a process of its own, as a scheduler is, so it
goes on stepping and writing while the router's event loop is busy.

    python -m tests.router.hub_scheduler '[[ids of sample 0], [ids of sample 1]]'

prints the port it serves on, then serves until killed. Each request's samples (sample
i: the i-th list) advance one token per STEP_S of wall time, however the router keeps
up (an engine does not wait for its routers); each step's outputs are queued as one
update, as RouterHub.dispatch queues them.
"""

from __future__ import annotations

import asyncio
import json
import sys

from llmserve.contract import wire
from llmserve.contract.outputs import FinishReason, RequestOutput
from llmserve.internal.v1 import scheduler_pb2
from llmserve.scheduler.routers import RouterHub, RouterSession
from llmserve.scheduler.stream_interval import OutputCoalescer

from .fake_scheduler import FakeSchedulerBase, start_fake

STEP_S = 0.002


class HubScheduler(FakeSchedulerBase):
    """Serves Session with the real RouterHub, and is its intake (add, abort, closed)."""

    def __init__(self, samples: list[list[int]]):
        self.samples = samples
        self.hub = RouterHub(OutputCoalescer(), telemetry=None)
        self._tasks: set[asyncio.Task] = set()

    async def Session(self, request_iterator, context):
        await self.hub.serve(context, self)

    def add(self, session: RouterSession, add: scheduler_pb2.AddRequest) -> None:
        task = asyncio.create_task(self._stream(session, add))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def abort(self, request_ids: list[str]) -> None:
        pass  # Every request here runs to its end.

    def closed(self, session: RouterSession) -> None:
        for task in self._tasks:
            task.cancel()

    async def _stream(self, session: RouterSession, add: scheduler_pb2.AddRequest) -> None:
        loop = asyncio.get_running_loop()
        start, steps, done = loop.time(), max(len(ids) for ids in self.samples), 0
        while done < steps:
            due = min(steps, int((loop.time() - start) / STEP_S) + 1)
            for step in range(done, due):
                session.updates.put_nowait(scheduler_pb2.SchedulerUpdate(outputs=[
                    wire.request_output_to_pb(RequestOutput(
                        add.request_id, index=index, new_token_ids=[ids[step]],
                        finish_reason=FinishReason.LENGTH if step == len(ids) - 1 else FinishReason.NONE))
                    for index, ids in enumerate(self.samples[:add.n]) if step < len(ids)]))
            done = due
            await asyncio.sleep(STEP_S)


async def main(samples: list[list[int]]) -> None:
    server, port = await start_fake(HubScheduler(samples))
    print(port, flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
