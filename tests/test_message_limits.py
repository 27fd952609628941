"""gRPC message size limits: the flags and the transport's own refusal."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.contract.grpc_server import MAX_MESSAGE_BYTES, ServiceServer
from llmserve.contract.security import SecurityOptions
from llmserve.router.config import RouterConfig
from llmserve.scheduler.config import SchedulerServiceConfig
from llmserve.settings import resolve


def test_limits_are_flags_with_defaults():
    router = resolve(RouterConfig)
    assert router.max_request_bytes == 4 * 2**20 and router.max_prompt_bytes is None
    assert router.server.max_message_bytes == MAX_MESSAGE_BYTES == 64 * 2**20
    router = resolve(RouterConfig, {"max_request_bytes": 2**20}, environ={"LLMSERVE_MAX_PROMPT_BYTES": "100KiB"})
    assert router.max_request_bytes == 2**20 and router.max_prompt_bytes == 100 * 1024
    scheduler = resolve(SchedulerServiceConfig, environ={"LLMSERVE_MAX_MESSAGE_BYTES": "128MiB"})
    assert scheduler.server.max_message_bytes == 128 * 2**20


async def test_a_message_over_the_receive_limit_is_resource_exhausted():
    server = ServiceServer("test.Service", "127.0.0.1", 0, SecurityOptions(insecure=True), max_receive_bytes=1024)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(service="test.Service"), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await health.Check(health_pb2.HealthCheckRequest(service="x" * 2000), timeout=5)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "1024" in info.value.details()
    finally:
        await server.stop(grace=None)
