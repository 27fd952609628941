"""llmserve.client against hand-built messages and an in-test fake Generation server."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import pytest_asyncio

from llmserve.client import (
    GenerationDelta,
    GenerationError,
    LLMServeClient,
    ModelInfo,
    build_generate_request,
)
from llmserve.contract.api_keys import ApiKeyInterceptor, ApiKeys
from llmserve.contract.grpc_server import ServiceServer
from llmserve.contract.outputs import TokenLogprobs
from llmserve.contract.security import SecurityOptions
from llmserve.v1 import generation_pb2 as pb
from llmserve.v1 import generation_pb2_grpc as pb_grpc


def test_delta_from_running_response():
    msg = pb.GenerateResponse(request_id="r1", index=1, text="Hel", token_ids=[5, 6])
    assert GenerationDelta.from_pb(msg) == GenerationDelta(
        request_id="r1", index=1, text="Hel", token_ids=[5, 6], finish_reason=None, usage=None
    )


def test_delta_from_last_response():
    msg = pb.GenerateResponse(
        request_id="r1",
        text="!",
        token_ids=[9],
        finish_reason=pb.FINISH_REASON_STOP,
        stop_reason="\n",
        usage=pb.Usage(prompt_tokens=7, completion_tokens=3, cached_tokens=4),
        logprobs=[pb.TokenLogprobs(token_id=9, logprob=-0.5, top_token_ids=[9, 3], top_logprobs=[-0.5, -1.5])],
    )
    delta = GenerationDelta.from_pb(msg)
    assert delta.finish_reason == "stop"
    assert delta.stop_reason == "\n"
    assert delta.usage == {"prompt_tokens": 7, "completion_tokens": 3, "cached_tokens": 4}
    assert delta.logprobs == [TokenLogprobs(9, -0.5, (9, 3), (-0.5, -1.5))]


@pytest.mark.parametrize(
    ("reason", "expected"),
    [(pb.FINISH_REASON_UNSPECIFIED, None), (pb.FINISH_REASON_STOP, "stop"), (pb.FINISH_REASON_LENGTH, "length"),
     (pb.FINISH_REASON_ABORT, "abort"), (pb.FINISH_REASON_ERROR, "error")],
)
def test_finish_reason_names(reason, expected):
    assert GenerationDelta.from_pb(pb.GenerateResponse(finish_reason=reason)).finish_reason == expected


def test_usage_absent_vs_zero():
    assert GenerationDelta.from_pb(pb.GenerateResponse()).usage is None
    zero = GenerationDelta.from_pb(pb.GenerateResponse(usage=pb.Usage()))
    assert zero.usage == {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}


def test_build_request_leaves_unset_params_unset():
    req = build_generate_request("Hi")
    assert req.WhichOneof("input") == "text" and req.text == "Hi"
    for name in ("max_tokens", "temperature", "top_p", "seed", "n", "logprobs"):
        assert not req.params.HasField(name), name
    req = build_generate_request(
        messages=[("user", "Hi"), {"role": "assistant", "content": "Yo"}],
        max_tokens=0, temperature=0.0, seed=0, stop="END", logprobs=0, request_id="x",
    )
    assert req.WhichOneof("input") == "messages"
    assert [(m.role, m.content) for m in req.messages.messages] == [("user", "Hi"), ("assistant", "Yo")]
    assert req.params.HasField("temperature") and req.params.temperature == 0.0
    assert req.params.HasField("max_tokens") and req.params.HasField("logprobs")
    assert list(req.params.stop) == ["END"]
    assert build_generate_request(token_ids=[1, 2]).token_ids.ids == [1, 2]
    with pytest.raises(ValueError):
        build_generate_request("Hi", token_ids=[1])
    with pytest.raises(ValueError):
        build_generate_request()


def test_build_request_carries_penalties_bias_min_p_and_min_tokens():
    default = build_generate_request("Hi").params
    assert not default.HasField("repetition_penalty") and not default.HasField("structured_output")
    assert (default.frequency_penalty, default.presence_penalty, default.min_p, default.min_tokens) == (0, 0, 0, 0)
    params = build_generate_request("Hi", repetition_penalty=1.25, frequency_penalty=0.5, presence_penalty=-1.5,
                                    min_p=0.25, logit_bias={17: -100.0, 3: 2.5}, min_tokens=4).params
    assert params.HasField("repetition_penalty") and params.repetition_penalty == 1.25
    assert (params.frequency_penalty, params.presence_penalty, params.min_p, params.min_tokens) == (0.5, -1.5, 0.25, 4)
    assert dict(params.logit_bias) == {17: -100.0, 3: 2.5}



def test_build_request_carries_bad_words_and_prompt_logprobs_and_reads_them_back():
    assert not build_generate_request("Hi").params.HasField("prompt_logprobs")
    params = build_generate_request("Hi", bad_words=["never", "ever"], prompt_logprobs=0).params
    assert list(params.bad_words) == ["never", "ever"] and params.HasField("prompt_logprobs")
    reply = pb.GenerateResponse(prompt_logprobs=[pb.TokenLogprobs(token_id=5, logprob=-0.5, top_token_ids=[7],
                                                                  top_logprobs=[-0.25], rank=2)])
    (got,) = GenerationDelta.from_pb(reply).prompt_logprobs
    assert (got.token_id, got.logprob, got.top_token_ids, got.top_logprobs, got.rank) == (5, -0.5, (7,), (-0.25,), 2)


@pytest.mark.parametrize(("kwargs", "kind", "spec"), [
    ({"json_schema": {"type": "object", "required": ["a"]}}, pb.STRUCTURED_OUTPUT_KIND_JSON_SCHEMA,
     {"type": "object", "required": ["a"]}),
    ({"json_schema": '{"type": "integer"}'}, pb.STRUCTURED_OUTPUT_KIND_JSON_SCHEMA, {"type": "integer"}),
    ({"json_object": True}, pb.STRUCTURED_OUTPUT_KIND_JSON_OBJECT, None),
    ({"regex": "[0-9]+"}, pb.STRUCTURED_OUTPUT_KIND_REGEX, "[0-9]+"),
    ({"choice": ("yes", "no")}, pb.STRUCTURED_OUTPUT_KIND_CHOICE, ["yes", "no"]),
    ({"grammar": 'root ::= "a"'}, pb.STRUCTURED_OUTPUT_KIND_GRAMMAR, 'root ::= "a"'),
])
def test_build_request_carries_one_structured_output(kwargs, kind, spec):
    so = build_generate_request(messages=[("user", "Hi")], **kwargs).params.structured_output
    assert so.kind == kind
    # JSON kinds carry JSON text; the server parses it (router/validation.py).
    if kind in (pb.STRUCTURED_OUTPUT_KIND_JSON_SCHEMA, pb.STRUCTURED_OUTPUT_KIND_CHOICE):
        assert json.loads(so.spec) == spec
    else:
        assert so.spec == (spec or "")


def test_build_request_refuses_two_structured_outputs():
    with pytest.raises(ValueError, match="at most one of json_schema, json_object, regex, choice or grammar"):
        build_generate_request("Hi", regex="a", choice=["a"])


class FakeGeneration(pb_grpc.GenerationServicer):
    """Streams canned responses; request_id picks the behaviour."""

    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []
        self.cancelled = asyncio.Event()
        self.sent = 0

    async def Generate(self, request, context):
        self.requests.append(request)
        rid = request.request_id
        if rid == "missing":
            await context.abort(grpc.StatusCode.NOT_FOUND, "model 'nope' is not served")
        if rid == "endless":
            try:
                while True:
                    self.sent += 1
                    yield pb.GenerateResponse(request_id=rid, text="x", token_ids=[7])
                    await asyncio.sleep(0.005)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if rid == "thinking":  # A chat whose reasoning the router split from its answer.
            yield pb.GenerateResponse(request_id=rid, reasoning_text="Let me see.")
            yield pb.GenerateResponse(request_id=rid, text="yes")
            yield pb.GenerateResponse(request_id=rid, finish_reason=pb.FINISH_REASON_STOP)
            return
        if rid == "broken":
            yield pb.GenerateResponse(request_id=rid, text="par")
            yield pb.GenerateResponse(request_id=rid, finish_reason=pb.FINISH_REASON_ERROR, error="worker died")
            return
        # Two samples, interleaved.
        for index, parts in ((0, ["Hel", "lo", "!"]), (1, ["Bye"])):
            for part in parts:
                yield pb.GenerateResponse(request_id=rid, index=index, text=part, token_ids=[len(part)])
        yield pb.GenerateResponse(request_id=rid, index=1, finish_reason=pb.FINISH_REASON_LENGTH)
        yield pb.GenerateResponse(
            request_id=rid, index=0, finish_reason=pb.FINISH_REASON_STOP, usage=pb.Usage(prompt_tokens=2, completion_tokens=4)
        )

    async def Tokenize(self, request, context):
        if request.WhichOneof("input") == "messages":
            prompt = "".join(f"<{m.role}>{m.content}" for m in request.messages.messages)
        else:
            prompt = request.text
        ids = [ord(c) for c in prompt]
        if request.HasField("add_special_tokens") and not request.add_special_tokens:
            return pb.TokenizeResponse(token_ids=ids, count=len(ids), prompt=prompt)
        return pb.TokenizeResponse(token_ids=[1, *ids], count=len(ids) + 1, prompt=prompt)

    async def GetModelInfo(self, request, context):
        return pb.ModelInfo(model="fake", max_model_len=128, vocab_size=100, eos_token_ids=[2, 3],
                            dtype="float32", block_size=16, num_kv_blocks=8, tensor_parallel_size=1,
                            bos_token_id=1)


# NOTE: the project default puts async fixtures on the session loop; the server must
# live on the loop of the test that talks to it.
@pytest_asyncio.fixture(loop_scope="function")
async def fake_server(credentials):
    """The fake behind what the router's public port has: TLS (the router's certificate)
    and the API key interceptor. Yields the servicer and `connect(**client_kwargs)`."""
    security = SecurityOptions(tls_cert=credentials.cert("router"), tls_key=credentials.key("router"),
                               tls_ca=credentials.ca)
    server = ServiceServer(pb.DESCRIPTOR.services_by_name["Generation"].full_name, "127.0.0.1", 0, security,
                           client_auth=False, interceptors=[ApiKeyInterceptor(ApiKeys([credentials.api_key]))])
    servicer = FakeGeneration()
    pb_grpc.add_GenerationServicer_to_server(servicer, server.server)
    await server.start()
    await server.set_serving(True)

    def connect(**kwargs) -> LLMServeClient:
        kwargs = {"tls_ca": credentials.ca, "api_key": credentials.api_key, **kwargs}
        return LLMServeClient(f"localhost:{server.port}", **kwargs)

    try:
        yield servicer, connect
    finally:
        await server.stop(None)


async def test_generate_streams_and_complete_collects_sample_0(fake_server):
    servicer, connect = fake_server
    async with connect() as client:
        deltas = [d async for d in client.generate("Hi", n=2, max_tokens=4, request_id="r")]
        assert [(d.index, d.text, d.finish_reason) for d in deltas] == [
            (0, "Hel", None), (0, "lo", None), (0, "!", None), (1, "Bye", None),
            (1, "", "length"), (0, "", "stop"),
        ]
        assert deltas[-1].usage == {"prompt_tokens": 2, "completion_tokens": 4, "cached_tokens": 0}
        assert await client.complete("Hi", request_id="r") == "Hello!"
    assert servicer.requests[0].params.n == 2 and servicer.requests[0].params.max_tokens == 4
    assert servicer.requests[0].text == "Hi"


async def test_generate_sends_the_sampling_fields_and_returns_reasoning(fake_server):
    servicer, connect = fake_server
    async with connect() as client:
        deltas = [d async for d in client.generate(
            messages=[("user", "Hi")], request_id="thinking", chat_template_kwargs={"enable_thinking": True},
            repetition_penalty=1.1, frequency_penalty=0.25, presence_penalty=0.5, min_p=0.05,
            logit_bias={42: 5.0}, min_tokens=2, choice=["yes", "no"])]
    params = servicer.requests[0].params
    assert (params.repetition_penalty, params.frequency_penalty, params.presence_penalty, params.min_tokens) == \
        pytest.approx((1.1, 0.25, 0.5, 2))
    assert params.min_p == pytest.approx(0.05) and dict(params.logit_bias) == {42: 5.0}
    assert params.structured_output == pb.StructuredOutput(kind=pb.STRUCTURED_OUTPUT_KIND_CHOICE, spec='["yes", "no"]')
    assert dict(servicer.requests[0].messages.chat_template_kwargs) == {"enable_thinking": "true"}
    assert [(d.reasoning_text, d.text) for d in deltas] == [("Let me see.", ""), ("", "yes"), ("", "")]


async def test_in_band_error_raises_from_complete(fake_server):
    _, connect = fake_server
    async with connect() as client:
        deltas = [d async for d in client.generate("Hi", request_id="broken")]
        assert (deltas[-1].finish_reason, deltas[-1].error) == ("error", "worker died")
        with pytest.raises(GenerationError, match="worker died"):
            await client.complete("Hi", request_id="broken")


async def test_rpc_error_keeps_status_code(fake_server):
    _, connect = fake_server
    async with connect() as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in client.generate("Hi", request_id="missing"):
                pass
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "nope" in err.value.details()


async def test_break_cancels_the_call_on_the_server(fake_server):
    servicer, connect = fake_server
    async with connect() as client:
        gen = client.generate("Hi", request_id="endless")
        got = 0
        async for delta in gen:
            assert delta.text == "x"
            got += 1
            if got == 3:
                break
        await gen.aclose()  # What the event loop does when the generator is collected.
        await asyncio.wait_for(servicer.cancelled.wait(), timeout=5)
        sent = servicer.sent
        await asyncio.sleep(0.05)
        assert servicer.sent == sent  # The server stopped streaming.


async def test_break_without_aclose_cancels_too(fake_server):
    servicer, connect = fake_server
    async with connect() as client:
        async for _ in client.generate("Hi", request_id="endless"):
            break
        # The generator is garbage now; asyncio's finalizer closes it.
        await asyncio.wait_for(servicer.cancelled.wait(), timeout=5)


async def test_task_cancel_cancels_the_call(fake_server):
    servicer, connect = fake_server
    async with connect() as client:
        started = asyncio.Event()

        async def consume():
            async for _ in client.generate("Hi", request_id="endless"):
                started.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), timeout=5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(servicer.cancelled.wait(), timeout=5)


async def test_tokenize_model_info_health(fake_server):
    _, connect = fake_server
    async with connect(timeout=5) as client:
        result = await client.tokenize("ab")
        assert (result.token_ids, result.count, result.prompt) == ([1, 97, 98], 3, "ab")
        result = await client.tokenize("ab", add_special_tokens=False)
        assert result.token_ids == [97, 98]
        result = await client.tokenize(messages=[("user", "a")])
        assert result.prompt == "<user>a"
        info = await client.model_info()
        assert info == ModelInfo(model="fake", max_model_len=128, vocab_size=100, eos_token_ids=(2, 3),
                                 bos_token_id=1, dtype="float32", block_size=16, num_kv_blocks=8,
                                 tensor_parallel_size=1)
        assert await client.health() == "SERVING"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.health("no-such-service")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
