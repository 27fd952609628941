"""tool_choice "required" and a named function: constrained decoding (structured output)
shapes the whole reply, so it is read as JSON, not by a --tool-call-parser.

    required   [{"name": "f", "arguments": {...}}, ...]   a JSON array of calls (one
               item per call; at most one without parallel_tool_calls), each item's
               arguments following its tool's parameters schema
    named      {...}                                      the function's arguments only
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from llmserve.router.tool_parsers.calls import ToolCallDelta, openai_call_id
from llmserve.router.tool_parsers.region import CallRegionParser

NO_PARAMETERS = {"type": "object", "properties": {}}


def required_schema(tools: dict[str, dict], parallel: bool) -> str:
    """The JSON schema of a "required" reply; `tools`: name -> parameters schema."""
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "arguments": schema},
              "required": ["name", "arguments"]} for name, schema in tools.items()]
    array = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        array["maxItems"] = 1
    return json.dumps(array, ensure_ascii=False)


def _whole_reply(text: str, final: bool, at_start: bool) -> tuple[int, int]:
    return 0, 0


def required_parser() -> CallRegionParser:
    return CallRegionParser(_whole_reply)


@dataclass
class NamedCallParser:
    """The reply is the arguments of `name`'s one call: its id and name go out first."""

    name: str
    _started: bool = False

    @property
    def called(self) -> bool:
        return self._started

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """(no content, the call's new delta) of `text`."""
        if not self._started:
            self._started = True
            return "", [ToolCallDelta(0, id=openai_call_id(), name=self.name, arguments=text)]
        return "", [ToolCallDelta(0, arguments=text)] if text else []
