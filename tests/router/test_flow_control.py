"""A router that falls behind its scheduler reads fewer, larger updates: the real router
(Generation, SchedulerLink) over gRPC to a scheduler process whose Session stream is the
real RouterHub's (hub_scheduler.py), its requests stepped by the wall clock as an engine
steps them. A router whose event loop is kept busy (its consumer blocks it) must get
merged deltas that say what a fast router's say, in fewer messages: without credits the
scheduler writes every step into the transport and the router reads them one by one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path

from llmserve.internal.v1 import scheduler_pb2
from llmserve.router.generation import Generation
from llmserve.router.scheduler_link import Acknowledger
from llmserve.v1 import generation_pb2 as pb

from .fake_scheduler import generation_at
from .hub_scheduler import STEP_S
from .test_coalescing import joined

TEXTS = ["A router that falls behind gets its tokens merged, never lost or reordered: déjà vu 🙂 and "
         "numbers 12345, then more words, one after another, until the end of this sample.",
         "The second sample says something else entirely, with émojis 🎉 and punctuation; it is shorter."]
REPO = Path(__file__).resolve().parents[2]


@contextlib.asynccontextmanager
async def hub_scheduler(samples: list[list[int]]):
    """The port of a hub_scheduler process streaming `samples`."""
    process = await asyncio.create_subprocess_exec(sys.executable, "-m", "tests.router.hub_scheduler",
                                                   json.dumps(samples), cwd=REPO, stdout=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(30):
            port = int(await process.stdout.readline())
        yield port
    finally:
        process.kill()
        await process.wait()


async def consume(generation: Generation, request_id: str, block_s: float):
    """Every Output of one request; after each, the router's event loop is blocked for
    `block_s` (a router short of CPU: its reader cannot run either)."""
    req = pb.GenerateRequest(request_id=request_id, model="m", token_ids=pb.TokenIds(ids=[5, 6, 7, 8]),
                             params=pb.SamplingParams(max_tokens=200, temperature=0.0, n=2))
    outputs = []
    async for out in generation.generate(req):
        outputs.append(out)
        time.sleep(block_s)
    return outputs


async def test_a_lagging_router_gets_merged_updates_and_sends_fewer_messages(smollm2):
    samples = [smollm2.encode_text(text, False) for text in TEXTS]
    async with hub_scheduler(samples) as port, generation_at(port, smollm2) as generation:
        fast = await consume(generation, "fast", block_s=0)
        slow = await consume(generation, "slow", block_s=8 * STEP_S)
    for index in range(2):  # The merged deltas say what the fast ones say ...
        assert joined(slow, index) == joined(fast, index)
        assert joined(fast, index)["text"] == TEXTS[index]
    assert len(slow) < len(fast) / 2  # ... in fewer messages.


async def test_acknowledgements_answer_the_updates_that_ask_one_write_at_a_time():
    written: list[int] = []
    release = asyncio.Event()

    async def write(message: scheduler_pb2.RouterMessage) -> None:
        written.append(message.consumed)
        await release.wait()  # A slow write: the reader goes on meanwhile.

    acks = Acknowledger(write)
    for asks in (False, False, True):
        acks.read_one(asks)
    await asyncio.sleep(0)
    assert written == [3]  # Asked on the third: the count of all three.
    for asks in (True, False, True, False):  # Read while that write is in flight.
        acks.read_one(asks)
    await asyncio.sleep(0)
    assert written == [3]
    release.set()
    for _ in range(5):
        await asyncio.sleep(0)
    assert written == [3, 7]  # One more write, with the latest count.
    acks.read_one(False)
    await asyncio.sleep(0)
    assert written == [3, 7]
