"""A real cluster (secure by default, like every e2e cluster): the public API wants the
key, the internal services want the cluster's certificates, and a valid certificate of
the wrong role is refused without disturbing the live worker."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.contract.security import channel_credentials
from llmserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2_grpc
from llmserve.launcher.cluster import LocalCluster
from llmserve.v1 import generation_pb2 as pb
from llmserve.v1 import generation_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING


def as_role(cluster: LocalCluster, address: str, role: str, credentials=None) -> grpc.aio.Channel:
    """A channel presenting `role`'s certificate (the cluster's own, or another set's)."""
    c = credentials or cluster.credentials
    return grpc.aio.secure_channel(address, channel_credentials(cluster.credentials.ca, c.cert(role), c.key(role)))


def scheduler_log(cluster: LocalCluster) -> str:
    return (cluster.spec.log_dir / "scheduler.log").read_text(errors="replace")


@pytest.mark.slow
async def test_generate_needs_the_api_key_health_does_not(cluster):
    request = pb.GenerateRequest(text="The capital of France is",
                                params=pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    async with cluster.channel(api_key=False) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for metadata, message in ((None, "missing API key"), ((("authorization", "Bearer not-the-key"),),
                                                              "invalid API key")):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(request, metadata=metadata, timeout=30):
                    pass
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert message in err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Probes carry no key.
        assert (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)).status \
            == SERVING
        # The key as call metadata: served.
        replies = [r async for r in stub.Generate(request, metadata=cluster.call_metadata, timeout=60)]
        assert sum(len(r.token_ids) for r in replies) == 4


@pytest.mark.slow
async def test_internal_services_refuse_another_cas_certificates(cluster, foreign_credentials):
    for address in (cluster.scheduler_address, cluster.worker_address):
        # Control: the cluster's own scheduler/router certificates get in...
        async with as_role(cluster, address, "router") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == SERVING
        # ...the same roles from another CA do not, nor does a client without a certificate.
        async with as_role(cluster, address, "router", foreign_credentials) as foreign, \
                grpc.aio.secure_channel(address, channel_credentials(cluster.credentials.ca)) as anonymous:
            for channel in (foreign, anonymous):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, address
        async with grpc.aio.insecure_channel(address) as plaintext:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await health_pb2_grpc.HealthStub(plaintext).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, address


@pytest.mark.slow
async def test_wrong_roles_are_refused_and_the_live_worker_keeps_serving(cluster):
    tracebacks = scheduler_log(cluster).count("Traceback")
    async with cluster.client() as client:
        before = await client.complete("The capital of France is", max_tokens=8, temperature=0.0)
    # The router's certificate (same CA, valid) tries to register a worker of its own.
    async with as_role(cluster, cluster.scheduler_address, "router") as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(address="localhost:1"), timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "RegisterWorker is for the llmserve worker only" in err.value.details()
        assert "llmserve-router" in err.value.details()
        stats = await stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)
        assert stats.worker_ready
    # A worker's certificate opens a router session; a router's drives a worker.
    async with as_role(cluster, cluster.scheduler_address, "worker") as channel:
        session = scheduler_pb2_grpc.SchedulerStub(channel).Session(timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await session.read()
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "Session is for the llmserve router only" in err.value.details()
    async with as_role(cluster, cluster.worker_address, "router") as channel:
        execute = worker_pb2_grpc.WorkerStub(channel).Execute(timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await execute.read()
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "Execute is for the llmserve scheduler only" in err.value.details()
    # Nothing changed hands: the same worker answers the same, and nobody logged a traceback.
    async with cluster.client() as client:
        assert await client.health() == "SERVING"
        assert await client.complete("The capital of France is", max_tokens=8, temperature=0.0) == before
    assert scheduler_log(cluster).count("Traceback") == tracebacks


@pytest.mark.slow
def test_bench_serve_reaches_a_running_secure_cluster(cluster, tmp_path):
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "llmserve.cli", "--log-level", "WARNING", "bench", "serve",
         "--target", cluster.router_address, "--tls-ca", str(cluster.credentials.ca),
         "--api-key-file", str(cluster.credentials.api_key_file), "--workload", "random", "--num-requests", "3",
         "--input-len", "8", "16", "--output-len", "4", "4", "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(next(tmp_path.glob("serve-*.json")).read_text())
    assert report["metrics"]["completed"] == 3 and report["metrics"]["failed"] == 0


@pytest.mark.slow
def test_llmserve_health_probes_every_service_with_what_it_needs(cluster):
    import os
    import subprocess
    import sys

    c = cluster.credentials
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMSERVE_")}

    def probe(address: str, *flags: str, **extra_env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "llmserve.cli", "health", "--target", address, *flags],
                              capture_output=True, text=True, timeout=60, env={**env, **extra_env})

    # The router: the CA is enough (probes carry no key).
    assert probe(cluster.router_address, "--tls-ca", str(c.ca)).returncode == 0
    # The scheduler: a client certificate too, from flags or (inside its container) its variables.
    assert probe(cluster.scheduler_address, "--tls-ca", str(c.ca)).returncode == 1
    ok = probe(cluster.scheduler_address, LLMSERVE_TLS_CA=str(c.ca), LLMSERVE_TLS_CERT=str(c.cert("scheduler")),
               LLMSERVE_TLS_KEY=str(c.key("scheduler")))
    assert ok.returncode == 0 and "SERVING" in ok.stdout
    assert probe(cluster.worker_address, *c.service_flags("scheduler")[:4], "--tls-ca", str(c.ca)).returncode == 0
