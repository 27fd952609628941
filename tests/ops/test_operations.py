"""Operating a real three-process cluster: one trace across all services, Prometheus
metrics that follow the requests, health transitions in order, SIGTERM drains."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import httpx2  # The openai SDK's HTTP client.
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.client import LLMServeClient
from llmserve.launcher.cluster import ClusterSpec, LocalCluster, free_port
from llmserve.model_store import default_model_dir
from llmserve.telemetry import metrics as metric_specs

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
UP_CREDENTIALS = re.compile(r"TLS CA certificate: (?P<ca>\S+); API key file: (?P<key>\S+) ")


async def health(cluster: LocalCluster, service: str) -> int | None:
    try:
        async with cluster.channel(service) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
            return reply.status
    except grpc.aio.AioRpcError:
        return None  # Not listening (yet / any more).


def scrape(port: int) -> dict[str, float]:
    """name{labels} -> value of every sample on a Prometheus endpoint."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples


def total(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def labels_of(key: str) -> dict[str, str]:
    """'name{a="1",b="2"}' -> {"a": "1", "b": "2"}."""
    return dict(re.findall(r'(\w+)="([^"]*)"', key.partition("{")[2]))


def value(samples: dict[str, float], name: str, **labels: str) -> float:
    """The one sample of `name` whose labels include `labels`."""
    found = [v for k, v in samples.items() if k.split("{")[0] == name and labels.items() <= labels_of(k).items()]
    assert len(found) == 1, (name, labels, found)
    return found[0]


@pytest.fixture(scope="module")
def model_dir():
    return default_model_dir()


@pytest.mark.slow
async def test_trace_metrics_and_health(model_dir, tmp_path):
    span_file = tmp_path / "spans.jsonl"
    ports = {name: free_port() for name in ("router", "scheduler", "worker")}
    spec = ClusterSpec(model_dir=model_dir, router_port=free_port(), scheduler_port=free_port(),
                       worker_port=free_port(), log_dir=tmp_path,
                       router_args=["--metrics-port", str(ports["router"])],
                       scheduler_args=["--metrics-port", str(ports["scheduler"])],
                       worker_args=["--metrics-port", str(ports["worker"]), "--kv-cache-memory", "64MiB"])
    os.environ["LLMSERVE_SPAN_FILE"] = str(span_file)
    cluster = LocalCluster(spec)
    try:
        for name in ("router", "scheduler", "worker"):
            cluster.spawn(name)
        # --- start-up: worker, then scheduler (after a readiness step), then router ---
        first_serving: dict[str, tuple[int, int]] = {}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 300
        poll = 0
        while len(first_serving) < 3:
            assert loop.time() < deadline, f"not all SERVING: {first_serving}"
            for position, name in enumerate(("worker", "scheduler", "router")):
                status = await health(cluster, name)
                if status == SERVING:
                    first_serving.setdefault(name, (poll, position))
                else:
                    assert name not in first_serving, f"{name} went back to {status} during start-up"
            for name, proc in cluster.processes.items():
                assert proc.poll() is None, f"{name} exited: " + cluster._log_hint(name)
            poll += 1
            await asyncio.sleep(0.1)
        assert first_serving["worker"] < first_serving["scheduler"] < first_serving["router"], first_serving
        async with cluster.channel("scheduler") as ch:
            from llmserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc

            stats = await scheduler_pb2_grpc.SchedulerStub(ch).GetStats(scheduler_pb2.GetStatsRequest())
            assert stats.num_steps >= 1  # The readiness request ran a step before SERVING.

        # --- one traced Generate --------------------------------------------------
        before = scrape(ports["router"])
        async with cluster.client() as client:
            streamed = 0
            request_id = ""
            async for delta in client.generate("The capital of France is", max_tokens=12, temperature=0.0,
                                               ignore_eos=True, metadata=(("traceparent", TRACEPARENT),)):
                streamed += len(delta.token_ids)
                request_id = delta.request_id
        assert streamed == 12
        await asyncio.sleep(0.5)
        spans = [json.loads(line) for line in span_file.read_text().splitlines()]
        trace_id = TRACEPARENT.split("-")[1]
        mine = [s for s in spans if s["trace_id"] == trace_id]
        by_name = {s["name"]: s for s in mine}
        assert {s["service"] for s in mine} == {"llmserve-router", "llmserve-scheduler", "llmserve-worker"}
        root = by_name["llmserve.generate"]
        assert root["parent_span_id"] == TRACEPARENT.split("-")[2]  # The client's traceparent honoured.
        a = root["attributes"]
        assert a["llmserve.request_id"] == request_id and a["llmserve.model"]
        assert a["llmserve.completion_tokens"] == 12 and a["llmserve.finish_reason"] == "length"
        assert a["llmserve.prompt_tokens"] > 0 and a["llmserve.ttft_s"] > 0
        ids = {s["span_id"]: s for s in mine}
        for s in mine:  # Parent links intact: every span's parent is in the trace (or is the client's).
            assert s is root or s["parent_span_id"] in ids, s
        parent = lambda name: ids[by_name[name]["parent_span_id"]]["name"]  # noqa: E731
        assert parent("router.tokenize") == parent("router.detokenize") == "llmserve.generate"
        assert parent("scheduler.request") == "llmserve.generate"
        assert parent("scheduler.queue") == parent("scheduler.prefill") == "scheduler.request"
        assert parent("worker.prefill") == "scheduler.prefill"
        request_span = by_name["scheduler.request"]["span_id"]
        steps = [s for s in spans if s["name"] == "scheduler.step"
                 and any(link["span_id"] == request_span for link in s["links"])]
        assert len(steps) >= 12  # Prefill + 11 decode steps (at least), each linked to the request.
        assert all(s["attributes"]["llmserve.batch_size"] >= 1 for s in steps)
        worker_steps = [s for s in spans if s["name"] == "worker.step"
                        and s["parent_span_id"] in {st["span_id"] for st in steps}]
        assert len(worker_steps) == len(steps)
        assert all("llmserve.num_scheduled_tokens" in s["attributes"] for s in worker_steps)
        assert all(s["attributes"]["llmserve.num_steps"] == 1 for s in worker_steps)  # Not multi-step.

        # --- metrics follow the request -------------------------------------------
        after = {name: scrape(port) for name, port in ports.items()}
        documented = {name: [s.prometheus_name for s in metric_specs.METRICS if s.service == name]
                      for name in ports}
        # Per draft position: positions 0..K-1 of --speculative-tokens K, none without it.
        speculation_only = {s.prometheus_name for s in metric_specs.METRICS
                            if s.name == "llmserve.spec_decode_num_accepted_tokens_per_pos"}
        assert speculation_only
        for name, metric_names in documented.items():
            for metric in set(metric_names) - speculation_only:
                assert any(k.split("{")[0].removesuffix("_bucket").removesuffix("_count").removesuffix("_sum")
                           == metric for k in after[name]), f"{name} does not serve {metric}"
        for name, samples in after.items():  # One Prometheus can tell two models apart.
            ours = [k for k in samples if k.startswith("llmserve_")]
            assert ours and all(labels_of(k).get("model_name") == model_dir.name for k in ours), \
                (name, [k for k in ours if labels_of(k).get("model_name") != model_dir.name])
        r = after["router"]
        assert total(r, "llmserve_generation_tokens_total") - total(before, "llmserve_generation_tokens_total") == 12
        assert total(r, "llmserve_prompt_tokens_total") - total(before, "llmserve_prompt_tokens_total") \
            == a["llmserve.prompt_tokens"]
        assert total(r, "llmserve_time_to_first_token_seconds_count") \
            - total(before, "llmserve_time_to_first_token_seconds_count") == 1
        assert value(r, "llmserve_requests_total", finish_reason="length") >= 1
        s = after["scheduler"]
        assert total(s, "llmserve_step_time_seconds_count") >= 12
        assert total(s, "llmserve_queue_time_seconds_count") >= 1
        assert value(s, "llmserve_num_requests_running") == 0 and value(s, "llmserve_kv_cache_usage") == 0
        assert total(after["worker"], "llmserve_worker_step_time_seconds_count") >= 12

        # --- a lost worker: scheduler, then router, NOT_SERVING -------------------
        cluster.processes["worker"].send_signal(signal.SIGKILL)
        cluster.processes["worker"].wait()
        order = []
        deadline = loop.time() + 30
        while len(order) < 2:
            assert loop.time() < deadline, order
            for name in ("scheduler", "router"):
                if name not in order and await health(cluster, name) == NOT_SERVING:
                    order.append(name)
            await asyncio.sleep(0.05)
        assert order == ["scheduler", "router"]
    finally:
        os.environ.pop("LLMSERVE_SPAN_FILE", None)
        cluster.stop()


@pytest.mark.slow
async def test_sigterm_drains_streams_and_exits_cleanly(tmp_path):
    """`llmserve up` gets SIGTERM during 8 gRPC streams and one over the OpenAI HTTP API:
    they all finish, new calls are refused (UNAVAILABLE, HTTP 503), every process exits
    0, none is left behind."""
    port, sched_port, worker_port, http_port = free_port(), free_port(), free_port(), free_port()
    log = open(tmp_path / "up.log", "wb")
    up = subprocess.Popen([sys.executable, "-m", "llmserve.cli", "up", "--port", str(port), "--http-port", str(http_port),
                           "--scheduler-port", str(sched_port), "--worker-port", str(worker_port),
                           "--kv-cache-memory", "64MiB", "--shutdown-timeout", "60"],
                          stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    address = f"localhost:{port}"
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 300
        # `up` is secure by default: it logs where its throwaway CA and API key file are.
        while (found := UP_CREDENTIALS.search((tmp_path / "up.log").read_text())) is None:
            assert up.poll() is None and loop.time() < deadline, (tmp_path / "up.log").read_text()[-3000:]
            await asyncio.sleep(0.25)
        ca, key_file = Path(found["ca"]), Path(found["key"])
        assert ca.parent == key_file.parent and ca.parent.stat().st_mode & 0o777 == 0o700
        api_key = key_file.read_text().strip()
        async with LLMServeClient(address, tls_ca=ca) as keyless:
            assert await keyless.health() == "SERVING"  # Probes need no key...
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await keyless.complete("Hi", max_tokens=2)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED  # ...requests do.
        children = [int(p) for p in subprocess.run(["pgrep", "-P", str(up.pid)], capture_output=True,
                                                    text=True).stdout.split()]
        assert len(children) == 3
        http = httpx2.AsyncClient(base_url=f"https://localhost:{http_port}/v1", timeout=120,
                                  verify=ssl.create_default_context(cafile=str(ca)),
                                  headers={"authorization": f"Bearer {api_key}"})
        async with LLMServeClient(address, tls_ca=ca, api_key=api_key) as client, http:
            started = asyncio.Event()
            http_started = asyncio.Event()
            counts = [0] * 8

            async def http_stream() -> list[str]:
                events = []
                async with http.stream("POST", "/completions", json={
                        "model": "SmolLM2-135M-Instruct", "prompt": "Story over HTTP:", "max_tokens": 24,
                        "temperature": 0, "ignore_eos": True, "stream": True}) as response:
                    async for line in response.aiter_lines():
                        if line:
                            events.append(line)
                            http_started.set()
                return events

            async def stream(i: int):
                finish = None
                async for delta in client.generate(f"Story number {i}:", max_tokens=24, temperature=0.0,
                                                   ignore_eos=True):
                    counts[i] += len(delta.token_ids)
                    if all(counts):
                        started.set()
                    finish = delta.finish_reason or finish
                return finish

            tasks = [asyncio.create_task(stream(i)) for i in range(8)]
            over_http = asyncio.create_task(http_stream())
            await asyncio.wait_for(asyncio.gather(started.wait(), http_started.wait()), 120)
            t0 = time.monotonic()
            up.send_signal(signal.SIGTERM)
            while await _serving(client):
                await asyncio.sleep(0.05)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.complete("Hi", max_tokens=2)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            refused = await http.post("/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": "Hi"})
            assert refused.status_code == 503 and refused.json()["error"]["message"] == "the router is shutting down"
            finishes = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            events = await asyncio.wait_for(over_http, 120)
        assert finishes == ["length"] * 8 and counts == [24] * 8
        assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert up.wait(timeout=90) == 0, (tmp_path / "up.log").read_text()[-3000:]
        assert time.monotonic() - t0 < 60
        text = (tmp_path / "up.log").read_text()
        for name in ("router", "scheduler", "worker"):
            assert f"{name} exited with code 0" in text, text[-3000:]
        for pid in children:
            assert not os.path.exists(f"/proc/{pid}") or _is_zombie(pid), f"child {pid} is still running"
        assert not ca.parent.exists()  # The throwaway credentials went with the cluster.
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        log.close()


async def _serving(client: LLMServeClient) -> bool:
    try:
        return await client.health() == "SERVING"
    except grpc.aio.AioRpcError:
        return False  # Not listening any more.


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True
