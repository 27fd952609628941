"""Tool calling through the router (issue #33, item 4): tools and the turns' calls and
results reach the chat template as HF templates expect them; tool_choice is checked
and becomes a parser (auto) or a JSON-schema constraint (required, a named function);
calls reach OpenAI clients as `tool_calls` (streamed as `delta.tool_calls`) with
finish_reason "tool_calls", and gRPC clients as GenerateResponse.tool_calls. In process:
the OpenAI app over ASGI with a stub `Generation` whose reply goes through the real
SampleStream and parsers (tests/e2e/test_tool_calling.py: a real cluster)."""

from __future__ import annotations

import json
import re
import shutil

import grpc
import jsonschema
import pytest

from llmserve.contract.outputs import FinishReason, RequestOutput
from llmserve.contract.sampling import SamplingParams, StructuredOutput
from llmserve.contract.structured_output import check_structured_output
from llmserve.router.generation import Generation, GenerationError, Output
from llmserve.router.sample_stream import SampleStream
from llmserve.router.stop_strings import StopStringMatcher
from llmserve.router.tokenizer import PromptTokenizer
from llmserve.router.tool_parsers.hermes import HermesParser
from llmserve.router.tools import plan_tools
from llmserve.router.usage import Usage
from llmserve.router.validation import RequestError, ServedModel
from llmserve.v1 import generation_pb2 as pb

from .test_openai_http import http
from .test_reasoning import _sdk

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}, "h24": {"type": "boolean"}},
    "required": ["zone", "h24"]}}}
TOOLS = [WEATHER, CLOCK]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


# --- the chat template ------------------------------------------------------------

TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }}={{ t.function.parameters | tojson }};"
            "{% endfor %}</tools>\n{% endif %}"
            "{% for m in messages %}<|im_start|>{{ m.role }}\n"
            "{% for c in m.tool_calls or [] %}<call {{ c.id }}>{{ c.function.name }}"
            "{{ c.function.arguments | tojson }}</call>{% endfor %}"
            "{% if m.role == 'tool' %}[{{ m.tool_call_id }}] {% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
            "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def tools_tokenizer(smollm2_dir, tmp_path_factory) -> PromptTokenizer:
    """SmolLM2's tokenizer with a template that writes tools, calls and tool results."""
    model_dir = tmp_path_factory.mktemp("tools")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        shutil.copy(smollm2_dir / name, model_dir / name)
    (model_dir / "chat_template.jinja").write_text(TEMPLATE)
    return PromptTokenizer.from_model_dir(model_dir)


ROUND_TRIP = [
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
]


async def test_tools_calls_and_results_reach_the_template_as_hf_renders_them(tools_tokenizer):
    generation = Generation(tools_tokenizer, replicas=None, metrics=None)
    from llmserve.router.openai.protocol import ChatCompletionRequest

    body = ChatCompletionRequest(model="m", messages=ROUND_TRIP, tools=TOOLS)
    prompt, ids = await generation.render_chat(body.to_pb("r").messages)
    # The reference: transformers' own rendering of the same OpenAI-shaped chat, with
    # arguments as objects (what HF templates expect), and a call's content empty.
    hf_messages = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        ROUND_TRIP[2]]
    hf_tools = [{"type": "function", "function": {"description": t["function"].get("description", ""),
                                                  **t["function"]}} for t in TOOLS]
    expected = tools_tokenizer.tokenizer.apply_chat_template(hf_messages, tools=hf_tools, tokenize=False,
                                                             add_generation_prompt=True)
    assert prompt == expected
    assert '<call call_1>get_weather{"city": "Paris"}</call>' in prompt and "[call_1] 18C, sunny" in prompt
    assert prompt.startswith('<tools>get_weather={"type": "object"')
    assert ids == tools_tokenizer.encode_text(expected, add_special_tokens=False)


async def test_call_arguments_that_are_not_a_json_object_are_refused(tools_tokenizer):
    generation = Generation(tools_tokenizer, replicas=None, metrics=None)
    turn = pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="c", name="f", arguments="[1]")])
    with pytest.raises(RequestError, match=r"messages.0.tool_calls.0.function.arguments: must be a JSON object"):
        await generation.render_chat(pb.ChatMessages(messages=[turn]))


# --- tool_choice ------------------------------------------------------------------

def _request(tool_choice=None, tools=TOOLS, parallel=None, **fields) -> pb.GenerateRequest:
    from llmserve.router.openai.protocol import ChatCompletionRequest

    body = {"tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": parallel, **fields}
    return ChatCompletionRequest(model="m", messages=ASK, **body).to_pb("r")


