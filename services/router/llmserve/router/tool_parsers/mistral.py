"""Mistral calls (tokenizer v3 templates, Mistral 7B v0.3, Nemo, Small): content, then
`[TOOL_CALLS]` and a JSON array of `{"name": "f", "arguments": {...}}`. Call ids are
9 letters and digits, as Mistral's templates require.

NOTE: `[TOOL_CALLS]` is a special token of Mistral's HF tokenizers, which the router's
detokenizer drops (as it drops eos); so a reply that starts with a JSON array is read
as calls too. An array without a call object in it (no "name") stays content.
"""

from __future__ import annotations

from llmserve.router.tool_parsers.calls import WHITESPACE, held_suffix, mistral_call_id
from llmserve.router.tool_parsers.region import CallRegionParser

TOOL_CALLS = "[TOOL_CALLS]"


def calls_start(text: str, final: bool, at_start: bool) -> tuple[int, int | None]:
    """Content up to [TOOL_CALLS], the calls after it; or a reply's leading array."""
    at = text.find(TOOL_CALLS)
    if at >= 0:
        return at, at + len(TOOL_CALLS)
    rest = text.lstrip(WHITESPACE)
    if at_start and rest.startswith("[") and not TOOL_CALLS.startswith(rest):
        return 0, len(text) - len(rest)
    if at_start and not final and TOOL_CALLS.startswith(rest):  # Whitespace so far, or a cut tag.
        return 0, None
    return len(text) - (0 if final else held_suffix(text, TOOL_CALLS)), None


def new_parser() -> CallRegionParser:
    return CallRegionParser(calls_start, mistral_call_id)
