"""A chat request's tools: what its chat template gets (`tools`, and the messages'
tool calls and results), and how its reply is read (`ToolPlan`), checked alike for both
front doors from the public ChatMessages.

    tool_choice   the template gets   the reply                         read by
    none          the tools           free text                         (nothing: all content)
    auto          the tools           free text, calls in the model's   --tool-call-parser (required)
                                      own format
    required      the tools           a JSON array of calls (schema)    required.required_parser
    a function    the tools           that function's arguments         required.NamedCallParser

`none` still shows the tools to the template (as vLLM does by default), so a model can
talk about them; it only stops calls from being parsed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from llmserve.contract.sampling import SamplingParams, StructuredOutput
from llmserve.router.tool_parsers import TOOL_CALL_PARSERS, ToolCallDelta, ToolCallParser
from llmserve.router.tool_parsers.required import NO_PARAMETERS, NamedCallParser, required_parser, required_schema
from llmserve.router.validation import invalid
from llmserve.v1 import generation_pb2

MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names.
_MODES = {generation_pb2.TOOL_CHOICE_MODE_NONE: "none", generation_pb2.TOOL_CHOICE_MODE_AUTO: "auto",
          generation_pb2.TOOL_CHOICE_MODE_REQUIRED: "required"}


def _json_object(text: str, param: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as err:
        raise invalid(f"{param}: not JSON ({err})", param=param) from None
    if not isinstance(value, dict):
        raise invalid(f"{param}: must be a JSON object", param=param)
    return value


def tool_schemas(messages: generation_pb2.ChatMessages) -> dict[str, dict]:
    """The request's tools: name -> parameters schema, checked."""
    if len(messages.tools) > MAX_TOOLS:
        raise invalid(f"tools: {len(messages.tools)} tools; at most {MAX_TOOLS}", param="tools")
    schemas: dict[str, dict] = {}
    for i, tool in enumerate(messages.tools):
        if not TOOL_NAME.fullmatch(tool.name):
            raise invalid(f"tools.{i}.name: {tool.name[:80]!r} is not a function name (1-64 letters, digits, "
                          f"'_' or '-')", param=f"tools.{i}.name")
        if tool.name in schemas:
            raise invalid(f"tools.{i}.name: {tool.name!r} is named twice", param=f"tools.{i}.name")
        schemas[tool.name] = (_json_object(tool.parameters, f"tools.{i}.parameters") if tool.parameters
                              else NO_PARAMETERS)
    return schemas


def template_tools(messages: generation_pb2.ChatMessages) -> list[dict] | None:
    """The tools as HF chat templates expect them (OpenAI's shape); None without tools."""
    schemas = tool_schemas(messages)
    if not schemas:
        return None
    return [{"type": "function", "function": {"name": tool.name, "description": tool.description,
                                              "parameters": schemas[tool.name]}} for tool in messages.tools]


def template_messages(messages: generation_pb2.ChatMessages) -> list[dict]:
    """The turns as HF chat templates expect them: an assistant's tool calls with their
    arguments as objects (templates write them with `tojson`), a tool turn's call id."""
    turns = []
    for i, m in enumerate(messages.messages):
        turn: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            turn["tool_calls"] = [
                {"id": call.id, "type": "function", "function": {
                    "name": call.name,
                    "arguments": _json_object(call.arguments, f"messages.{i}.tool_calls.{j}.function.arguments")}}
                for j, call in enumerate(m.tool_calls)]
        if m.tool_call_id:
            turn["tool_call_id"] = m.tool_call_id
        if m.name:
            turn["name"] = m.name
        turns.append(turn)
    return turns


@dataclass(frozen=True)
class ToolPlan:
    """How one request's reply is read for calls."""

    new_parser: Callable[[], ToolCallParser] | None  # None: not at all (tool_choice none, or no tools).
    structured_output: StructuredOutput | None = None  # required / a named function's constraint.

    def parser(self) -> ToolCallParser | None:
        """A new sample's parser, if its reply is read for calls."""
        return None if self.new_parser is None else self.new_parser()

    def constrain(self, sampling: SamplingParams) -> SamplingParams:
        """The sampling settings with the constraint tool_choice asks for, if any."""
        if self.structured_output is None:
            return sampling
        if sampling.structured_output is not None:
            raise invalid("tool_choice and response_format (or guided_*, structured_output): tool_choice required "
                          "or a named function constrains the reply itself; ask for one of them",
                          param="tool_choice")
        return replace(sampling, structured_output=self.structured_output)


NO_TOOLS = ToolPlan(None)


def plan_tools(request: generation_pb2.GenerateRequest, parser: str) -> ToolPlan:
    """The request's ToolPlan; `parser`: the router's --tool-call-parser ("none": none)."""
    if request.WhichOneof("input") != "messages":
        return NO_TOOLS
    messages = request.messages
    schemas = tool_schemas(messages)
    choice = messages.tool_choice
    kind = choice.WhichOneof("choice")
    mode = "function" if kind == "function_name" else _MODES.get(choice.mode, "auto" if schemas else "none")
    parallel = messages.parallel_tool_calls if messages.HasField("parallel_tool_calls") else True
    if mode == "none":
        return NO_TOOLS
    if not schemas:
        raise invalid(f"tool_choice: {mode} needs tools", param="tool_choice")
    if mode == "function":
        if choice.function_name not in schemas:
            raise invalid(f"tool_choice: {choice.function_name[:80]!r} is not one of the tools", param="tool_choice")
        schema = json.dumps(schemas[choice.function_name], ensure_ascii=False)
        return ToolPlan(lambda: NamedCallParser(choice.function_name), StructuredOutput("json_schema", schema))
    if mode == "required":
        return ToolPlan(required_parser, StructuredOutput("json_schema", required_schema(schemas, parallel)))
    if parser not in TOOL_CALL_PARSERS:
        raise invalid("tool_choice: auto (the default with tools) needs the router's --tool-call-parser (hermes, "
                      "llama3_json or mistral: the model's format); this router has none. Send tool_choice "
                      "required, a named function, or none", param="tool_choice")
    new_parser = TOOL_CALL_PARSERS[parser]
    return ToolPlan(new_parser if parallel else lambda: FirstCallOnly(new_parser()))


@dataclass
class FirstCallOnly:
    """parallel_tool_calls false with tool_choice auto: a parser reads what the model
    wrote, which may be several calls; the client gets the first."""

    parser: ToolCallParser

    @property
    def called(self) -> bool:
        return self.parser.called

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        content, calls = self.parser.feed(text, final)
        return content, [call for call in calls if call.index == 0]
