"""--health-port: a plaintext grpc.health.v1 server beside the TLS port, for probes that
cannot do TLS (Kubernetes' `grpc:` probes). It must report the TLS port's status and
serve nothing else: no certificate, no key, so no service but health."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from llmserve.certs import write_credentials
from llmserve.contract.grpc_server import ServiceServer
from llmserve.contract.security import SecurityOptions, channel_credentials
from llmserve.contract.startup_errors import StartupError
from llmserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from llmserve.launcher.cluster import free_port

SCHEDULER = "llmserve.internal.v1.Scheduler"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def credentials(tmp_path_factory):
    return write_credentials(tmp_path_factory.mktemp("creds"))


def _security(credentials, role: str) -> SecurityOptions:
    return SecurityOptions(tls_cert=credentials.cert(role), tls_key=credentials.key(role), tls_ca=credentials.ca)


def _check(channel: grpc.Channel, service: str = "") -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _wait_listening(port: int, deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        grpc.channel_ready_future(ch).result(timeout=max(deadline - time.monotonic(), 1))


def _assert_no_reflection(plain: grpc.Channel) -> None:
    """The health port lists no services: reflection is UNIMPLEMENTED there."""
    reflection = reflection_pb2_grpc.ServerReflectionStub(plain).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    with pytest.raises(grpc.RpcError) as err:
        list(reflection)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_real_scheduler_answers_health_in_plaintext_and_nothing_else(credentials):
    port, health_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMSERVE_")}
    proc = subprocess.Popen([sys.executable, "-m", "llmserve.cli", "scheduler", "--port", str(port),
                             "--health-port", str(health_port), *credentials.service_flags("scheduler")],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        _wait_listening(health_port)
        tls = grpc.secure_channel(f"localhost:{port}", channel_credentials(
            credentials.ca, credentials.cert("router"), credentials.key("router")))
        with tls, grpc.insecure_channel(f"127.0.0.1:{health_port}") as plain:
            # No worker yet: NOT_SERVING on the TLS port, and the same on the health port.
            for service in ("", SCHEDULER):
                assert _check(tls, service) == NOT_SERVING
                assert _check(plain, service) == NOT_SERVING
            # Everything but health is unimplemented there, even what the TLS port serves.
            scheduler_pb2_grpc.SchedulerStub(tls).GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
            with pytest.raises(grpc.RpcError) as err:
                scheduler_pb2_grpc.SchedulerStub(plain).GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
            _assert_no_reflection(plain)
            # An unknown service name is NOT_FOUND, as on any grpc.health.v1 server.
            with pytest.raises(grpc.RpcError) as err:
                _check(plain, "no.such.Service")
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stderr.read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    log = proc.stderr.read()
    assert f"grpc.health.v1 (plaintext, health only) listening on 127.0.0.1:{health_port}" in log


def test_a_real_router_answers_health_in_plaintext_but_not_reflection_or_generate(credentials):
    """The router serves reflection and llmserve.v1.Generation on its TLS port; its health
    port serves neither."""
    from llmserve.v1 import generation_pb2, generation_pb2_grpc

    port, health_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMSERVE_")}
    # No scheduler at localhost:1: the router stays NOT_SERVING, which is all this needs.
    proc = subprocess.Popen([sys.executable, "-m", "llmserve.cli", "router", "--port", str(port),
                             "--health-port", str(health_port), "--scheduler", "localhost:1",
                             "--api-key-file", str(credentials.api_key_file), *credentials.service_flags("router")],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        _wait_listening(health_port, deadline_s=120)
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as plain:
            for service in ("", "llmserve.v1.Generation"):
                assert _check(plain, service) == NOT_SERVING
            _assert_no_reflection(plain)
            with pytest.raises(grpc.RpcError) as err:
                generation_pb2_grpc.GenerationStub(plain).Tokenize(generation_pb2.TokenizeRequest(text="hi"), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stderr.read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


async def test_the_health_port_follows_the_services_status_and_its_drain(credentials):
    health_port = free_port()
    server = ServiceServer(SCHEDULER, "127.0.0.1", 0, _security(credentials, "scheduler"), health_port=health_port)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as plain:
            stub = health_pb2_grpc.HealthStub(plain)
            request = health_pb2.HealthCheckRequest(service="")
            assert (await stub.Check(request, timeout=5)).status == NOT_SERVING
            await server.set_serving(True)
            assert (await stub.Check(request, timeout=5)).status == SERVING
            # Stopping (SIGTERM's drain) turns it NOT_SERVING before the port closes.
            watch = stub.Watch(request)
            assert (await watch.read()).status == SERVING
            stop_task = asyncio.ensure_future(server.stop(grace=1.0))
            assert (await watch.read()).status == NOT_SERVING
            await stop_task
    finally:
        await server.stop(None)


async def test_a_busy_health_port_is_one_line_naming_the_flag(credentials):
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        with pytest.raises(StartupError) as err:
            ServiceServer(SCHEDULER, "127.0.0.1", 0, _security(credentials, "scheduler"), health_port=busy)
    assert "address already in use" in err.value.cause and "--health-port" in err.value.fix


async def test_off_by_default(credentials):
    server = ServiceServer(SCHEDULER, "127.0.0.1", 0, _security(credentials, "scheduler"))
    assert server.health_server is None
    await server.stop(None)
