"""A worker that dies mid-generation fails its requests with UNAVAILABLE (no hang),
health tells the truth, and a restarted worker brings the cluster back."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.launcher.cluster import LocalCluster

from .conftest import start_cluster
from .stats import wait_all_blocks_free


async def health(cluster: LocalCluster, service: str) -> int:
    async with cluster.channel(service) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status


async def wait_health(cluster: LocalCluster, service: str, status: int, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while await health(cluster, service) != status:
        assert loop.time() < deadline, f"{service} never became {status}"
        await asyncio.sleep(0.2)


@pytest.mark.slow
async def test_worker_loss_fails_requests_then_recovers(model_dir, tmp_path):
    cluster = start_cluster(model_dir, tmp_path, worker_args=["--kv-cache-memory", "64MiB"])
    try:
        async with cluster.client() as client:
            async def long_request(prompt):
                got = 0
                async for delta in client.generate(prompt, max_tokens=1000, temperature=0.0, ignore_eos=True):
                    got += len(delta.token_ids)
                return got

            tasks = [asyncio.create_task(long_request(p)) for p in ("Hello", "Once upon a time")]
            await asyncio.sleep(2.0)  # Both are mid-generation.
            cluster.processes["worker"].send_signal(signal.SIGKILL)
            for task in tasks:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await asyncio.wait_for(task, timeout=30)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "worker" in info.value.details()
            ready = health_pb2.HealthCheckResponse
            await wait_health(cluster, "scheduler", ready.NOT_SERVING, 10)
            await wait_health(cluster, "router", ready.NOT_SERVING, 10)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.complete("Hi", max_tokens=4)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE

            cluster.spawn("worker")
            await wait_health(cluster, "router", ready.SERVING, 120)
            text = await client.complete("The capital of France is", max_tokens=8, temperature=0.0)
            assert text
        await wait_all_blocks_free(cluster)
    finally:
        cluster.stop()
