"""Every field a client sends is honoured or refused (issue #33, item 1).

Walks the official `openai` SDK's request parameter types (chat and completions): each
parameter is honoured (HONOURED below: sent, it reaches what the router runs), ignored
because it only matters to OpenAI's billing or logging (protocol.IGNORED: accepted), or
refused with a 400 naming it. Fields the SDK does not know (extensions, typos) are
honoured extensions or refused as unknown. The gRPC API refuses fields of a newer API
version (unknown field numbers) with INVALID_ARGUMENT. In process over ASGI: refusals
come before the readiness check, so a draining router (503) shows a field was accepted.
docs/guide/openai.md's table has a row for every one of these fields, saying what the
server does with it.
"""

from __future__ import annotations

import re
import typing
from pathlib import Path

import grpc
import httpx2
import openai
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from llmserve.contract.sampling import StructuredOutput
from llmserve.router.openai.protocol import (
    CHAT_ONLY,
    IGNORED,
    NOT_SUPPORTED,
    ChatCompletionRequest,
    CompletionRequest,
)
from llmserve.router.validation import RequestError, check_known_fields
from llmserve.v1 import generation_pb2 as pb

from .test_openai_http import KEY, draining, http

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
COMPLETION = {"model": "m", "prompt": "Hi"}


def _sdk_params(module) -> set[str]:
    """Every parameter of the SDK's create() body (the streaming variants add `stream`)."""
    return {name for cls in (module.CompletionCreateParamsStreaming, module.CompletionCreateParamsNonStreaming)
            for name in typing.get_type_hints(cls)}


def _sampling(body):
    return body.sampling()[0]


# Honoured: a value unlike the default, and what it becomes in what the router runs.
CHAT_HONOURED = {
    "model": ("other", lambda b: b.to_pb("r").model == "other"),
    "messages": ([{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "U"}]}],
                 lambda b: [(m.role, m.content) for m in b.to_pb("r").messages.messages] == [("system", "S"),
                                                                                            ("user", "U")]),
    "frequency_penalty": (0.5, lambda b: _sampling(b).frequency_penalty == 0.5),
    "presence_penalty": (-0.5, lambda b: _sampling(b).presence_penalty == -0.5),
    "logit_bias": ({"5": 10, "2": -3}, lambda b: _sampling(b).logit_bias == ((2, -3.0), (5, 10.0))),
    "logprobs": (True, lambda b: _sampling(b).logprobs == 0),
    "top_logprobs": (3, lambda b: _sampling(b).logprobs == 3),  # Sent with logprobs: true.
    "max_completion_tokens": (5, lambda b: _sampling(b).max_tokens == 5),
    "max_tokens": (6, lambda b: _sampling(b).max_tokens == 6),
    "n": (2, lambda b: b.sampling()[1] == 2),
    "seed": (7, lambda b: _sampling(b).seed == 7),
    "stop": ("END", lambda b: _sampling(b).stop == ("END",)),
    "stream": (True, lambda b: b.stream),
    "stream_options": ({"include_usage": True}, lambda b: b.include_usage),
    "temperature": (0.5, lambda b: _sampling(b).temperature == 0.5),
    "top_p": (0.5, lambda b: _sampling(b).top_p == 0.5),
    # Structured output (test_structured_output.py: what the engine makes of it).
    "response_format": ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"},
                                                                "strict": True}},
                        lambda b: _sampling(b).structured_output == StructuredOutput("json_schema",
                                                                                     '{"type": "integer"}')),
    # Extensions (not in the SDK's types).
    "guided_regex": ("[ab]+", lambda b: _sampling(b).structured_output == StructuredOutput("regex", "[ab]+")),
    "guided_choice": (["x", "y"], lambda b: _sampling(b).structured_output == StructuredOutput("choice", '["x", "y"]')),
    "guided_grammar": ('root ::= "a"',
                       lambda b: _sampling(b).structured_output == StructuredOutput("grammar", 'root ::= "a"')),
    "bad_words": (["never", "ever"], lambda b: _sampling(b).bad_words == ("never", "ever")),
    "prompt_logprobs": (2, lambda b: _sampling(b).prompt_logprobs == 2),
    # An extension (not in the SDK's types): each value as JSON text (test_reasoning.py renders them).
    "chat_template_kwargs": ({"enable_thinking": False}, lambda b: dict(
        b.to_pb("r").messages.chat_template_kwargs) == {"enable_thinking": "false"}),
    # Tool calling (test_tool_calls.py: what the router makes of them).
    "tools": ([{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}],
              lambda b: [(t.name, t.description, t.parameters) for t in b.to_pb("r").messages.tools]
              == [("f", "d", '{"type": "object"}')]),
    "tool_choice": ({"type": "function", "function": {"name": "f"}},
                    lambda b: b.to_pb("r").messages.tool_choice.function_name == "f"),
    "parallel_tool_calls": (False, lambda b: b.to_pb("r").messages.HasField("parallel_tool_calls")
                            and not b.to_pb("r").messages.parallel_tool_calls),
}
COMPLETION_HONOURED = {
    **{name: CHAT_HONOURED[name] for name in ("frequency_penalty", "presence_penalty", "logit_bias", "max_tokens",
                                               "n", "seed", "stop", "stream", "stream_options", "temperature",
                                               "top_p", "response_format", "guided_regex", "guided_choice",
                                               "guided_grammar", "bad_words", "prompt_logprobs")},
    "model": ("other", lambda b: b.to_pb(["r"])[0].model == "other"),
    "prompt": ([1, 2, 3], lambda b: list(b.to_pb(["r"])[0].token_ids.ids) == [1, 2, 3]),
    "logprobs": (2, lambda b: _sampling(b).logprobs == 2),
    "echo": (True, lambda b: b.echo),  # What it renders: test_echo_puts_the_prompt_before_each_choice.
}
# echo with logprobs asks for the prompt's logprobs (the larger k of the two).
ECHO_LOGPROBS = [({"echo": True, "logprobs": 2}, 2), ({"echo": True, "logprobs": 1, "prompt_logprobs": 3}, 3),
                 ({"echo": False, "logprobs": 2}, None), ({"echo": True}, None)]


