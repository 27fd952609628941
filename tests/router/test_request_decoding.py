"""DecodeErrorInterceptor on a real grpc.aio server with a stub Generation servicer."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from llmserve.contract.security import SecurityOptions
from llmserve.contract.grpc_server import ServiceServer
from llmserve.router.request_decoding import DecodeErrorInterceptor
from llmserve.v1 import generation_pb2 as pb
from llmserve.v1 import generation_pb2_grpc


class StubServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self):
        self.closed = asyncio.Event()  # Set when a Generate stream's clean-up ran.

    async def Generate(self, request, context):
        try:
            for i in range(1000):
                yield pb.GenerateResponse(text=f"{request.text} {i}")
                await asyncio.sleep(0.01)
        finally:
            self.closed.set()

    async def GetModelInfo(self, request, context):
        return pb.ModelInfo(model=request.model or "stub")


@pytest.fixture
async def served():
    server = ServiceServer("llmserve.v1.Generation", "127.0.0.1", 0, SecurityOptions(insecure=True), interceptors=[DecodeErrorInterceptor()])
    servicer = StubServicer()
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server.server)
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield servicer, channel
    await server.stop(grace=None)


async def test_undecodable_bodies_are_invalid_argument(served):
    _, channel = served
    generate = channel.unary_stream("/llmserve.v1.Generation/Generate", request_serializer=None,
                                    response_deserializer=pb.GenerateResponse.FromString)
    info = channel.unary_unary("/llmserve.v1.Generation/GetModelInfo", request_serializer=None,
                               response_deserializer=pb.ModelInfo.FromString)
    for body in (b"\xff\xfe garbage", b"\x1a\x02\xc3\x28"):  # Corrupt; text (field 3) not UTF-8.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in generate(body, timeout=5):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "the request body is not a valid message" in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await info(b"\x0a\x01\xff", timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in err.value.details()
    # Well-formed calls pass through untouched.
    assert (await info(pb.GetModelInfoRequest(model="m").SerializeToString(), timeout=5)).model == "m"
    first = await generate(pb.GenerateRequest(text="hi").SerializeToString(), timeout=5).read()
    assert first.text == "hi 0"


async def test_a_cancelled_stream_still_closes_the_servicer_stream(served):
    servicer, channel = served
    call = generation_pb2_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(text="hi"))
    assert (await call.read()).text == "hi 0"
    call.cancel()
    await asyncio.wait_for(servicer.closed.wait(), timeout=5)
