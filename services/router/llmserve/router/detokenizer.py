"""Streaming detokenization: token ids in, text deltas out.

Decoding each token on its own is wrong twice over: a character may be spread over
several byte-level BPE tokens (half a character decodes to U+FFFD), and tokenizers such
as SentencePiece drop or merge a token's leading space depending on what precedes it.
So each push decodes a short window of recent tokens and emits what the window added:

    ids:   ... | t[p] ... t[r-1] | t[r] ... t[n-1]
                 \\_ prefix ____/  \\_ new ________/
    delta = decode(t[p:n])[len(decode(t[p:r])):]

``p`` (prefix offset) and ``r`` (read offset) only move forward, to boundaries where
the decoded text was complete, so the window holds the last emitted chunk plus the
tokens not yet emitted, whatever the length of the sequence.

Invariant (tested): "".join(push(...) for each chunk) + flush() == decode(all ids).

Where the tokenizer is a `tokenizers` (Rust) one, which covers every "fast" HF
tokenizer, `StreamDetokenizer` hands the same job to `tokenizers.decoders.DecodeStream`:
one call into Rust per token instead of a few Python-side decodes of the window.
`IncrementalDetokenizer` stays for the tokenizers it cannot drive.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from llmserve.router.tokenizer import special_token_ids

try:  # tokenizers >= 0.21
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - an older tokenizers: the Python window only
    DecodeStream = None

REPLACEMENT_CHAR = "\ufffd"
# A held-back tail ending in U+FFFD longer than this many tokens cannot be a character
# still being completed (UTF-8 needs at most 4 bytes, so at most 3 are pending): it
# holds invalid bytes that will decode to U+FFFD whatever comes next.
_MAX_PENDING_TOKENS = 4


class Decoder(Protocol):
    """What the detokenizers need of a tokenizer (a PromptTokenizer or a bare HF one)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


def _special_ids(tokenizer: Any) -> frozenset[int]:
    ids = getattr(tokenizer, "special_token_ids", None)  # A PromptTokenizer.
    if ids is not None:
        return frozenset(int(i) for i in ids)
    return special_token_ids(tokenizer)  # A bare HF tokenizer.


class IncrementalDetokenizer:
    """Turns one sample's stream of token ids into text deltas (one per push)."""

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # NOTE: decode(skip_special_tokens=True) drops special tokens before running the
        # decoder, so dropping them here gives the same text and keeps a run of them
        # (e.g. eos with ignore_eos) from stretching the window.
        self._special = _special_ids(tokenizer) if skip_special_tokens else frozenset()
        self._ids: list[int] = []  # The window: ids from the prefix offset on.
        self._read = 0  # Offset in _ids up to which text has been emitted.

    @property
    def window_size(self) -> int:
        """Tokens currently decoded per push (bounded; exposed for tests)."""
        return len(self._ids)

    def push(self, new_token_ids: Iterable[int]) -> str:
        """Add tokens; return the text that is now certain."""
        new = [int(i) for i in new_token_ids if int(i) not in self._special]
        if not new:
            return ""
        self._ids.extend(new)
        prefix_text = self._decode(self._ids[: self._read])
        # The last token boundary where the text is complete. Boundaries inside the
        # chunk count too, so a chunk behaves as if pushed one token at a time; an
        # unfinished character spans at most 3 tokens, so only the last few are tried.
        lowest = max(self._read, len(self._ids) - _MAX_PENDING_TOKENS - 1)
        for end in range(len(self._ids), lowest, -1):
            text = self._decode(self._ids[:end])
            if text.endswith(REPLACEMENT_CHAR):
                continue
            if len(text) > len(prefix_text):
                return self._advance(end, prefix_text, text)
            if end == len(self._ids):
                # Tokens that decode to nothing: the text is complete at the end, but
                # keep the prefix so the next token is still decoded in context.
                self._read = end
            break
        if len(self._ids) - self._read > _MAX_PENDING_TOKENS:
            return self._emit_invalid_bytes(prefix_text)
        return ""

    def flush(self) -> str:
        """The held-back text (an unfinished character decodes to U+FFFD here)."""
        if not self._ids:
            return ""
        prefix_text = self._decode(self._ids[: self._read])
        text = self._decode(self._ids)
        self._ids = []
        self._read = 0
        return text[len(prefix_text):]

    def _advance(self, end: int, prefix_text: str, text: str) -> str:
        """Emit text up to token ``end``; the old read offset becomes the prefix offset."""
        delta = text[len(prefix_text):]
        del self._ids[: self._read]
        self._read = end - self._read
        return delta

    def _emit_invalid_bytes(self, prefix_text: str) -> str:
        """The tail keeps ending in U+FFFD: emit up to the last token boundary where
        splitting the decode changes nothing (no character is cut there), so invalid
        bytes do not hold the window open forever.

        NOTE: exact for byte-level BPE, where an unfinished character decodes to a
        single U+FFFD (so cutting it changes the text). SentencePiece byte-fallback
        turns a whole run of byte tokens into U+FFFDs when any of it is invalid, which
        no streaming decoder can reproduce; only invalid output is affected.
        """
        text = self._decode(self._ids)
        lowest = max(self._read, len(self._ids) - 2 * _MAX_PENDING_TOKENS)
        for end in range(len(self._ids) - 1, lowest, -1):
            head = self._decode(self._ids[:end])
            tail = self._decode(self._ids[end:])
            if tail and head + tail == text and len(head) > len(prefix_text):
                return self._advance(end, prefix_text, head)
        return ""

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)