@pytest.mark.parametrize("fields,prompt_logprobs", ECHO_LOGPROBS)
def test_echo_with_logprobs_asks_for_the_prompt_logprobs(fields, prompt_logprobs):
    body = CompletionRequest(**COMPLETION, **fields)
    body.check_fields()
    assert _sampling(body).prompt_logprobs == prompt_logprobs
# Honoured with some values only: these bodies are refused, naming the key.
COMPLETION_REFUSED_VALUES = {"suffix": {"suffix": "and then"},
                             "best_of": {"best_of": 3}}


@pytest.mark.parametrize("module,honoured,refused_values", [
    (chat_params, CHAT_HONOURED, {}),
    (completion_params, COMPLETION_HONOURED, COMPLETION_REFUSED_VALUES),
], ids=["chat", "completions"])
def test_every_sdk_parameter_is_classified(module, honoured, refused_values):
    params = _sdk_params(module)
    classified = set(honoured) | IGNORED | set(NOT_SUPPORTED) | set(CHAT_ONLY) | set(refused_values)
    assert params - classified == set(), "a parameter of the openai SDK that this test does not classify"
    assert not set(honoured) & (IGNORED | set(NOT_SUPPORTED))


def _extra(name: str, honoured: dict) -> dict:
    return {"logprobs": True} if name == "top_logprobs" and honoured is CHAT_HONOURED else {}


@pytest.mark.parametrize("model,base,honoured", [
    (ChatCompletionRequest, CHAT, CHAT_HONOURED), (CompletionRequest, COMPLETION, COMPLETION_HONOURED),
], ids=["chat", "completions"])
def test_each_honoured_parameter_reaches_the_request(model, base, honoured):
    for name, (value, reaches) in honoured.items():
        body = model(**{**base, name: value, **_extra(name, honoured)})
        body.check_fields()
        assert reaches(body), name
        assert not reaches(model(**base)), f"{name}: its probe holds without it"


@pytest.mark.parametrize("path,base,honoured", [
    ("/v1/chat/completions", CHAT, CHAT_HONOURED), ("/v1/completions", COMPLETION, COMPLETION_HONOURED),
], ids=["chat", "completions"])
async def test_honoured_and_ignored_parameters_pass_the_front_door(path, base, honoured):
    # 503 from a draining router: the body passed every check a field can fail.
    async with http(draining()) as client:
        for name, (value, _) in honoured.items():
            reply = await client.post(path, json={**base, name: value, **_extra(name, honoured)})
            assert reply.status_code == 503, (name, reply.json())
        for name in IGNORED:
            reply = await client.post(path, json={**base, name: {"k": "v"} if name == "metadata" else "x"})
            assert reply.status_code == 503, (name, reply.json())


