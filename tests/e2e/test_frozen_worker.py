"""A worker frozen mid-stream (SIGSTOP: how a hung GPU or a stuck collective looks from
outside) is noticed in seconds, not when gRPC's keepalive gives up a minute later: every
stream ends with UNAVAILABLE naming the worker, health turns NOT_SERVING, and once the
worker runs again it registers again and serving resumes."""

from __future__ import annotations

import asyncio
import re
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from llmserve.cli import _router_error

from .conftest import start_cluster
from .stats import wait_all_blocks_free
from .test_failures import health, wait_health

STREAMS = ("Hello", "Once upon a time", "The capital of France is")
# Past the watchdog's warm-up steps (16 by default) before the freeze: every stream has
# had this many tokens, one per step.
TOKENS_BEFORE_FREEZE = 40
ENDS_WITHIN_S = 10.0  # The target (issue 31, item 6).


@pytest.mark.slow
@pytest.mark.parametrize("loop", [["--no-async-scheduling"], ["--async-scheduling"]], ids=["serial", "pipelined"])
async def test_a_frozen_worker_ends_its_streams_in_seconds_then_serves_again(model_dir, tmp_path, loop):
    cluster = start_cluster(model_dir, tmp_path, scheduler_args=loop, worker_args=["--kv-cache-memory", "64MiB"])
    worker = cluster.processes["worker"]
    try:
        async with cluster.client() as client:
            tokens = [0] * len(STREAMS)
            ended = [0.0] * len(STREAMS)

            async def stream(i: int, prompt: str) -> None:
                try:
                    async for delta in client.generate(prompt, max_tokens=1000, temperature=0.0, ignore_eos=True):
                        tokens[i] += len(delta.token_ids)
                finally:
                    ended[i] = time.monotonic()

            tasks = [asyncio.create_task(stream(i, p)) for i, p in enumerate(STREAMS)]
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 120
            while min(tokens) < TOKENS_BEFORE_FREEZE:
                assert loop.time() < deadline and not any(t.done() for t in tasks), tokens
                await asyncio.sleep(0.05)
            worker.send_signal(signal.SIGSTOP)
            frozen_at = time.monotonic()
            errors = []
            for task in tasks:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await asyncio.wait_for(task, timeout=30)
                errors.append(info.value)
            took = [end - frozen_at for end in ended]
            port = f":{cluster.spec.worker_port}"
            for err in errors:
                assert err.code() == grpc.StatusCode.UNAVAILABLE
                assert "stopped answering" in err.details() and port in err.details(), err.details()
                # What `llmserve generate` prints for it: the server's reason, not "cannot reach".
                cause = _router_error(cluster.router_address, err).cause
                assert cause.startswith("the request failed mid-stream (UNAVAILABLE): worker lost: the worker at ")
            bound = float(re.search(r"its bound: ([0-9.]+) s", errors[0].details()).group(1))
            print(f"\nfrozen worker: streams ended {', '.join(f'{t:.2f}' for t in took)} s after SIGSTOP "
                  f"(the step's bound: {bound:.1f} s)")
            # The bound is the 5 s floor unless this host's recent steps were slow (it is then
            # a multiple of their p99: a loaded CI host); the streams end a poll after it.
            assert max(took) < max(ENDS_WITHIN_S, bound + 1.5), took
            ready = health_pb2.HealthCheckResponse
            assert await health(cluster, "scheduler") == ready.NOT_SERVING
            await wait_health(cluster, "router", ready.NOT_SERVING, 10)

            worker.send_signal(signal.SIGCONT)  # It runs again: it must register again by itself.
            await wait_health(cluster, "router", ready.SERVING, 120)
            text = await client.complete("The capital of France is", max_tokens=8, temperature=0.0)
            assert text
        await wait_all_blocks_free(cluster)
    finally:
        if worker.poll() is None:
            worker.send_signal(signal.SIGCONT)  # A stopped process would not stop.
        cluster.stop()