class StreamDetokenizer:
    """One sample's stream of token ids into text deltas through `DecodeStream`.

    DecodeStream returns None while the text so far ends in an unfinished character
    (and, like our window, keeps a prefix so leading-space rules see their context).
    The ids it holds back are tracked here, so that `flush` can give them out as
    `decode` would: an unfinished character at the very end becomes U+FFFD.
    """

    _CONTEXT = _MAX_PENDING_TOKENS  # Ids of emitted text kept to decode the tail in context.

    def __init__(self, backend: Any, skip_special_tokens: bool = True) -> None:
        self._backend = backend  # A tokenizers.Tokenizer.
        self._skip_special = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._emitted: list[int] = []  # The last few ids whose text is out.
        self._pending: list[int] = []  # Ids whose text DecodeStream still holds.

    @property
    def window_size(self) -> int:
        return len(self._pending)

    def push(self, new_token_ids: Iterable[int]) -> str:
        """Add tokens; return the text that is now certain."""
        out = []
        for token_id in new_token_ids:
            text = self._stream.step(self._backend, int(token_id))
            self._pending.append(int(token_id))
            if text is not None:
                out.append(text)
                self._emitted = (self._emitted + self._pending)[-self._CONTEXT:]
                self._pending = []
        return "".join(out)

    def flush(self) -> str:
        """The held-back text (an unfinished character decodes to U+FFFD here)."""
        if not self._pending:
            return ""
        context = self._decode(self._emitted)
        text = self._decode(self._emitted + self._pending)
        self._pending = []
        return text[len(context):]

    def _decode(self, ids: Sequence[int]) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=self._skip_special) if ids else ""


def new_detokenizer(tokenizer: Any, skip_special_tokens: bool = True) -> StreamDetokenizer | IncrementalDetokenizer:
    """DecodeStream where the tokenizer has a `tokenizers` backend, else the Python window."""
    hf = getattr(tokenizer, "tokenizer", tokenizer)  # A PromptTokenizer wraps the HF one.
    backend = getattr(hf, "backend_tokenizer", None)
    if DecodeStream is not None and backend is not None and hasattr(backend, "decode"):
        return StreamDetokenizer(backend, skip_special_tokens)
    return IncrementalDetokenizer(tokenizer, skip_special_tokens)
