"""A request's token counts, counted once (`Usage.of`) and written in each front door's
format: the gRPC `Usage` message and OpenAI's `usage` object."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from llmserve.router.sample_stream import SampleStream
from llmserve.v1 import generation_pb2


@dataclass(frozen=True)
class Usage:
    """A request's token counts, as both front doors report them."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # Prompt tokens whose KV came from the prefix cache.

    @classmethod
    def of(cls, prompt_tokens: int, streams: Iterable[SampleStream]) -> Usage:
        """The usage of one request from its samples' streams (every sample: n > 1 counts
        each one's tokens; the prefix cache is shared, so its hit is the largest)."""
        streams = list(streams)
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=sum(s.num_tokens for s in streams),
            # A migrated request's new replica counts its resumed tokens as prompt: cap at the prompt.
            cached_tokens=min(prompt_tokens, max((s.num_cached_tokens for s in streams), default=0)),
        )

    @classmethod
    def summed(cls, usages: Iterable[Usage]) -> Usage:
        """The usage of a batch of prompts (an OpenAI completions request): every count summed."""
        usages = list(usages)
        return cls(prompt_tokens=sum(u.prompt_tokens for u in usages),
                   completion_tokens=sum(u.completion_tokens for u in usages),
                   cached_tokens=sum(u.cached_tokens for u in usages))

    def to_pb(self) -> generation_pb2.Usage:
        return generation_pb2.Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                                    cached_tokens=self.cached_tokens)

    def to_openai(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
