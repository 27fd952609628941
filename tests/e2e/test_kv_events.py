"""The scheduler's KV events and load, read over gRPC with the router's certificate (as
a cache-aware router will): a prompt's full blocks arrive as `stored` events keyed by
the shared block hash, a resumed stream replays nothing twice, and GetLoad sees a
request running while it streams."""

from __future__ import annotations

import asyncio

import pytest

from llmserve.contract.block_hash import prompt_block_hashes
from llmserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc

pytestmark = pytest.mark.slow


async def generate(cluster, token_ids: list[int], max_tokens: int) -> list[int]:
    async with cluster.client() as client:
        out = []
        async for delta in client.generate(token_ids=token_ids, max_tokens=max_tokens, temperature=0.0,
                                           ignore_eos=True):
            out += delta.token_ids
        return out


def stored_hashes(batch) -> list[bytes]:
    return [e.stored.block_hash for e in batch.events if e.WhichOneof("event") == "stored"]


async def read_until_stored(stream, wanted: set[bytes], seen: list) -> None:
    """Reads batches into `seen` until every hash of `wanted` was stored."""
    stored: set[bytes] = set()
    while not wanted <= stored:
        batch = await asyncio.wait_for(stream.read(), 60)
        assert batch is not None, "the KV event stream ended"
        seen.append(batch)
        stored.update(stored_hashes(batch))


def prompt_for(block_size: int, first_id: int) -> list[int]:
    """Two full blocks and half a block: with 2 new tokens no third block fills."""
    return list(range(first_id, first_id + 2 * block_size + block_size // 2))


async def test_a_prompts_full_blocks_are_stored_and_a_resume_replays_nothing_twice(cluster):
    async with cluster.channel("scheduler") as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        stream = stub.SubscribeKvEvents(scheduler_pb2.SubscribeKvEventsRequest(), timeout=120)
        snapshot = await asyncio.wait_for(stream.read(), 30)
        assert snapshot.snapshot and snapshot.events[0].WhichOneof("event") == "cleared"
        block_size = snapshot.block_size
        assert block_size > 0

        prompt = prompt_for(block_size, 1000)
        expected = prompt_block_hashes(prompt, block_size)
        assert len(expected) == 2
        seen: list = []
        reader = asyncio.create_task(read_until_stored(stream, set(expected), seen))
        assert len(await generate(cluster, prompt, 2)) == 2
        await reader
        stream.cancel()
        new = [h for batch in seen for h in stored_hashes(batch)]
        assert new == expected  # The prompt's full blocks, once each, parent first; nothing else.
        first_stored = next(e.stored for b in seen for e in b.events if e.WhichOneof("event") == "stored")
        assert first_stored.parent_block_hash == b"" and first_stored.num_tokens == block_size
        assert [b.sequence for b in seen] == list(range(snapshot.sequence + 1, snapshot.sequence + 1 + len(seen)))
        last = seen[-1]

        # Resume after the last batch seen: the next batch follows it, nothing is repeated.
        resumed = stub.SubscribeKvEvents(scheduler_pb2.SubscribeKvEventsRequest(
            after_sequence=last.sequence, instance_id=last.instance_id), timeout=120)
        second = prompt_for(block_size, 3000)
        later: list = []
        reader = asyncio.create_task(read_until_stored(resumed, set(prompt_block_hashes(second, block_size)), later))
        await generate(cluster, second, 2)
        await reader
        resumed.cancel()
        assert not any(b.snapshot for b in later)
        assert later[0].sequence == last.sequence + 1 and later[0].instance_id == last.instance_id
        assert not set(expected) & {h for b in later for h in stored_hashes(b)}

        # A subscriber from another instance starts over with a snapshot holding both prompts.
        fresh = stub.SubscribeKvEvents(scheduler_pb2.SubscribeKvEventsRequest(
            after_sequence=last.sequence, instance_id="0123"), timeout=30)
        again = await asyncio.wait_for(fresh.read(), 30)
        fresh.cancel()
        assert again.snapshot
        assert set(expected) | set(prompt_block_hashes(second, block_size)) <= set(stored_hashes(again))


async def test_get_load_sees_a_request_running_while_it_streams(cluster):
    async with cluster.channel("scheduler") as channel, cluster.client() as client:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        idle = await stub.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=10)
        assert idle.serving and idle.num_total_blocks > 0
        loads = []
        async for delta in client.generate(token_ids=list(range(5000, 5020)), max_tokens=64, temperature=0.0,
                                           ignore_eos=True):
            if delta.token_ids and not loads:
                loads.append(await stub.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=10))
        (busy,) = loads
        assert busy.num_running == 1 and busy.serving
        assert busy.num_free_blocks < busy.num_total_blocks and 0 < busy.kv_usage <= 1
        for _ in range(100):  # The scheduler frees the blocks just after the last token.
            done = await stub.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=10)
            if done.num_running == 0:
                break
            await asyncio.sleep(0.05)
        assert done.num_running == 0 and done.num_waiting == 0 and done.num_free_blocks == done.num_total_blocks
