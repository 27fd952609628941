"""llmserve.client against hand-built messages and an in-test fake Generation server."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import pytest_asyncio

from google.protobuf.descriptor import FieldDescriptor

from llmserve.client import (
    GenerateOptions,
    GenerationDelta,
    GenerationError,
    LLMServeClient,
    ModelInfo,
    ToolCall,
    build_generate_request,
    collect_tool_calls,
    tool_pb,
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
     (pb.FINISH_REASON_ABORT, "abort"), (pb.FINISH_REASON_ERROR, "error"),
     (pb.FINISH_REASON_TOOL_CALLS, "tool_calls")],
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


# A value unlike the default for each scalar type of a SamplingParams field (floats
# exact in float32, as the wire carries them).
SCALARS = {FieldDescriptor.TYPE_INT32: 7, FieldDescriptor.TYPE_INT64: -(2**40), FieldDescriptor.TYPE_FLOAT: 0.5,
           FieldDescriptor.TYPE_BOOL: True, FieldDescriptor.TYPE_STRING: "w"}
# The fields the client spells its own way (structured_output: one keyword per kind, each
# tested above): its keywords, and what the field then holds.
SPELLED_OTHERWISE = {"structured_output": ({"regex": "[a-z]+"},
                                           pb.StructuredOutput(kind=pb.STRUCTURED_OUTPUT_KIND_REGEX, spec="[a-z]+"))}


def _client_keywords(field: FieldDescriptor) -> tuple[dict, object]:
    """The client keywords that set `field`, and the value it then holds: a field of a
    new type (KeyError here) or a new name (TypeError from the client) fails the test."""
    if field.name in SPELLED_OTHERWISE:
        return SPELLED_OTHERWISE[field.name]
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key, value = (field.message_type.fields_by_name[name].type for name in ("key", "value"))
        wanted = {SCALARS[key]: SCALARS[value]}
    elif field.is_repeated:
        wanted = [SCALARS[field.type]] * 2
    else:
        wanted = SCALARS[field.type]
    return {field.name: wanted}, wanted


@pytest.mark.parametrize("field", list(pb.SamplingParams.DESCRIPTOR.fields), ids=lambda field: field.name)
def test_every_sampling_params_field_is_reachable_from_the_client(field):
    keywords, wanted = _client_keywords(field)
    expected = pb.SamplingParams(**{field.name: wanted})  # Just this field, set (optional ones: present).
    assert build_generate_request("Hi", **keywords).params == expected
    assert build_generate_request("Hi", options=GenerateOptions(**keywords)).params == expected


def test_an_options_record_and_keywords_build_the_same_request():
    options = GenerateOptions(max_tokens=4, temperature=0.0, stop="END", request_id="r")
    assert build_generate_request("Hi", options=options) == build_generate_request(
        "Hi", max_tokens=4, temperature=0.0, stop="END", request_id="r")
    assert build_generate_request("Hi", options=options, max_tokens=9).params.max_tokens == 9  # Keywords win.
    assert options.max_tokens == 4
    with pytest.raises(TypeError, match="max_token"):
        build_generate_request("Hi", max_token=4)


ADD = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {"name": "add", "description": "Adds one", "parameters": ADD}


def test_a_chat_request_carries_every_chat_field():
    earlier = ToolCall(id="call_1", name="add", arguments='{"a": 1}')  # As collect_tool_calls returns it.
    request = build_generate_request(
        messages=[("system", "Be brief"), {"role": "assistant", "tool_calls": [earlier]},
                  {"role": "tool", "tool_call_id": "call_1", "name": "add", "content": "2"}],
        chat_template_kwargs={"enable_thinking": False}, tools=[{**TOOL, "parameters": json.dumps(ADD)}],
        tool_choice="required", parallel_tool_calls=False)
    expected = pb.ChatMessages(
        messages=[pb.ChatMessage(role="system", content="Be brief"),
                  pb.ChatMessage(role="assistant",
                                 tool_calls=[pb.ToolCall(id="call_1", name="add", arguments='{"a": 1}')]),
                  pb.ChatMessage(role="tool", content="2", tool_call_id="call_1", name="add")],
        chat_template_kwargs={"enable_thinking": "false"},
        tools=[pb.Tool(name="add", description="Adds one", parameters=json.dumps(ADD))],
        tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED), parallel_tool_calls=False)
    assert request.messages == expected
    # The request above sets every field of a chat and of its turns: a new one fails here.
    assert {f.name for f, _ in expected.ListFields()} == set(pb.ChatMessages.DESCRIPTOR.fields_by_name)
    turn_fields = {f.name for m in expected.messages for f, _ in m.ListFields()}
    assert turn_fields == set(pb.ChatMessage.DESCRIPTOR.fields_by_name)


@pytest.mark.parametrize("tool", [
    TOOL,
    {"type": "function", "function": {**TOOL, "strict": True}},  # As the OpenAI API writes it.
    {**TOOL, "parameters": json.dumps(ADD)},
])
def test_a_tool_is_a_function_definition(tool):
    got = tool_pb(tool)
    assert (got.name, got.description, json.loads(got.parameters)) == ("add", "Adds one", ADD)


@pytest.mark.parametrize(("choice", "expected"), [
    ("none", pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NONE)),
    ("auto", pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_AUTO)),
    ({"type": "function", "function": {"name": "add"}}, pb.ToolChoice(function_name="add")),
])
def test_tool_choice_modes_and_a_named_function(choice, expected):
    request = build_generate_request(messages=[("user", "1+1?")], tools=[{"name": "add"}], tool_choice=choice)
    assert request.messages.tool_choice == expected and request.messages.tools[0] == pb.Tool(name="add")
    assert not request.messages.HasField("parallel_tool_calls")  # Unset: the server's default (true).


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"tools": [{**TOOL, "returns": {}}]}, "tools function: 'returns' not supported"),
    ({"tools": [{"type": "retrieval", "function": TOOL}]}, "tools: type 'retrieval'"),
    ({"tool_choice": "any"}, "tool_choice: 'any'"),
    ({"tool_choice": {"type": "function", "function": {"name": "add", "arguments": "{}"}}},
     "tool_choice function: 'arguments' not supported"),
    ({"messages": [{"role": "user", "content": "Hi", "audio": None}]}, "messages: 'audio' not supported"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "add", "arguments": "{}", "output": "2"}}]}]}, "tool_calls function: 'output' not supported"),
])
def test_what_the_api_cannot_carry_is_refused_by_name(kwargs, match):
    kwargs = {"messages": [("user", "Hi")], **kwargs}
    with pytest.raises(ValueError, match=match):
        build_generate_request(**kwargs)


def test_chat_fields_without_messages_are_refused_by_name():
    with pytest.raises(ValueError, match="tools, parallel_tool_calls: for chat messages only"):
        build_generate_request("Hi", tools=[TOOL], parallel_tool_calls=False)
    with pytest.raises(ValueError, match="chat_template_kwargs: for chat messages only"):
        build_generate_request(token_ids=[1], chat_template_kwargs={"enable_thinking": False})
    assert build_generate_request("Hi", tools=[]).text == "Hi"  # Empty: nothing asked for.


def test_tool_call_pieces_join_per_sample():
    responses = [
        pb.GenerateResponse(index=0, tool_calls=[pb.ToolCallDelta(index=0, id="call_a", name="add",
                                                                  arguments='{"a": ')]),
        pb.GenerateResponse(index=1, tool_calls=[pb.ToolCallDelta(index=0, id="call_z", name="now")]),
        pb.GenerateResponse(index=0, tool_calls=[pb.ToolCallDelta(index=0, arguments="1}"),
                                                 pb.ToolCallDelta(index=1, id="call_b", name="now", arguments="{}")]),
        pb.GenerateResponse(index=0, finish_reason=pb.FINISH_REASON_TOOL_CALLS),
    ]
    deltas = [GenerationDelta.from_pb(r) for r in responses]
    assert collect_tool_calls(deltas) == [ToolCall("call_a", "add", '{"a": 1}'), ToolCall("call_b", "now", "{}")]
    assert collect_tool_calls(deltas, index=1) == [ToolCall("call_z", "now", "")]
    assert deltas[-1].finish_reason == "tool_calls" and not collect_tool_calls(deltas[-1:])


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
        if rid == "tools":  # A call of `add`, its arguments in two pieces.
            yield pb.GenerateResponse(request_id=rid, tool_calls=[pb.ToolCallDelta(id="call_1", name="add",
                                                                                 arguments='{"a": ')])
            yield pb.GenerateResponse(request_id=rid, tool_calls=[pb.ToolCallDelta(arguments="1}")])
            yield pb.GenerateResponse(request_id=rid, finish_reason=pb.FINISH_REASON_TOOL_CALLS)
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


async def test_generate_sends_tools_and_returns_the_calls(fake_server):
    servicer, connect = fake_server
    async with connect() as client:
        deltas = [d async for d in client.generate(
            messages=[("user", "1+1?")], request_id="tools", tools=[TOOL],
            tool_choice={"type": "function", "function": {"name": "add"}}, options=GenerateOptions(temperature=0))]
    chat = servicer.requests[0].messages
    assert [t.name for t in chat.tools] == ["add"] and chat.tool_choice == pb.ToolChoice(function_name="add")
    assert servicer.requests[0].params.HasField("temperature")
    assert collect_tool_calls(deltas) == [ToolCall("call_1", "add", '{"a": 1}')]
    assert deltas[-1].finish_reason == "tool_calls"


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
