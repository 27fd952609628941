"""What the engine reports per request per step (scheduler -> router)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.IntEnum):
    # Values equal the public proto enum llmserve.v1.FinishReason.
    NONE = 0
    STOP = 1
    LENGTH = 2
    ABORT = 3
    ERROR = 4


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass
class RequestOutput:
    request_id: str
    index: int = 0  # Which of the request's n samples.
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason = FinishReason.NONE
    num_cached_tokens: int = 0
    error: str = ""
    stop_token_id: int = -1  # The eos / stop token that ended the request, or -1.

    @property
    def finished(self) -> bool:
        return self.finish_reason != FinishReason.NONE
