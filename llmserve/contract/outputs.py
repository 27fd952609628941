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
    # Set by the router only (a STOP after tool calls); engines never report it.
    TOOL_CALLS = 5


class ErrorCode(enum.IntEnum):
    """Why a request ended with ERROR. Values equal google.rpc.Code (and so gRPC's status
    codes): the router answers the client with exactly this status."""

    OK = 0
    INVALID_ARGUMENT = 3  # The request can never be served as sent.
    DEADLINE_EXCEEDED = 4  # Its deadline passed before it finished.
    ALREADY_EXISTS = 6  # Its id is taken by a live request.
    RESOURCE_EXHAUSTED = 8  # Overload or a cache too small for it: retrying later may work.
    INTERNAL = 13  # A bug or a failed step.
    UNAVAILABLE = 14  # No worker, worker lost, shutting down.


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    rank: int = 0  # Among the whole vocabulary (1: the most likely); 0: not given.


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
    error_code: ErrorCode = ErrorCode.OK  # With ERROR: the status the client gets.
    retry_after_ms: int = 0  # With RESOURCE_EXHAUSTED: when a retry may succeed (0: no hint).
    # With prompt_logprobs, on a sample's first output: the prompt's tokens 1.. (given the
    # tokens before each).
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason != FinishReason.NONE
