"""Tool calling against the real three-process cluster serving the embedded model, with
the official `openai` SDK (issue #33, item 4): tool_choice "required" and a named
function yield calls whose arguments validate against their tool's schema (constrained
decoding), streamed and not; a round trip (call, tool result, answer); refusals name
the field; the gRPC API, raw and through llmserve.client, returns the same calls. The
cluster has no --tool-call-parser
(SmolLM2 has no tool format): auto is refused, by name."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from llmserve.client import collect_tool_calls
from llmserve.v1 import generation_pb2 as pb
from llmserve.v1 import generation_pb2_grpc

from .test_openai_api import MODEL, sdk

# Bounded schemas (enums, small integers): a greedy 135M model finishes each in a few tokens.
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
                                         "unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "add", "description": "Adds two numbers", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "set_alarm", "description": "Sets an alarm", "parameters": {
        "type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                         "on": {"type": "boolean"}},
        "required": ["hour", "on"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
# SmolLM2's template does not show tools to the model; the system turn's example keeps
# its constrained JSON compact (it pads JSON with whitespace otherwise: slower).
ASK = [{"role": "system", "content": 'Answer with compact JSON on one line, e.g. [{"name":"add","arguments":{"a":1}}]'},
       {"role": "user", "content": "What is the weather in Paris?"}]
SETTINGS = {"model": MODEL, "tools": TOOLS, "temperature": 0.0, "max_tokens": 96}


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.slow
async def test_required_calls_validate_against_their_tools_streamed_and_not(cluster):
    async with sdk(cluster) as client:
        reply = await client.chat.completions.create(messages=ASK, tool_choice="required", parallel_tool_calls=False,
                                                     **SETTINGS)
        stream = await client.chat.completions.create(messages=ASK, tool_choice="required",
                                                      parallel_tool_calls=False, stream=True, **SETTINGS)
        chunks = [chunk async for chunk in stream]
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check_calls(choice.message.tool_calls)
    assert len(choice.message.tool_calls) == 1  # parallel_tool_calls false.
    # Streamed: the same greedy call, named in its first piece, its arguments in pieces.
    pieces = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
    assert pieces[0].function.name == choice.message.tool_calls[0].function.name
    assert all(p.id is None and p.function.name is None for p in pieces[1:]) and len(pieces) > 1
    assert "".join(p.function.arguments for p in pieces) == choice.message.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.slow
async def test_round_trip_named_call_result_answer(cluster):
    async with sdk(cluster) as client:
        first = await client.chat.completions.create(
            messages=ASK, tool_choice={"type": "function", "function": {"name": "set_alarm"}}, **SETTINGS)
        (call,) = first.choices[0].message.tool_calls
        assert call.function.name == "set_alarm" and first.choices[0].finish_reason == "tool_calls"
        _check_calls([call])
        history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "The alarm is set."}]
        answer = await client.chat.completions.create(messages=history, tool_choice="none",
                                                      **{**SETTINGS, "max_tokens": 8})
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason in ("stop", "length")


@pytest.mark.slow
@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS}, "tool_choice"),  # auto (the default): this router has no --tool-call-parser.
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
])
async def test_refused_tool_fields_name_themselves(cluster, body, param):
    async with sdk(cluster) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=body)
    assert refused.value.status_code == 400 and param in refused.value.message


@pytest.mark.slow
async def test_grpc_streams_the_same_calls(cluster):
    request = pb.GenerateRequest(
        messages=pb.ChatMessages(
            messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in ASK],
            tools=[pb.Tool(name=t["function"]["name"], description=t["function"]["description"],
                           parameters=json.dumps(t["function"]["parameters"])) for t in TOOLS],
            tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED), parallel_tool_calls=False),
        params=pb.SamplingParams(temperature=0.0, max_tokens=96))
    async with cluster.channel() as channel:
        responses = [r async for r in generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60)]
    pieces = [c for r in responses for c in r.tool_calls]
    assert pieces[0].id.startswith("call_") and all(not p.id and not p.name for p in pieces[1:])
    jsonschema.validate(json.loads("".join(p.arguments for p in pieces)), SCHEMAS[pieces[0].name])
    assert responses[-1].finish_reason == pb.FINISH_REASON_TOOL_CALLS and not "".join(r.text for r in responses)


@pytest.mark.slow
async def test_python_client_makes_the_sdks_calls_and_sends_a_result_back(cluster):
    """llmserve.client with the SDK's own tool definitions: required gives the call the
    SDK gets for the same greedy request, a named function its call, and a collected call
    goes back in an assistant turn followed by its result."""
    async with sdk(cluster) as openai_client:
        reference = await openai_client.chat.completions.create(messages=ASK, tool_choice="required",
                                                                parallel_tool_calls=False, **SETTINGS)
    greedy = {"tools": TOOLS, "temperature": 0.0, "max_tokens": 96}
    async with cluster.client() as client:
        required = [d async for d in client.generate(messages=ASK, tool_choice="required", parallel_tool_calls=False,
                                                     **greedy)]
        named = [d async for d in client.generate(
            messages=ASK, tool_choice={"type": "function", "function": {"name": "set_alarm"}}, **greedy)]
        (alarm,) = collect_tool_calls(named)
        history = [*ASK, {"role": "assistant", "tool_calls": [alarm]},
                   {"role": "tool", "tool_call_id": alarm.id, "content": "The alarm is set."}]
        answer = [d async for d in client.generate(messages=history, tool_choice="none", **{**greedy, "max_tokens": 8})]
    (expected,) = reference.choices[0].message.tool_calls
    (call,) = collect_tool_calls(required)
    assert (call.name, call.arguments) == (expected.function.name, expected.function.arguments)
    assert call.id.startswith("call_") and required[-1].finish_reason == "tool_calls"
    assert not "".join(d.text for d in required)
    assert alarm.name == "set_alarm" and named[-1].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(alarm.arguments), SCHEMAS["set_alarm"])
    assert "".join(d.text for d in answer) and not collect_tool_calls(answer)
    assert answer[-1].finish_reason in ("stop", "length")
