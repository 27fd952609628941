"""Flow control on a router's Session stream (routers.py): once a router acknowledges
what it has read, at most CREDITS updates are unacknowledged; the rest wait and go out
merged into one when a credit returns. A router that never acknowledges is not throttled."""

from __future__ import annotations

import asyncio

import grpc

from llmserve.contract import wire
from llmserve.contract.outputs import FinishReason, RequestOutput
from llmserve.internal.v1 import scheduler_pb2
from llmserve.scheduler.routers import CREDITS, RouterHub, RouterSession
from llmserve.scheduler.stream_interval import OutputCoalescer


class Intake:
    """The servicer's side of RouterHub.serve: it only needs to hear of the stream's end."""

    def __init__(self):
        self.closed_sessions: list[RouterSession] = []

    def closed(self, session: RouterSession) -> None:
        self.closed_sessions.append(session)


class RouterEnd:
    """The router's end of one Session stream (the `context` RouterHub.serve reads and
    writes): what it sends, and every update written to it."""

    def __init__(self, hub: RouterHub):
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.updates: list[scheduler_pb2.SchedulerUpdate] = []
        self.intake = Intake()
        self.task = asyncio.create_task(hub.serve(self, self.intake))

    async def read(self):
        return await self.inbox.get()

    async def write(self, update) -> None:
        self.updates.append(update)

    def acknowledge(self) -> None:
        """Says it has read every update written to it so far."""
        self.inbox.put_nowait(scheduler_pb2.RouterMessage(consumed=len(self.updates)))


def output(request_id: str, token_id: int, finish=FinishReason.NONE) -> scheduler_pb2.RequestOutput:
    return wire.request_output_to_pb(RequestOutput(request_id, new_token_ids=[token_id], finish_reason=finish))


def step(*outputs: scheduler_pb2.RequestOutput, saturated: bool | None = None) -> scheduler_pb2.SchedulerUpdate:
    return scheduler_pb2.SchedulerUpdate(outputs=outputs, saturated=saturated)


async def settle() -> None:
    """Lets the serving task write whatever it may."""
    for _ in range(20):
        await asyncio.sleep(0)


async def opened(hub: RouterHub) -> tuple[RouterEnd, RouterSession]:
    """A router's stream, past its first update (the saturation at opening)."""
    router = RouterEnd(hub)
    await settle()
    [session] = hub.sessions
    assert len(router.updates) == 1 and router.updates[0].HasField("saturated")
    return router, session


async def test_updates_beyond_the_credits_wait_and_go_out_merged_when_a_credit_returns():
    hub = RouterHub(OutputCoalescer(), telemetry=None)
    router, session = await opened(hub)
    router.acknowledge()
    await settle()
    within = [step(output("a", t), output("b", t)) for t in range(CREDITS)]
    waiting = [step(output("a", 10), saturated=True), step(output("b", 10)),
               step(output("a", 11, FinishReason.LENGTH), saturated=False), step(output("b", 11))]
    for update in within + waiting:
        session.updates.put_nowait(scheduler_pb2.SchedulerUpdate.FromString(update.SerializeToString()))
        await settle()
    sent = router.updates[1:]
    assert [list(u.outputs) for u in sent] == [list(u.outputs) for u in within]  # The rest waits.
    # Each asks for an acknowledgement once half the credits are spent.
    assert [u.acknowledge for u in sent] == [i + 1 >= CREDITS // 2 for i in range(CREDITS)]

    router.acknowledge()  # The credits return: the four waiting go out as one.
    await settle()
    assert len(router.updates) == 1 + CREDITS + 1
    merged = router.updates[-1]
    assert list(merged.outputs) == [o for update in waiting for o in update.outputs]
    assert merged.HasField("saturated") and merged.saturated is False  # The last one set wins.

    session.updates.put_nowait(step(output("b", 12)))  # A credit is free: written at once.
    await settle()
    assert list(router.updates[-1].outputs) == [output("b", 12)]

    router.inbox.put_nowait(grpc.aio.EOF)
    await asyncio.wait_for(router.task, 5)
    assert router.intake.closed_sessions == [session] and not hub.sessions


async def test_a_router_that_never_acknowledges_is_not_throttled():
    hub = RouterHub(OutputCoalescer(), telemetry=None)
    router, session = await opened(hub)
    for token in range(4 * CREDITS):
        session.updates.put_nowait(step(output("a", token)))
        await settle()
    assert [list(u.outputs) for u in router.updates[1:]] == [[output("a", t)] for t in range(4 * CREDITS)]
    router.inbox.put_nowait(grpc.aio.EOF)
    await asyncio.wait_for(router.task, 5)


async def test_the_stream_ends_with_what_waited_for_a_credit():
    """The router's side ends while updates wait: they are written, then the stream ends."""
    hub = RouterHub(OutputCoalescer(), telemetry=None)
    router, session = await opened(hub)
    router.acknowledge()
    await settle()
    for token in range(CREDITS + 3):
        session.updates.put_nowait(step(output("a", token)))
        await settle()
    assert len(router.updates) == 1 + CREDITS
    router.inbox.put_nowait(grpc.aio.EOF)
    await asyncio.wait_for(router.task, 5)
    assert [o.new_token_ids[0] for u in router.updates for o in u.outputs] == list(range(CREDITS + 3))
    assert len(router.updates) == 1 + CREDITS + 1