@pytest.mark.parametrize("path,base,refused", [
    ("/v1/chat/completions", CHAT, {name: {name: {"some": "value"}} for name in NOT_SUPPORTED}),
    ("/v1/completions", COMPLETION, {**{name: {name: {"some": "value"}} for name in NOT_SUPPORTED | CHAT_ONLY},
                                     **COMPLETION_REFUSED_VALUES}),
], ids=["chat", "completions"])
async def test_refused_parameters_are_400_naming_them(path, base, refused):
    async with http(draining()) as client:
        for name, fields in refused.items():
            reply = await client.post(path, json={**base, **fields})
            error = reply.json()["error"]
            assert reply.status_code == 400, name
            assert error["param"] == name and error["message"].startswith(f"{name}:"), error
            assert error["type"] == "invalid_request_error"
        # null asks for nothing: accepted.
        assert (await client.post(path, json={**base, "tools": None, "functions": None})).status_code == 503


@pytest.mark.parametrize("body,param", [
    ({**CHAT, "frobnicate": 1}, "frobnicate"),
    ({**CHAT, "guided_json": {"type": "object"}}, "guided_json"),
    ({**CHAT, "bad_word": ["x"]}, "bad_word"),
    ({"model": "m", "messages": [{"role": "assistant", "content": "x", "function_call": {"name": "f"}}]},
     "messages.0.function_call"),
    ({"model": "m", "messages": [{"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "f"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f", "strict": True, "examples": []}}]},
     "tools.0.function.examples"),
    ({**CHAT, "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": True}},
     "stream_options.include_obfuscation"),
])
async def test_unknown_fields_anywhere_are_400_naming_them(body, param):
    async with http(draining()) as client:
        reply = await client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.json()
    assert param in reply.json()["error"]["message"]


async def test_the_sdk_sees_a_bad_request_naming_the_field():
    transport = httpx2.ASGITransport(app=http(draining())._transport.app)
    client = openai.AsyncOpenAI(base_url="http://router/v1", api_key=KEY, max_retries=0,
                                http_client=httpx2.AsyncClient(transport=transport))
    functions = [{"name": "f", "parameters": {"type": "object"}}]
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                             functions=functions)
    assert refused.value.param == "functions" and "use tools and tool_choice" in refused.value.message
    with pytest.raises(openai.BadRequestError) as unknown:
        await client.completions.create(model="m", prompt="x", extra_body={"typo_penalty": 1})
    assert unknown.value.param == "typo_penalty"


def test_grpc_refuses_fields_of_a_newer_api_naming_them():
    # Field 100 of SamplingParams (a varint), as a newer client would send it.
    raw = pb.SamplingParams(top_k=3).SerializeToString() + bytes([0xA0, 0x06, 0x05])
    request = pb.GenerateRequest(text="x", params=pb.SamplingParams.FromString(raw))
    request = pb.GenerateRequest.FromString(request.SerializeToString())
    with pytest.raises(RequestError) as refused:
        check_known_fields(request)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "params has field number(s) [100] of llmserve.v1.SamplingParams" in refused.value.message
    chat = pb.ChatMessage.FromString(pb.ChatMessage(role="user").SerializeToString() + bytes([0xA0, 0x06, 0x01]))
    with pytest.raises(RequestError, match=r"messages.messages\[0\] has field number\(s\) \[100\]"):
        check_known_fields(pb.GenerateRequest(messages=pb.ChatMessages(messages=[chat])))
    check_known_fields(pb.GenerateRequest(text="x", params=pb.SamplingParams(logit_bias={5: 1.0})))  # Known: fine.


def test_echo_puts_the_prompt_before_each_choice():
    from llmserve.contract.outputs import FinishReason
    from llmserve.router.openai.render import Renderer
    from llmserve.router.sample_stream import SampleDelta

    prompts = ["Hello", "Bye"]
    renderer = Renderer(chat=False, model="m", response_id="c", n=2, token_text=str, prompt_text=prompts.__getitem__)
    delta = SampleDelta(index=1, text=" there", token_ids=[5], logprobs=[], finish_reason=FinishReason.NONE)
    assert renderer.chunk(1, delta, first=True, with_logprobs=False)["choices"][0]["text"] == "Bye there"
    assert renderer.chunk(1, delta, first=False, with_logprobs=False)["choices"][0]["text"] == " there"
    whole = renderer.completion({0: [delta], 3: [delta]}, [], with_logprobs=False)
    assert [c["text"] for c in whole["choices"]] == ["Hello there", "Bye there"]


