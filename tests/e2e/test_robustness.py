"""Issue 17, findings 1 and 2, through the public API of a live cluster: no request can
stop the engine, and client ids cannot collide with the scheduler's sequence ids."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest

from llmserve.client import GenerationError

from .stats import block_audit, scheduler_stats, wait_all_blocks_free

INT64_MAX = 2**63 - 1


async def finishes(client, request_id: str, n: int = 1, **kwargs) -> dict[int, str]:
    """Each sample's finish reason."""
    ends = {}
    async for delta in client.generate("Hello there", request_id=request_id, n=n, **kwargs):
        if delta.finish_reason:
            ends[delta.index] = delta.finish_reason
    return ends


@pytest.mark.slow
async def test_the_largest_seed_with_two_samples_does_not_stop_the_engine(cluster):
    """Finding 1: sample 1's seed was 2**63 (out of int64): the engine loop died, every
    request hung and health still said SERVING."""
    async with cluster.client(timeout=60) as client:
        ends = await finishes(client, f"seed-{uuid.uuid4().hex}", n=2, max_tokens=8, temperature=1.0,
                              seed=INT64_MAX)
        assert sorted(ends) == [0, 1] and set(ends.values()) <= {"stop", "length"}
        # The engine still runs requests, and says so.
        assert await client.complete("The capital of France is", max_tokens=4, temperature=0.0)
        assert await client.health() == "SERVING"
    await wait_all_blocks_free(cluster)


@pytest.mark.slow
@pytest.mark.parametrize("first", ["suffixed", "plain"])
async def test_client_ids_that_look_like_sample_ids_do_not_collide(cluster, first):
    """Finding 2: running `x#0` and then `x` with n = 2 (or the reverse) gave INTERNAL to
    unrelated requests and left `x` holding its blocks forever."""
    x = f"x-{uuid.uuid4().hex}"
    kinds = {"suffixed": dict(request_id=f"{x}#0", n=1), "plain": dict(request_id=x, n=2)}
    order = [first, "plain" if first == "suffixed" else "suffixed"]
    async with cluster.client(timeout=60) as client:
        running = asyncio.create_task(finishes(client, max_tokens=48, ignore_eos=True, temperature=0.0,
                                               **kinds[order[0]]))
        await asyncio.sleep(0.3)  # The first is running.
        second = await finishes(client, max_tokens=8, temperature=0.0, **kinds[order[1]])
        first_ends = await running
    for ends, kind in ((first_ends, order[0]), (second, order[1])):
        assert sorted(ends) == list(range(kinds[kind]["n"])) and set(ends.values()) <= {"stop", "length"}, (kind, ends)
    await wait_all_blocks_free(cluster)


@pytest.mark.slow
async def test_block_audit_over_the_api_finds_no_leak_after_aborts_and_errors(cluster):
    """The ledger the scheduler serves: held blocks name their live requests, and after a
    mix of finished, cancelled and refused requests nothing is orphaned."""
    async with cluster.client(timeout=60) as client:
        long = asyncio.create_task(finishes(client, f"held-{uuid.uuid4().hex}", n=2, max_tokens=200,
                                            ignore_eos=True, temperature=0.0))
        for _ in range(100):  # Until its samples hold blocks.
            audit = await block_audit(cluster)
            if audit.gpu_blocks:
                break
            await asyncio.sleep(0.05)
        holders = {(h.request_id.split("-")[0], h.index) for b in audit.gpu_blocks for h in b.holders}
        assert holders and holders <= {("held", 0), ("held", 1)} and not audit.problems
        long.cancel()
        await asyncio.gather(long, return_exceptions=True)
        with pytest.raises((grpc.aio.AioRpcError, GenerationError)):
            await finishes(client, f"bad-{uuid.uuid4().hex}", max_tokens=10_000)
    await wait_all_blocks_free(cluster)
    audit = await block_audit(cluster)
    assert (list(audit.gpu_blocks), list(audit.problems), list(audit.orphaned_gpu_blocks)) == ([], [], [])
    assert audit.num_free_blocks == audit.num_total_blocks
    assert (await scheduler_stats(cluster)).num_orphaned_blocks == 0
