"""Speculative decoding's drafts: n-gram prompt lookup (vLLM's `ngram` method).

A decoding sample's last n tokens (n from max_n down to min_n) are looked up earlier in
its own tokens (prompt and outputs); the tokens that followed that occurrence are the
draft. The worker computes the sample's last sampled token and the K drafts in one pass,
samples at each of the K + 1 positions and keeps the drafts up to the first one that
differs from what it sampled there, plus that sampled token: 1 to K + 1 tokens per step
for the cost of one memory-bound decode pass.

    tokens:  ... the cat sat on the mat . the cat │        suffix "the cat" (n = 2)
                 ^^^^^^^ found at 0: it was followed by "sat on the mat"
    draft (K = 4): sat on the mat

Repeats that reach the end of the tokens continue from the match again (a sequence stuck
in a loop of period L - p is drafted K tokens ahead, not just to its end).

Every sample keeps an index, n-gram -> the position after its latest occurrence, grown
by the tokens appended since the last step: a lookup is O(max_n - min_n), not a scan
(~12 us a proposal in CPython). The price is memory: ~360 bytes per token with n-grams
2..4 (measured), so 256 sequences of 2,048 tokens hold ~190 MB in the scheduler.
A sample whose drafts were all rejected drafts again only after a pause that doubles
with each such miss (1, 2, 4 ... 16 steps): text that does not repeat stops paying for
drafts it never keeps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserve.scheduler.request import Sample

MAX_PAUSE_STEPS = 16  # The longest pause after rejected drafts.


@dataclass
class NgramIndex:
    """n-gram (a tuple of min_n..max_n tokens) -> the position right after its latest
    occurrence, for every occurrence followed by at least one token."""

    last_seen: dict[tuple[int, ...], int] = field(default_factory=dict)
    next_position: int = 1  # Positions below it have had their n-grams indexed.
    pause_steps: int = 0  # Steps left before the sample drafts again.
    misses: int = 0  # Consecutive steps whose drafts were all rejected.


def _tokens(sample: Sample, start: int, end: int) -> list[int]:
    """sample's tokens [start, end) without copying the whole prompt + outputs."""
    prompt, outputs = sample.prompt_token_ids, sample.output_token_ids
    split = len(prompt)
    if end <= split:
        return prompt[start:end]
    if start >= split:
        return outputs[start - split:end - split]
    return prompt[start:] + outputs[:end - split]


class NgramDrafter:
    """Drafts up to `num_tokens` tokens per decoding sample from n-grams of min_n..max_n."""

    def __init__(self, num_tokens: int, min_n: int, max_n: int) -> None:
        if num_tokens < 1 or not 1 <= min_n <= max_n:
            raise ValueError(f"bad n-gram drafter: {num_tokens} tokens, n-grams {min_n}..{max_n}")
        self.num_tokens, self.min_n, self.max_n = num_tokens, min_n, max_n

    def propose(self, sample: Sample, limit: int) -> list[int]:
        """At most min(limit, num_tokens) draft tokens to follow the sample's tokens
        (none when nothing matches or the sample is pausing)."""
        limit = min(limit, self.num_tokens)
        if limit < 1:
            return []
        index = sample.ngram_index
        if index is None:
            index = sample.ngram_index = NgramIndex()
        if index.pause_steps:
            index.pause_steps -= 1
            return []
        length = sample.num_tokens
        self._extend(index, sample, length)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            position = index.last_seen.get(tuple(_tokens(sample, length - n, length)))
            if position is not None:
                period = length - position  # The match's continuation repeats with this period.
                run = _tokens(sample, position, length)
                return [run[i % period] for i in range(limit)]
        return []

    def _extend(self, index: NgramIndex, sample: Sample, length: int) -> None:
        """Index the n-grams followed by a token, up to the sample's last token."""
        start = index.next_position
        if start >= length:
            return
        offset = max(0, start - self.max_n)  # The window starts max_n tokens before `start`.
        window = _tokens(sample, offset, length)
        seen = index.last_seen
        for position in range(start, length):
            # The n-grams ending right before `position` are followed by its token.
            for n in range(self.min_n, min(self.max_n, position) + 1):
                seen[tuple(window[position - n - offset:position - offset])] = position
        index.next_position = length

    @staticmethod
    def observe(sample: Sample, num_drafts: int, num_accepted: int) -> None:
        """A step verified `num_drafts` drafts of the sample and kept `num_accepted`."""
        index = sample.ngram_index
        if index is None or not num_drafts:
            return
        if num_accepted:
            index.misses = 0
        else:
            index.misses += 1
            index.pause_steps = min(2 ** (index.misses - 1), MAX_PAUSE_STEPS)
