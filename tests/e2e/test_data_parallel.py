"""Two data-parallel replicas behind one router, as real processes: cache-aware routing
follows the prefix caches (seen through each request's cached_tokens), load spreads
when there is no shared prefix, and a replica whose worker is killed mid-stream hands
its requests to the other one without a token lost or repeated; it rejoins once its
worker is back."""

from __future__ import annotations

import asyncio
import random
import signal

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.launcher.cluster import ClusterSpec, LocalCluster, free_port

from .stats import block_audit, scheduler_stats, wait_all_blocks_free

pytestmark = pytest.mark.slow
BLOCK = 16  # The worker's default block size.


@pytest.fixture(scope="module")
def dp_cluster(model_dir, tmp_path_factory):
    spec = ClusterSpec(model_dir=model_dir, router_port=free_port(), scheduler_port=free_port(),
                       worker_port=free_port(), dp_size=2, replica_ports=[(free_port(), free_port())],
                       worker_args=["--dtype", "float32", "--kv-cache-memory", "128MiB"],
                       log_dir=tmp_path_factory.mktemp("dp-logs"))
    cluster = LocalCluster(spec).start(timeout_s=300)
    yield cluster
    cluster.stop()


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40_000) for _ in range(n)]


async def run(client, token_ids, max_tokens=4, **kwargs) -> tuple[list[int], dict]:
    ids, usage = [], None
    async for delta in client.generate(token_ids=token_ids, max_tokens=max_tokens, temperature=0.0,
                                       ignore_eos=True, **kwargs):
        ids += delta.token_ids
        usage = delta.usage or usage
    return ids, usage


async def replica_prompt_tokens(cluster: LocalCluster) -> list[int]:
    return [(await scheduler_stats(cluster, r)).prompt_tokens_total for r in range(2)]


async def test_requests_sharing_a_prefix_follow_its_cache(dp_cluster):
    rng = random.Random(1)
    prefixes = [random_ids(rng, 4 * BLOCK) for _ in range(2)]
    async with dp_cluster.client() as client:
        for prefix in prefixes:
            await run(client, prefix + random_ids(rng, 5))  # Caches the prefix on one replica.
            for _ in range(4):
                _, usage = await run(client, prefix + random_ids(rng, 5))
                # Every later request lands where the prefix is cached (round-robin would
                # send half of them to the other replica, which computes it again).
                assert usage["cached_tokens"] >= 4 * BLOCK, usage


async def test_requests_without_a_shared_prefix_spread_over_both(dp_cluster):
    rng = random.Random(2)
    before = await replica_prompt_tokens(dp_cluster)
    async with dp_cluster.client() as client:
        await asyncio.gather(*(run(client, random_ids(rng, 40), max_tokens=16) for _ in range(8)))
    after = await replica_prompt_tokens(dp_cluster)
    assert all(a > b for a, b in zip(after, before)), (before, after)


async def wait_scheduler(cluster: LocalCluster, replica: int, status: int, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        async with cluster.channel("scheduler", replica=replica) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        if reply.status == status:
            return
        assert loop.time() < deadline, f"replica {replica}'s scheduler never became {status}"
        await asyncio.sleep(0.2)


async def test_a_killed_replica_hands_its_streams_over_then_rejoins(dp_cluster):
    rng = random.Random(3)
    prompts = [random_ids(rng, 24) for _ in range(6)]
    async with dp_cluster.client() as client:
        solo = [(await run(client, p, max_tokens=40))[0] for p in prompts]

        started = asyncio.Event()
        streamed = [0] * len(prompts)

        async def stream(i: int) -> list[int]:
            ids = []
            async for delta in client.generate(token_ids=prompts[i], max_tokens=40, temperature=0.0,
                                               ignore_eos=True):
                ids += delta.token_ids
                streamed[i] = len(ids)
                if all(streamed):
                    started.set()
            return ids

        tasks = [asyncio.create_task(stream(i)) for i in range(len(prompts))]
        await asyncio.wait_for(started.wait(), 120)  # Every stream is mid-way, on both replicas.
        before = await replica_prompt_tokens(dp_cluster)
        dp_cluster.processes["worker@1"].send_signal(signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 180)
        assert results == solo  # Not a token lost or repeated, the same greedy text.
        # The survivor recomputed the migrated streams: its prompt tokens grew.
        assert (await replica_prompt_tokens(dp_cluster))[0] > before[0]

        await wait_all_blocks_free(dp_cluster, timeout_s=60, replica=0)
        audit = await block_audit(dp_cluster, replica=0)
        assert (list(audit.gpu_blocks), list(audit.orphaned_gpu_blocks), list(audit.problems)) == ([], [], [])

        # The dead replica rejoins once its worker is back: new requests reach it again.
        dp_cluster.processes["worker@1"].wait()
        dp_cluster.spawn("worker@1")
        await wait_scheduler(dp_cluster, 1, health_pb2.HealthCheckResponse.SERVING, 180)
        rejoined = (await replica_prompt_tokens(dp_cluster))[1]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while (await replica_prompt_tokens(dp_cluster))[1] == rejoined:
            assert loop.time() < deadline, "no request reached the restarted replica"
            await asyncio.gather(*(run(client, random_ids(rng, 30)) for _ in range(4)))
