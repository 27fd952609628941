"""Reads the scheduler's public stats RPC and the services' metrics endpoints (never
their private state)."""

from __future__ import annotations

import asyncio
import re
import urllib.request

from llmserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from llmserve.launcher.cluster import LocalCluster


async def scheduler_stats(cluster: LocalCluster, replica: int = 0) -> scheduler_pb2.SchedulerStats:
    async with cluster.channel("scheduler", replica=replica) as channel:
        return await scheduler_pb2_grpc.SchedulerStub(channel).GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)


async def wait_all_blocks_free(cluster: LocalCluster, timeout_s: float = 30.0,
                               replica: int = 0) -> scheduler_pb2.SchedulerStats:
    """Polls until nothing runs or waits and every KV block is back in the free pool."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        stats = await scheduler_stats(cluster, replica)
        idle = stats.num_running == 0 and stats.num_waiting == 0
        if idle and stats.num_free_blocks == stats.num_total_blocks:
            return stats
        if loop.time() > deadline:
            raise AssertionError(f"KV blocks not all free after {timeout_s} s: {stats}")
        await asyncio.sleep(0.1)


async def block_audit(cluster: LocalCluster, replica: int = 0) -> scheduler_pb2.BlockAudit:
    async with cluster.channel("scheduler", replica=replica) as channel:
        return await scheduler_pb2_grpc.SchedulerStub(channel).GetBlockAudit(scheduler_pb2.GetBlockAuditRequest(),
                                                                             timeout=10)


def scrape(port: int) -> dict[str, float]:
    """name{labels} -> value on a Prometheus endpoint, the model_name label every sample
    carries left out of the key."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {re.sub(r'model_name="[^"]*",?', "", key).replace(",}", "}").replace("{}", ""): float(value)
            for line in text.splitlines() if line and not line.startswith("#")
            for key, _, value in [line.rpartition(" ")]}