@pytest.mark.parametrize("request_,parser,message", [
    (_request(), "none", "tool_choice: auto (the default with tools) needs the router's --tool-call-parser"),
    (_request("auto"), "none", "tool_choice: auto"),
    (_request("required", tools=None), "hermes", "tool_choice: required needs tools"),
    (_request({"type": "function", "function": {"name": "nope"}}), "none", "tool_choice: 'nope' is not one of"),
    (pb.GenerateRequest(messages=pb.ChatMessages(tools=[pb.Tool(name="f", parameters="[")])), "none",
     "tools.0.parameters: not JSON"),
    (pb.GenerateRequest(messages=pb.ChatMessages(tools=[pb.Tool(name="f"), pb.Tool(name="f")])), "none",
     "tools.1.name: 'f' is named twice"),
    (pb.GenerateRequest(messages=pb.ChatMessages(tools=[pb.Tool(name="a b")])), "none",
     "tools.0.name: 'a b' is not a function name"),
])
def test_bad_tool_requests_are_refused_naming_the_field(request_, parser, message):
    with pytest.raises(RequestError, match=re.escape(message)) as refused:
        plan_tools(request_, parser)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_required_and_named_choices_cannot_be_combined_with_response_format():
    plan = plan_tools(_request("required"), "none")
    asked = SamplingParams(structured_output=StructuredOutput("json_object"))
    with pytest.raises(RequestError, match="tool_choice and response_format"):
        plan.constrain(asked)


def test_none_and_no_tools_parse_nothing_and_auto_uses_the_routers_parser():
    assert plan_tools(_request("none"), "hermes").parser() is None
    assert plan_tools(_request(tools=None), "none").parser() is None
    plan = plan_tools(_request(), "hermes")
    assert plan.structured_output is None and isinstance(plan.parser(), HermesParser)


@pytest.mark.parametrize("parallel", [None, False])
def test_required_constrains_the_reply_to_calls_valid_for_each_tool(parallel):
    plan = plan_tools(_request("required", parallel=parallel), "none")
    so = plan.constrain(SamplingParams()).structured_output
    assert so.kind == "json_schema" and check_structured_output(so) is None  # xgrammar compiles it.
    schema = json.loads(so.spec)
    good = [{"name": "get_weather", "arguments": {"city": "Paris"}},
            {"name": "get_time", "arguments": {"zone": "UTC", "h24": True}}]
    bad = [[], [{"name": "get_weather", "arguments": {"zone": "UTC", "h24": True}}],  # Another tool's arguments.
           [{"name": "get_time", "arguments": {"zone": "PST", "h24": True}}], [{"name": "nope", "arguments": {}}]]
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid(good[:1])
    assert validator.is_valid(good) == (parallel is None)  # parallel_tool_calls false: one call.
    assert not any(validator.is_valid(b) for b in bad)


def test_a_named_function_constrains_the_reply_to_its_arguments():
    plan = plan_tools(_request({"type": "function", "function": {"name": "get_time"}}), "none")
    so = plan.constrain(SamplingParams()).structured_output
    assert json.loads(so.spec) == CLOCK["function"]["parameters"] and check_structured_output(so) is None


# --- through the OpenAI front door ------------------------------------------------

HERMES_REPLY = ["Let", " me", " check", ".\n<", "tool", "_call", '>\n{"name": "', "get", "_weather", '", "arg',
                'uments": {"ci', 'ty": "Par', 'is"}}\n</', "tool_call", ">"]


class _Detokenizer:
    def __init__(self, reply: list[str]):
        self.reply = reply

    def push(self, ids: list[int]) -> str:
        return "".join(self.reply[i] for i in ids)

    def flush(self) -> str:
        return ""


class ToolStub(Generation):
    """Runs no scheduler: the reply goes token by token through the router's SampleStream
    with the request's tool plan (as Generation.generate does); `sampling` keeps what
    the engine would have been asked to run."""

    def __init__(self, reply: list[str], tool_call_parser: str = "hermes"):
        super().__init__(tokenizer=None, replicas=None, metrics=None, tool_call_parser=tool_call_parser)
        self.served = ServedModel(name="m", max_model_len=64, vocab_size=len(reply), max_prompt_bytes=4096)
        self.reply = reply
        self.sampling: SamplingParams | None = None

    @property
    def ready(self) -> bool:
        return True

    async def generate(self, request, metadata=(), deadline_ms=0, sampling=None):
        try:
            tools = plan_tools(request, self.tool_call_parser)
            self.sampling = tools.constrain(sampling[0])
        except RequestError as err:
            raise GenerationError(err.code, err.message) from None
        stream = SampleStream(index=0, detokenizer=_Detokenizer(self.reply), stop_matcher=StopStringMatcher(()),
                              tool_calls=tools.parser())
        for token in range(len(self.reply)):
            last = token == len(self.reply) - 1
            out = RequestOutput(request.request_id, new_token_ids=[token],
                                finish_reason=FinishReason.STOP if last else FinishReason.NONE)
            yield Output(request.request_id, stream.process(out, str), Usage.of(3, [stream]) if last else None)