def test_echo_with_logprobs_and_prompt_logprobs_render_the_prompt_first():
    from llmserve.contract.outputs import FinishReason, TokenLogprobs
    from llmserve.router.openai.render import Renderer
    from llmserve.router.sample_stream import SampleDelta

    texts = {1: "A", 2: "bc", 3: " d", 9: "!"}
    prompt = [TokenLogprobs(2, -1.5, (3, 2), (-0.5, -1.5), 2), TokenLogprobs(3, -0.25, (3, 7), (-0.25, -2.0), 1)]
    first = SampleDelta(index=0, text="!", token_ids=[9], logprobs=[TokenLogprobs(9, -0.75, (9,), (-0.75,), 1)],
                        finish_reason=FinishReason.NONE, prompt_token_ids=[1, 2, 3], prompt_logprobs=prompt)
    later = SampleDelta(index=0, text="!", token_ids=[9], logprobs=[TokenLogprobs(9, -0.5, (9,), (-0.5,), 1)],
                        finish_reason=FinishReason.LENGTH)

    def renderer():
        return Renderer(chat=False, model="m", response_id="c", n=1, token_text=texts.__getitem__,
                        prompt_text=lambda i: "Abc d", prompt_logprobs=1, echo_logprobs=1)

    whole = renderer().completion({0: [first, later]}, [], with_logprobs=True)["choices"][0]
    assert whole["text"] == "Abc d!!"
    assert whole["logprobs"] == {"tokens": ["A", "bc", " d", "!", "!"],
                                 "token_logprobs": [None, -1.5, -0.25, -0.75, -0.5],
                                 "top_logprobs": [None, {" d": -0.5}, {" d": -0.25}, {"!": -0.75}, {"!": -0.5}],
                                 "text_offset": [0, 1, 3, 5, 6]}
    assert whole["prompt_logprobs"] == [None, {"2": {"logprob": -1.5, "rank": 2, "decoded_token": "bc"},
                                               "3": {"logprob": -0.5, "rank": 1, "decoded_token": " d"}},
                                        {"3": {"logprob": -0.25, "rank": 1, "decoded_token": " d"}}]
    streamed = renderer()  # The same, chunk by chunk: the prompt's part in the first chunk only.
    chunks = [streamed.chunk(0, first, True, True)["choices"][0], streamed.chunk(0, later, False, True)["choices"][0]]
    assert chunks[0]["logprobs"]["tokens"] == ["A", "bc", " d", "!"] and chunks[1]["logprobs"]["text_offset"] == [6]
    assert chunks[0]["prompt_logprobs"] == whole["prompt_logprobs"] and "prompt_logprobs" not in chunks[1]


# --- docs/guide/openai.md's table of every request field ------------------------------

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "openai.md"


def _field_table(heading: str) -> dict[str, tuple[str, str]]:
    """The rows `| `field` | status | what it does |` under `### {heading}` of the guide's
    "Every request field" section: field -> (status, what)."""
    section = GUIDE.read_text().split("## Every request field and what it does", 1)[1].split("\n## ", 1)[0]
    table = section.split(f"### {heading}", 1)[1].split("\n### ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| ([\w ]+) \| (.+) \|$", table, flags=re.MULTILINE)
    names = [name for name, _, _ in rows]
    assert len(names) == len(set(names)), f"{heading}: a field with two rows"
    return {name: (status, what) for name, status, what in rows}


@pytest.mark.parametrize("heading,module,model", [
    ("Chat completions", chat_params, ChatCompletionRequest), ("Completions", completion_params, CompletionRequest),
], ids=["chat", "completions"])
def test_the_guide_has_a_row_for_every_field_saying_what_the_server_does(heading, module, model):
    table = _field_table(heading)
    declared = set(model.model_fields)
    known = _sdk_params(module) | declared | {"guided_json", "structured_outputs", "prompt_logprobs"}
    if model is ChatCompletionRequest:
        known |= IGNORED | set(NOT_SUPPORTED)
    assert known - set(table) == set(), "fields without a row in docs/guide/openai.md"
    for name, (status, what) in table.items():
        # What the server does with it, as protocol.py decides it.
        does = "honoured" if name in declared else "ignored" if name in IGNORED else \
            "refused" if name in NOT_SUPPORTED else "unknown to the server"
        assert status == does, f"{name}: the guide says {status}, the server: {does}"
        assert what.strip(), name
