"""What the tool-call parsers share: the pieces of calls streamed to the client, and a
scanner of the JSON call objects models write, `{"name": "f", "arguments": {...}}`.

A call's arguments stream as slices of the model's own text: every piece is text inside
the arguments' JSON value, so a call's pieces joined are exactly that value as the model
wrote it (the same whether the reply came in one piece or token by token), and nothing
streamed is ever taken back. The scanner reads a call object as far as it has arrived:
its name once the name's string is closed, its arguments from the first character of
their value.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field

WHITESPACE = " \t\r\n"
# The key of a call's arguments: "arguments" (Hermes, Mistral, tool_choice required) or
# "parameters" (Llama 3.x JSON).
ARGUMENT_KEYS = ("arguments", "parameters")
_ALPHANUMERIC = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of one call: its first carries `id` and `name`, later ones more `arguments`."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(frozen=True)
class CallSpan:
    """What has arrived of one call object: `name` once its string is complete;
    `arguments` (start, end) of the value's text, end None while it is still open;
    `end` past the object's closing brace, None while it is open."""

    name: str | None
    arguments: tuple[int, int | None] | None
    end: int | None


class NotACall(ValueError):
    """The text at this position is not a call object."""


def openai_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def mistral_call_id() -> str:
    """Mistral's templates require ids of exactly 9 letters and digits."""
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


def skip(text: str, i: int, chars: str = WHITESPACE) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def held_suffix(text: str, tag: str) -> int:
    """How many of text's last characters are a proper prefix of `tag` (held back until
    the next piece says whether the tag follows)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _string_end(text: str, i: int) -> int | None:
    """Past the JSON string starting at text[i] ('"'); None if it is not closed yet."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def _value_end(text: str, i: int) -> int | None:
    """Past the JSON value starting at text[i]; None if more of it may follow."""
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] in "{[":
        depth, j = 0, i
        while j < len(text):
            if text[j] == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if text[j] in "{[":
                depth += 1
            elif text[j] in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # A number, true, false or null: it ends where a delimiter is.
    while j < len(text) and text[j] not in ",}]" + WHITESPACE:
        j += 1
    return j if j < len(text) else None


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        raise NotACall(text) from None


def scan_call(text: str, start: int) -> CallSpan:
    """The call object starting at text[start], as far as it has arrived; NotACall where
    it cannot be one (not an object, or a name that is not a string)."""
    if text[start] != "{":
        raise NotACall(text[start:])
    name: str | None = None
    arguments: tuple[int, int | None] | None = None
    j = start + 1
    while True:
        j = skip(text, j, WHITESPACE + ",")
        if j >= len(text):
            return CallSpan(name, arguments, None)
        if text[j] == "}":
            return CallSpan(name, arguments, j + 1)
        if text[j] != '"':
            raise NotACall(text[start:])
        key_end = _string_end(text, j)
        colon = len(text) if key_end is None else skip(text, key_end)
        value = skip(text, colon + 1)
        if value >= len(text):
            return CallSpan(name, arguments, None)
        if text[colon] != ":":
            raise NotACall(text[start:])
        key, end = _loads(text[j:key_end]), _value_end(text, value)
        if key == "name" and end is not None:
            name = _loads(text[value:end])
            if not isinstance(name, str):
                raise NotACall(text[start:])
        elif key in ARGUMENT_KEYS and arguments is None:
            arguments = (value, end)
        if end is None:
            return CallSpan(name, arguments, None)
        j = end


def scan_calls(text: str) -> tuple[list[CallSpan], int | None]:
    """The call objects at the start of `text`: a JSON array of them, or objects separated
    by ';', ',' or whitespace. Returns their spans (a last one possibly open) and where
    the calls end: past the array's ']', or at the first text that is not a call; None
    while more calls may follow."""
    spans: list[CallSpan] = []
    i = skip(text, 0)
    array = i < len(text) and text[i] == "["
    i += array
    while True:
        i = skip(text, i, WHITESPACE + ",;")
        if i >= len(text):
            return spans, None
        if array and text[i] == "]":
            return spans, i + 1
        try:
            span = scan_call(text, i)
        except NotACall:
            return spans, i
        if span.end is not None and span.name is None:
            return spans, i  # A whole object without a name: JSON, but not a call.
        spans.append(span)
        if span.end is None:
            return spans, None
        i = span.end


@dataclass
class CallEmitter:
    """Turns the spans of a reply's calls, rescanned as its text grows, into the deltas
    not sent yet: a call's id and name once its name is known, then its arguments as
    they arrive (`{}` for a closed call that had none)."""

    new_id: Callable[[], str] = openai_call_id
    _sent: list[int] = field(default_factory=list)  # Per call: characters of arguments sent.

    @property
    def count(self) -> int:
        return len(self._sent)

    def update(self, index: int, span: CallSpan, text: str) -> ToolCallDelta | None:
        """The new delta of call `index` (spans index into `text`); None if nothing is new."""
        if span.name is None:
            return None
        if span.arguments is not None:
            start, end = span.arguments
            arguments = text[start:len(text) if end is None else end]
        else:
            arguments = "{}" if span.end is not None else ""
        if index == len(self._sent):
            self._sent.append(len(arguments))
            return ToolCallDelta(index, id=self.new_id(), name=span.name, arguments=arguments)
        new, self._sent[index] = arguments[self._sent[index]:], len(arguments)
        return ToolCallDelta(index, arguments=new) if new else None

    def update_all(self, spans: list[CallSpan], text: str, first: int = 0) -> list[ToolCallDelta]:
        """`update` for spans[i] as call first + i."""
        deltas = [self.update(first + i, span, text) for i, span in enumerate(spans)]
        return [d for d in deltas if d is not None]


@dataclass
class Content:
    """The text around calls, as the client's content: whitespace that only separates
    calls (before, between, after them) is dropped, any other text is kept as written.
    Whitespace is held until text (kept with it) or a call (dropped) follows it."""

    _held: str = ""
    _strip: bool = False  # Just after a call: its trailing whitespace is the separator's.

    def add(self, text: str) -> str:
        if self._strip:
            text = text.lstrip(WHITESPACE)
            self._strip = not text
        body = text.rstrip(WHITESPACE)
        if not body:
            self._held += text
            return ""
        out, self._held = self._held + body, text[len(body):]
        return out

    def call(self) -> None:
        """A call starts: the whitespace before it goes."""
        self._held, self._strip = "", True

    def end(self, called: bool) -> str:
        """The last text: whitespace held is kept only in a reply without calls."""
        out, self._held = ("" if called else self._held), ""
        return out
