"""Stop strings over a stream of text deltas.

A stop string may arrive split over several deltas, so the tail of the text that could
still grow into one is held back until it either completes a stop string (then it and
everything after it are dropped) or can no longer be one (then it is emitted).

When several stop strings match, the one that *ends* first wins (ties: the longer one),
which is what a character-by-character check would see; so the result does not depend
on how the text was cut into deltas.

Text fed with `can_stop=False` (a sample's first min_tokens tokens) is never the end of
a match: a stop string counts only where it ends in text fed later (it may begin
earlier).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Feed text deltas of one sample; get back what may be emitted and any match."""

    def __init__(self, stops: Sequence[str]) -> None:
        # Empty strings would match everywhere; they are ignored.
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stops if s))
        self._max_hold = max((len(s) for s in self.stops), default=1) - 1
        self._held = ""
        self._blocked = 0  # Leading characters of _held fed with can_stop=False: no match ends there.
        self.matched: str | None = None  # The stop string that ended the text, if any.

    @property
    def held(self) -> str:
        """Text held back as a possible start of a stop string."""
        return self._held

    def feed(self, text_delta: str, can_stop: bool = True) -> tuple[str, str | None]:
        """Returns (text to emit now, the stop string matched by this delta or None).
        `can_stop` False: no match may end in this delta (min_tokens).

        After a match everything is dropped: further feeds return ("", None).
        """
        if self.matched is not None:
            return "", None
        if not self.stops:
            return text_delta, None
        text = self._held + text_delta
        blocked = len(text) if not can_stop else self._blocked
        match = self._first_match(text, blocked) if can_stop else None
        if match is not None:
            start, stop = match
            self._held = ""
            self.matched = stop
            return text[:start], stop
        keep = self._partial_suffix_len(text)
        self._held = text[len(text) - keep:]
        self._blocked = max(0, blocked - (len(text) - keep))
        return text[: len(text) - keep], None

    def flush(self) -> str:
        """The held-back text, at the end of the sequence (not a stop string after all)."""
        held, self._held, self._blocked = self._held, "", 0
        return held

    def _first_match(self, text: str, blocked: int = 0) -> tuple[int, str] | None:
        """The first stop string ending after text[:blocked]: (its start, it)."""
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for stop in self.stops:
            i = text.find(stop, max(0, blocked - len(stop) + 1))
            if i < 0:
                continue
            key = (i + len(stop), -len(stop), stop)
            if best is None or key < best:
                best = key
        if best is None:
            return None
        end, neg_len, stop = best
        return end + neg_len, stop

    def _partial_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop."""
        for k in range(min(len(text), self._max_hold), 0, -1):
            tail = text[-k:]
            if any(stop.startswith(tail) for stop in self.stops):
                return k
        return 0
