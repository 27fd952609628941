"""Tool calls in a chat reply, found by the router's --tool-call-parser (tool_choice
auto) or read from a constrained reply (tool_choice required, a named function).

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>   Qwen2.5, Qwen3, Hermes
    llama3_json  [<|python_tag|>]{"name": ..., "parameters": {...}}; ...   Llama 3.1-3.3
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]      Mistral v0.3, Nemo

Each sample gets its own parser; `feed(text, final)` takes each new piece of the reply's
content (after a --reasoning-parser's split) and returns (content, call deltas): the
same result however the text is cut (calls.py says how arguments stream).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from llmserve.router.tool_parsers import llama3_json, mistral
from llmserve.router.tool_parsers.calls import ToolCallDelta
from llmserve.router.tool_parsers.hermes import HermesParser


class ToolCallParser(Protocol):
    @property
    def called(self) -> bool:
        """Whether a call has been given out."""

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """(content, call deltas) of the reply's next piece."""


# --tool-call-parser: name -> a new sample's parser.
TOOL_CALL_PARSERS: dict[str, Callable[[], ToolCallParser]] = {
    "hermes": HermesParser, "llama3_json": llama3_json.new_parser, "mistral": mistral.new_parser}
TOOL_CALL_PARSER_CHOICES = ("none", *TOOL_CALL_PARSERS)

__all__ = ["TOOL_CALL_PARSERS", "TOOL_CALL_PARSER_CHOICES", "ToolCallDelta", "ToolCallParser"]