async def test_auto_calls_come_back_as_tool_calls_with_their_finish_reason():
    async with _sdk(ToolStub(HERMES_REPLY)) as client:
        reply = await client.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
        "function", "get_weather", {"city": "Paris"})
    assert call.id.startswith("call_")


async def test_streamed_calls_are_named_once_and_their_arguments_join_to_the_whole():
    async with _sdk(ToolStub(HERMES_REPLY)) as client:
        whole = await client.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
        stream = await client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, stream=True)
        chunks = [chunk async for chunk in stream]
    pieces = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or []]
    named = [p for p in pieces if p.id]
    assert len(named) == 1 and named[0] is pieces[0] and named[0].function.name == "get_weather"
    assert all(p.index == 0 and p.function.name is None for p in pieces[1:])
    assert len(pieces) > 2  # The arguments arrived in several pieces, not at the end.
    expected = whole.choices[0].message.tool_calls[0].function.arguments
    assert "".join(p.function.arguments for p in pieces) == expected == '{"city": "Paris"}'
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Let me check."
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"


async def test_required_runs_constrained_and_reads_the_json_array():
    reply = ['[{"name": "get_time", ', '"arguments": {"zone": "UTC", ', '"h24": true}}]']
    generation = ToolStub(reply, tool_call_parser="none")
    async with _sdk(generation) as client:
        answer = await client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                                      parallel_tool_calls=False)
    assert generation.sampling.structured_output.kind == "json_schema"
    assert json.loads(generation.sampling.structured_output.spec)["maxItems"] == 1
    (call,) = answer.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", {"zone": "UTC", "h24": True})
    assert answer.choices[0].message.content is None and answer.choices[0].finish_reason == "tool_calls"


async def test_tool_choice_none_leaves_the_reply_as_content():
    async with _sdk(ToolStub(HERMES_REPLY)) as client:
        reply = await client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="none")
    assert reply.choices[0].message.content == "".join(HERMES_REPLY) and not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS}, "tool_choice"),  # auto, and this router has no parser.
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
      "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
])
async def test_refused_tool_fields_are_400_naming_them(body, param):
    async with http(ToolStub(HERMES_REPLY, tool_call_parser="none")) as client:
        reply = await client.post("/v1/chat/completions", json={"model": "m", "messages": ASK, **body})
    assert reply.status_code == 400, reply.json()
    assert param in reply.json()["error"]["message"] and (reply.json()["error"]["param"] or param).startswith(param)


def test_grpc_clients_get_the_calls_and_their_finish_reason():
    from llmserve.router.sample_stream import SampleDelta
    from llmserve.router.service import GenerationServicer
    from llmserve.router.tool_parsers import ToolCallDelta

    delta = SampleDelta(index=0, text="", token_ids=[5], logprobs=[], finish_reason=FinishReason.TOOL_CALLS,
                        tool_calls=[ToolCallDelta(0, id="call_1", name="f", arguments='{"a"'),
                                    ToolCallDelta(1, id="call_2", name="g", arguments="{}")])
    response = GenerationServicer._response("r", delta)
    assert response.finish_reason == pb.FINISH_REASON_TOOL_CALLS
    assert [(c.index, c.id, c.name, c.arguments) for c in response.tool_calls] == [
        (0, "call_1", "f", '{"a"'), (1, "call_2", "g", "{}")]
    assert pb.GenerateResponse.FromString(response.SerializeToString()) == response


def test_reasoning_is_split_off_before_calls_are_read():
    from llmserve.router.reasoning import REASONING_PARSERS

    reply = ["<think>", "I need the", " weather.</think>\n", "<tool_call>", '{"name": "get_weather", ',
             '"arguments": {"city": "Paris"}}', "</tool_call>"]
    stream = SampleStream(index=0, detokenizer=_Detokenizer(reply), stop_matcher=StopStringMatcher(()),
                          reasoning=REASONING_PARSERS["think"](""), tool_calls=HermesParser())
    deltas = [stream.process(RequestOutput("r", new_token_ids=[i], finish_reason=FinishReason.STOP
                                           if i == len(reply) - 1 else FinishReason.NONE), str)
              for i in range(len(reply))]
    assert "".join(d.reasoning_text for d in deltas) == "I need the weather."
    assert "".join(d.text for d in deltas) == ""
    calls = [c for d in deltas for c in d.tool_calls]
    assert calls[0].name == "get_weather" and "".join(c.arguments for c in calls) == '{"city": "Paris"}'
    assert deltas[-1].finish_reason == FinishReason.TOOL_CALLS
