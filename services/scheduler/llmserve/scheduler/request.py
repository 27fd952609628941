"""The scheduler's one record per request."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from llmserve.contract.outputs import FinishReason
from llmserve.contract.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()  # Queued; holds no blocks (new, or preempted by recompute).
    RUNNING = enum.auto()  # Holds blocks; scheduled each step while budgets allow.
    SWAPPED = enum.auto()  # Preempted by swap: its blocks wait in the CPU pool.
    FINISHED_STOPPED = enum.auto()  # eos or a stop token.
    FINISHED_LENGTH = enum.auto()  # max_tokens or max_model_len.
    FINISHED_ABORTED = enum.auto()  # The client went away.
    FINISHED_ERROR = enum.auto()  # Cannot be served (too big for the cache, worker error).

    @property
    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.SWAPPED)

    @property
    def finish_reason(self) -> FinishReason:
        return _FINISH_REASONS.get(self, FinishReason.NONE)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(eq=False)
class RequestGroup:
    """What a client asked for: one prompt, `n` samples (vLLM's SequenceGroup).

    With n > 1 the prompt is first prefilled once, without its last token, by a root
    sequence; the root then forks into n sample sequences sharing its blocks.
    """

    request_id: str  # The public id.
    n: int
    priority: int  # Lower is served first.
    arrival_order: int  # FCFS rank among equal priorities.
    sequences: list[Request] = field(default_factory=list)  # Live ones (root or samples).
    num_cached_tokens: int = 0  # Prompt tokens found in the prefix cache at admission.
    admitted: bool = False

    @property
    def key(self) -> tuple[int, int]:
        """Scheduling order: the largest key is preempted first."""
        return (self.priority, self.arrival_order)


@dataclass(eq=False)  # Compared by identity: the queues remove exactly this record.
class Request:
    """One sequence: the only sample of a request, one of its n samples, or the root
    that prefills a multi-sample prompt.

    There are no prefill and decode phases: the tokens still to compute are
    `num_target_tokens - num_computed_tokens`, whether they are a prompt chunk, a whole
    prompt being recomputed after a preemption, or the one token sampled last step.
    """

    request_id: str  # The sequence id (the public id when n == 1).
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: frozenset[int]
    group: RequestGroup
    index: int = 0  # Which sample.
    is_root: bool = False  # Prefills prompt[:-1] for the samples, samples nothing.
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # Tokens whose KV is in the cache (or is in this step).
    num_preemptions: int = 0
    stop_token_id: int = -1  # The eos / stop token that finished the request.
    error: str = ""

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then outputs (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_target_tokens(self) -> int:
        """Tokens whose KV this sequence needs before its next step is done."""
        return self.num_prompt_tokens - 1 if self.is_root else self.num_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.num_target_tokens - self.num_computed_tokens

    @property
    def key(self) -> tuple[int, int]:
        return self.group.key

    @property
    def arrival_order(self) -> int:
        return self.group.arrival_order

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
