"""Overload and deadlines on a real cluster with one seat and a one-request queue:
refusals carry RESOURCE_EXHAUSTED with a google.rpc.RetryInfo, better priority displaces
a queued request, health and metrics show saturation, a deadline that passes in the
queue ends the request before it is ever scheduled, its blocks freed, and a brief
`llmserve bench overload` run keeps its invariants (the timing figures are the full
benchmark's business)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.bench.overload import print_report, run_phases
from llmserve.client import build_generate_request
from llmserve.contract.retry_info import retry_delay_s
from llmserve.internal.v1 import sampling_pb2, scheduler_pb2, scheduler_pb2_grpc
from llmserve.launcher.cluster import free_port

from .conftest import start_cluster
from .stats import scheduler_stats, scrape, wait_all_blocks_free

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
GENERATION = "llmserve.v1.Generation"
PROMPT = [1, 504, 3458, 282]  # Token ids: no tokenizer work in the way.


@pytest.fixture(scope="module")
def bounded(model_dir, tmp_path_factory):
    """One sequence runs at a time and one request may wait: a second waiting one is refused."""
    log_dir = tmp_path_factory.mktemp("admission-logs")
    metrics_port = free_port()
    cluster = start_cluster(model_dir, log_dir, scheduler_args=[
        "--max-num-seqs", "1", "--max-queued-requests", "1", "--metrics-port", str(metrics_port)],
        worker_args=["--kv-cache-memory", "64MiB"])
    yield cluster, metrics_port, log_dir
    cluster.stop()


async def collect(client, request_id: str, max_tokens: int = 1000, priority: int = 0) -> str:
    """Streams a request to its end; returns its finish reason."""
    finish = None
    async for delta in client.generate(token_ids=PROMPT, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                       request_id=request_id, priority=priority):
        finish = delta.finish_reason or finish
    return finish


async def occupy_the_seat(client) -> asyncio.Task:
    """A long request, once it has streamed its first token (it holds the only seat)."""
    started = asyncio.Event()

    async def run():
        async for _ in client.generate(token_ids=PROMPT, max_tokens=1000, ignore_eos=True, request_id="seat"):
            started.set()

    task = asyncio.create_task(run())
    await asyncio.wait_for(started.wait(), 60)
    return task


async def until(probe, timeout_s: float = 30.0, what: str = ""):
    """Polls the coroutine function `probe` until it returns something truthy."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not (value := await probe()):
        assert loop.time() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.1)
    return value


async def health(cluster, service: str) -> int:
    """The router's health for `service`."""
    async with cluster.channel() as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                timeout=5)
        return reply.status


