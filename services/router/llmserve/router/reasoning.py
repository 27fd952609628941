"""Splits a reasoning model's streamed text into its reasoning and its answer
(--reasoning-parser), for chat requests: OpenAI's `reasoning_content` and `content`.

    think        <think>reasoning</think>answer   Qwen3, QwQ, DeepSeek-R1 distills. A reply
                 that does not start with <think> is all answer; a prompt that ends
                 inside an open <think> (the chat template wrote it) starts in the reasoning.
    deepseek_r1  [<think>]reasoning</think>answer  the template writes <think> (R1's does):
                 everything up to </think> is reasoning, even without an opening tag; a
                 reply that never closes it is all reasoning.

Text arrives in pieces cut anywhere, a tag included: a piece that ends with the start of
a tag is held back until the next piece says whether it is one. Whitespace at the start
of each part (the "\\n\\n" models write after a tag) is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"


@dataclass
class ReasoningSplitter:
    """One sample's split state; `feed` each new piece of text, `final=True` with the last."""

    reasoning: bool = False  # Inside the reasoning now.
    opens: bool = True  # A <think> may come before any text: it starts (or, reasoning already, repeats) it.
    _held: str = ""  # A piece's tail that may be the start of a tag.
    _strip: bool = True  # Drop whitespace before the current section's first character.

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) of `text` plus what was held back."""
        text, self._held = self._held + text, ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            if self.opens:
                text = self._opening(text, final)
                if self.opens:  # Whitespace, or the start of <think>: held.
                    self._held = text
                    break
            at = text.find(CLOSE) if self.reasoning else -1
            if at >= 0:
                self._emit(text[:at], reasoning)
                self.reasoning, self._strip = False, True
                text = text[at + len(CLOSE):]
                continue
            keep = _partial_tag(text, CLOSE) if self.reasoning and not final else 0
            self._emit(text[:len(text) - keep], reasoning if self.reasoning else content)
            self._held = text[len(text) - keep:]
            break
        return "".join(reasoning), "".join(content)

    def _opening(self, text: str, final: bool) -> str:
        """Before any text: consumes a leading <think> (reasoning from here); `opens`
        stays True while what came may still be one."""
        rest = text.lstrip()
        if rest.startswith(OPEN):
            self.reasoning, self.opens = True, False
            return rest[len(OPEN):]
        if final or not OPEN.startswith(rest):
            self.opens = False
        return text

    def _emit(self, text: str, into: list[str]) -> None:
        if self._strip:
            text = text.lstrip()
            self._strip = not text
        if text:
            into.append(text)


def _partial_tag(text: str, tag: str) -> int:
    """How many of text's last characters are a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _think(prompt_tail: str) -> ReasoningSplitter:
    opened = prompt_tail.rfind(OPEN) > prompt_tail.rfind(CLOSE)
    return ReasoningSplitter(reasoning=opened, opens=not opened)


def _deepseek_r1(prompt_tail: str) -> ReasoningSplitter:
    return ReasoningSplitter(reasoning=True, opens=True)


# --reasoning-parser: name -> the splitter of one sample, given its prompt's last characters.
REASONING_PARSERS = {"think": _think, "deepseek_r1": _deepseek_r1}
REASONING_PARSER_CHOICES = ("none", *REASONING_PARSERS)
