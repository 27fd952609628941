"""Hermes-style calls (Qwen2.5, Qwen3, Hermes 2/3): each call is a JSON object between
tags, any text outside them is content.

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A block whose text is not a call object (no name by its end) is given back as content,
tags included, if none of it was streamed as a call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserve.router.tool_parsers.calls import (
    CallEmitter,
    Content,
    NotACall,
    ToolCallDelta,
    held_suffix,
    scan_call,
    skip,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class HermesParser:
    """One sample's parser; `feed` each new piece of content, `final=True` with the last."""

    _emitter: CallEmitter = field(default_factory=CallEmitter)
    _content: Content = field(default_factory=Content)
    _held: str = ""  # Outside a block: a tail that may start <tool_call>.
    _block: str | None = None  # Inside a block: its text so far (None: outside).
    _index: int = 0  # The index the current block's call has (or will have).

    @property
    def called(self) -> bool:
        return self._emitter.count > 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """(content, call deltas) of `text` plus what was held back."""
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        text, self._held = self._held + text, ""
        while text:
            if self._block is None:
                at = text.find(OPEN)
                if at < 0:
                    keep = 0 if final else held_suffix(text, OPEN)
                    content.append(self._content.add(text[:len(text) - keep]))
                    self._held = text[len(text) - keep:]
                    break
                content.append(self._content.add(text[:at]))
                self._block, self._index, text = "", self._emitter.count, text[at + len(OPEN):]
                continue
            self._block += text
            at = self._block.find(CLOSE)
            # An open block's tail that may start </tool_call> is not scanned: it cannot
            # be arguments.
            body = self._block[:at] if at >= 0 else self._block[:len(self._block) - held_suffix(self._block, CLOSE)]
            is_call = self._scan(body, calls)
            if at < 0:
                break
            text = self._block[at + len(CLOSE):]
            content.append(self._close(is_call, OPEN + body + CLOSE))
        if final:
            if self._block is not None:
                content.append(self._close(self._scan(self._block, calls), OPEN + self._block))
            content.append(self._content.add(self._held) + self._content.end(self.called))
            self._held = ""
        return "".join(content), calls

    def _scan(self, body: str, calls: list[ToolCallDelta]) -> bool:
        """Adds the current block's new delta to `calls`; whether the block is a call so far."""
        start = skip(body, 0)
        if start >= len(body):
            return False
        try:
            span = scan_call(body, start)
        except NotACall:
            return False
        delta = self._emitter.update(self._index, span, body)
        if delta is not None:
            calls.append(delta)
        return span.name is not None

    def _close(self, is_call: bool, block: str) -> str:
        """Ends the current block: a call, or (nothing of it streamed) content."""
        self._block = None
        if is_call or self._emitter.count > self._index:
            self._content.call()
            return ""
        return self._content.add(block)