async def stop(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@pytest.mark.slow
async def test_full_queue_refuses_with_retry_info_and_shows_saturation(bounded):
    cluster, metrics_port, _ = bounded
    async with cluster.client() as client:
        seat = await occupy_the_seat(client)
        refused_before = dict((await scheduler_stats(cluster)).num_refused)
        queued = asyncio.create_task(collect(client, "queued", priority=5))
        await until(lambda: _queued(cluster, 1), what="one request queued")

        # Not better than the queued one: refused at once, with a retry hint, never queued.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collect(client, "refused", priority=5)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-queued-requests (1) reached" in refused.value.details()
        assert retry_delay_s(refused.value) > 0
        stats = await scheduler_stats(cluster)
        assert (stats.num_queued_requests, stats.saturated) == (1, True)
        assert stats.num_refused["queued_requests"] == refused_before.get("queued_requests", 0) + 1

        # Health: alive, but the Generation service tells load balancers to go elsewhere.
        await until(lambda: _status_is(cluster, GENERATION, NOT_SERVING), what="Generation NOT_SERVING")
        assert await health(cluster, "") == SERVING
        metrics = await until(lambda: _saturated_metrics(metrics_port), what="saturation in the metrics")
        assert metrics["llmserve_queued_requests_limit"] == 1
        assert metrics['llmserve_requests_refused_total{reason="queued_requests"}'] >= 1

        # Better priority: the queued request is refused instead (it had not started).
        better = asyncio.create_task(collect(client, "better", max_tokens=2, priority=0))
        with pytest.raises(grpc.aio.AioRpcError) as displaced:
            await asyncio.wait_for(queued, 30)
        assert displaced.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "better priority" in displaced.value.details() and retry_delay_s(displaced.value) > 0
        assert (await scheduler_stats(cluster)).num_refused["displaced"] == refused_before.get("displaced", 0) + 1

        # The queue drains: health comes back, nothing leaked.
        await stop(seat)
        assert await asyncio.wait_for(better, 60) == "length"
        stats = await wait_all_blocks_free(cluster)
        assert not stats.saturated and stats.num_queued_requests == 0
        await until(lambda: _status_is(cluster, GENERATION, SERVING), what="Generation SERVING again")


@pytest.mark.slow
async def test_full_queue_over_http_is_429_with_retry_after(bounded):
    """The OpenAI API gets the same refusal as gRPC: 429, OpenAI's error body, and the
    admission control's retry hint as Retry-After (seconds) and retry-after-ms."""
    import ssl

    import httpx2  # The openai SDK's HTTP client.

    cluster = bounded[0]
    tls = ssl.create_default_context(cafile=str(cluster.credentials.ca))
    async with cluster.client() as client, httpx2.AsyncClient(
            verify=tls, timeout=30, headers={"authorization": f"Bearer {cluster.api_key}"}) as http:
        seat = await occupy_the_seat(client)
        queued = asyncio.create_task(collect(client, "queued-http", priority=5))
        await until(lambda: _queued(cluster, 1), what="one request queued")
        refused = await http.post(f"{cluster.http_url}/completions", json={
            "model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 4, "priority": 5, "stream": True})
        assert refused.status_code == 429
        error = refused.json()["error"]
        assert error["type"] == "rate_limit_error" and "--max-queued-requests (1) reached" in error["message"]
        assert int(refused.headers["retry-after-ms"]) > 0
        assert int(refused.headers["Retry-After"]) == -(-int(refused.headers["retry-after-ms"]) // 1000)
        await stop(seat)
        await stop(queued)
        await wait_all_blocks_free(cluster)


@pytest.mark.slow
async def test_deadline_that_passes_in_the_queue(bounded):
    cluster, _, log_dir = bounded
    async with cluster.client() as client, cluster.channel("scheduler") as channel:
        seat = await occupy_the_seat(client)
        before = await scheduler_stats(cluster)

        # Through the router: the client's deadline passes while the request waits.
        call = client._stub.Generate(build_generate_request(token_ids=PROMPT, max_tokens=4), timeout=1.0)
        with pytest.raises(grpc.aio.AioRpcError) as late:
            async for _ in call:
                pass
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # NOTE: the client's deadline ends the call before the scheduler may have ended the
        # request (by its expiry or the router's abort): until it has, it holds the only
        # queue place, and "hurry" below would be refused as saturated (a clean-clone CI run
        # on a slow host saw that: RESOURCE_EXHAUSTED, "--max-queued-requests (1) reached").
        await until(lambda: _queue_emptied(cluster, before), what="the router's request ended in the scheduler")

        # Straight to the scheduler: the budget the router passes on ends it there.
        session = scheduler_pb2_grpc.SchedulerStub(channel).Session()
        add = scheduler_pb2.AddRequest(request_id="hurry", prompt_token_ids=PROMPT, n=1, deadline_ms=300,
                                       sampling=sampling_pb2.SamplingParams(max_tokens=4))
        await session.write(scheduler_pb2.RouterMessage(add=add))
        ended = await asyncio.wait_for(_output_of(session, "hurry"), 30)
        assert ended.finish_reason == 4 and ended.error_code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        session.cancel()

        # NOTE: the router's request races: the scheduler expires it at the budget the
        # router passed on, or the router's abort (its client's deadline) lands first.
        # Either way it ends exactly once; "hurry" can only expire.
        stats = await until(lambda: _ended(cluster, before, 2), what="both ends counted")
        assert stats.num_expired - before.num_expired in (1, 2)
        assert (stats.num_expired + stats.num_aborted) - (before.num_expired + before.num_aborted) == 2
        assert stats.prompt_tokens_total == before.prompt_tokens_total  # Neither was ever scheduled.
        assert (stats.num_running, stats.num_queued_requests) == (1, 0)
        await stop(seat)
        await wait_all_blocks_free(cluster)
    router_log = (log_dir / "router.log").read_text()
    assert "Traceback" not in router_log, router_log[-3000:]


@pytest.mark.slow
async def test_bench_overload_brief_run(bounded, model_dir, capsys):
    """`llmserve bench overload`'s phases against this cluster, offered 8x what it serves."""
    cluster = bounded[0]
    before = (await scheduler_stats(cluster)).num_refused.get("queued_requests", 0)
    args = SimpleNamespace(seed=0, input_len=[8, 16], output_len=8, unloaded_requests=2, request_rate=None,
                           concurrency=None, calibrate_s=3.0, overload=8.0, duration=4.0)
    vocab_size = (await _model_info(cluster)).vocab_size
    report = await run_phases(args, cluster, vocab_size, seats=1)
    assert report["violations"] == 0, report["violation_examples"]
    assert report["completed"] >= 1 and report["refused"] >= 1
    assert report["completed"] + report["refused"] == report["requests"]
    # The scheduler refused exactly the requests the client saw refused.
    assert report["scheduler"]["num_refused"]["queued_requests"] - before == report["refused"]
    assert report["retry_after_ms"]["p50"] > 0 and report["refusal_ms"]["max"] > 0
    assert report["leaked_blocks"] == 0 and report["idle"] and not report["scheduler"]["saturated_after"]
    assert report["acceptance"]["every_request_completed_or_refused"] and report["acceptance"]["no_leaked_blocks"]
    print_report({**report, "machine": {"cpu": "test", "cores": 1, "cpu_matrix_isa": []},
                  "workload": {"overload": args.overload, "duration_s": args.duration}})
    assert "TTFT overloaded" in capsys.readouterr().out


@pytest.mark.slow
async def test_model_info_and_the_log_say_the_set_budget(bounded):
    cluster, _, log_dir = bounded
    info = await _model_info(cluster)
    assert (info.max_num_seqs, info.max_num_batched_tokens) == (1, 512)
    assert info.step_budget_reason == "set by --max-num-seqs, the other by device: cpu"
    line = "step budget: 512 batched tokens, 1 sequences (set by --max-num-seqs, the other by device: cpu)"
    assert (log_dir / "scheduler.log").read_text().count(line) == 1


async def _model_info(cluster):
    async with cluster.client() as client:
        return await client.model_info()


async def _queued(cluster, count: int) -> bool:
    return (await scheduler_stats(cluster)).num_queued_requests == count


async def _status_is(cluster, service: str, status: int) -> bool:
    return await health(cluster, service) == status


async def _saturated_metrics(port: int) -> dict[str, float] | None:
    samples = await asyncio.to_thread(scrape, port)
    return samples if samples.get("llmserve_saturated") == 1 else None


async def _ended(cluster, before, count: int):
    """The scheduler's stats once `count` more requests expired or were aborted (one of
    them expired) than in `before`."""
    stats = await scheduler_stats(cluster)
    return stats if _num_ended(stats, before) >= count and stats.num_expired > before.num_expired else None


async def _queue_emptied(cluster, before):
    """The scheduler's stats once a request more than in `before` ended (expired or
    aborted) and none waits."""
    stats = await scheduler_stats(cluster)
    return stats if _num_ended(stats, before) >= 1 and stats.num_queued_requests == 0 else None


def _num_ended(stats, before) -> int:
    """Requests expired or aborted since `before`."""
    return (stats.num_expired + stats.num_aborted) - (before.num_expired + before.num_aborted)


async def _output_of(session, request_id: str):
    while True:
        update = await session.read()
        for out in update.outputs:
            if out.request_id == request_id and out.finish_reason:
                return out
