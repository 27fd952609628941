"""A failure is reported as what it is: a stream the server ended mid-way (a worker that
stopped answering) is neither "cannot reach the router" in `llmserve generate` nor an
anonymous RPC error in the Python client; a connection that failed still is."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from llmserve.cli import _router_error, main
from llmserve.client import LLMServeClient, StreamFailed, is_transport_failure
from llmserve.v1 import generation_pb2 as pb
from llmserve.v1 import generation_pb2_grpc as pb_grpc

LOST = ("worker lost: the worker at 127.0.0.1:50061 stopped answering: step 57 has run 5.1 s without a "
        "result (its bound: 5.0 s)")
REFUSED = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Failed to connect to "
           "remote host: Connection refused")


class OneDeltaThenLost(pb_grpc.GenerationServicer):
    """Streams one delta, then ends the stream as a router does when its worker is lost
    (before any delta when `deltas` is 0)."""

    def __init__(self, deltas: int):
        self.deltas = deltas

    def Generate(self, request, context):
        for _ in range(self.deltas):
            yield pb.GenerateResponse(request_id="r", text="Hello", token_ids=[1])
        context.abort(grpc.StatusCode.UNAVAILABLE, LOST)


@pytest.fixture
def router():
    """A fake router on a free port: address and its servicer (whose `deltas` tests set)."""
    servicer = OneDeltaThenLost(deltas=1)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(None)


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, None, None, details, None)


def test_only_a_failed_connection_is_cannot_reach():
    refused = _router_error("localhost:50051", rpc_error(grpc.StatusCode.UNAVAILABLE, REFUSED))
    assert refused.cause == "cannot reach the router at localhost:50051: connection refused"
    assert "llmserve up" in refused.fix
    no_worker = _router_error("localhost:50051", rpc_error(grpc.StatusCode.UNAVAILABLE, LOST))
    assert no_worker.cause == f"the router at localhost:50051 answered UNAVAILABLE: {LOST}" and not no_worker.fix


def test_a_stream_failed_midway_says_so():
    server_ended = StreamFailed(rpc_error(grpc.StatusCode.UNAVAILABLE, LOST), deltas=3)
    assert not server_ended.transport
    assert _router_error("r:1", server_ended).cause == f"the request failed mid-stream (UNAVAILABLE): {LOST}"
    broken = StreamFailed(rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed"), deltas=3)
    assert broken.transport and is_transport_failure(broken)
    assert _router_error("r:1", broken).cause.startswith("lost the connection to the router at r:1 mid-stream: ")


async def test_the_client_raises_stream_failed_with_the_servers_status(router):
    address, _ = router
    async with LLMServeClient(address, insecure=True) as client:
        got = []
        with pytest.raises(StreamFailed) as info:
            async for delta in client.generate("Hi", max_tokens=8):
                got.append(delta.text)
    err = info.value
    assert got == ["Hello"] and err.deltas == 1 and not err.transport
    assert isinstance(err, grpc.aio.AioRpcError)  # Code catching AioRpcError keeps working.
    assert err.code() == grpc.StatusCode.UNAVAILABLE and err.details() == LOST
    assert str(err) == f"the stream failed after 1 deltas (the server ended it): UNAVAILABLE: {LOST}"


async def test_a_failure_before_any_delta_stays_a_plain_rpc_error(router):
    address, servicer = router
    servicer.deltas = 0
    async with LLMServeClient(address, insecure=True) as client:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.complete("Hi", max_tokens=8)
    assert not isinstance(info.value, StreamFailed) and info.value.details() == LOST


def test_generate_prints_the_servers_reason_not_cannot_reach(router, capsys):
    address, _ = router
    assert main(["generate", "Hi", "--target", address, "--insecure"]) == 1
    out, err = capsys.readouterr()
    assert out == "Hello"
    assert err.strip().splitlines()[-1] == f"generate: the request failed mid-stream (UNAVAILABLE): {LOST}"
    assert "cannot reach" not in err
