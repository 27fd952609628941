"""A reply whose calls come as one run of JSON call objects after some text (Llama 3.x
JSON, Mistral, tool_choice required): content, then a region of calls (`scan_calls`),
then content again. Where the region starts is each format's rule (`RegionStart`).

Until the region's end is known its text is held (it may turn out not to be calls);
calls stream as they arrive. A region in which no call was found is content, as written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from llmserve.router.tool_parsers.calls import CallEmitter, Content, ToolCallDelta, openai_call_id, scan_calls

# (text not given out yet, final, whether that text is the reply's start) ->
# (where the content ends, where the calls region starts), or (where the content ends,
# None): no region yet (text from the first index is held back until the next piece
# decides), or None: this reply has no calls, it is all content.
RegionStart = Callable[[str, bool, bool], tuple[int, int | None] | None]


@dataclass
class CallRegionParser:
    """One sample's parser; `feed` each new piece of content, `final=True` with the last."""

    start: RegionStart
    new_id: Callable[[], str] = openai_call_id
    _emitter: CallEmitter = field(init=False)
    _content: Content = field(default_factory=Content)
    _text: str = ""  # The reply from the first character not yet given out as content.
    _region: int | None = None  # Where the calls start in _text, once known.
    _plain: bool = False  # Content only from here on (no region, or past its end).
    _at_start: bool = True  # No content given out yet: _text is the reply from its start.

    def __post_init__(self) -> None:
        self._emitter = CallEmitter(self.new_id)

    @property
    def called(self) -> bool:
        return self._emitter.count > 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """(content, call deltas) of `text` plus what was held back."""
        self._text += text
        content, calls = "", []
        if not self._plain and self._region is None:
            content = self._find_region(final)
        if self._region is not None:
            calls = self._scan(final)
        if self._plain:
            content += self._content.add(self._text)
            self._text = ""
        if final:
            content += self._content.add(self._text) + self._content.end(self.called)
            self._text = ""
        return content, calls

    def _find_region(self, final: bool) -> str:
        """Content before the region; sets _region (or _plain) once the text decides."""
        found = self.start(self._text, final, self._at_start)
        if found is None:
            self._plain = True
            return ""
        content_end, self._region = found
        self._at_start = self._at_start and content_end == 0
        content = self._content.add(self._text[:content_end])
        self._text = self._text[content_end:]
        if self._region is not None:
            self._region -= content_end
        return content

    def _scan(self, final: bool) -> list[ToolCallDelta]:
        """New call deltas. Once the region has ended, what follows is content: the text
        after it, or (no call in it) all of it, from its first character."""
        region = self._text[self._region:]
        spans, end = scan_calls(region)
        calls = self._emitter.update_all(spans, region)
        if end is None and not final:
            return calls
        self._plain = True
        if self.called:
            self._content.call()
            self._text = "" if end is None else region[end:]
        return calls
