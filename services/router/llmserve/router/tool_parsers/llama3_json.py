"""Llama 3.1/3.2/3.3 JSON calls: a reply that is calls starts with one (after
`<|python_tag|>` where the tokenizer keeps it), `{"name": "f", "parameters": {...}}`,
several separated by ';'. A reply that starts otherwise is all content.
"""

from __future__ import annotations

from llmserve.router.tool_parsers.calls import WHITESPACE
from llmserve.router.tool_parsers.region import CallRegionParser

PYTHON_TAG = "<|python_tag|>"


def calls_start(text: str, final: bool, at_start: bool) -> tuple[int, int | None] | None:
    """The region starts at the reply's first '{' (or after its leading <|python_tag|>)."""
    rest = text.lstrip(WHITESPACE)
    at = len(text) - len(rest)
    if rest.startswith(PYTHON_TAG):
        return 0, at + len(PYTHON_TAG)
    if rest.startswith("{"):
        return 0, at
    if not final and PYTHON_TAG.startswith(rest):  # Whitespace so far, or a cut tag.
        return 0, None
    return None


def new_parser() -> CallRegionParser:
    return CallRegionParser(calls_start)
