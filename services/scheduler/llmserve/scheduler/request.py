"""The scheduler's records: one `Request` per client request, one `Sample` per sequence.

    Request "r" (n = 2)          what the client asked for: prompt, sampling, n, priority,
      │                          when it was first admitted, its stream state (routers.py)
      ├── Sample 7  "r#p" root   prefills prompt[:-1] once, samples nothing, then forks:
      ├── Sample 8  "r#0"        one sequence each: tokens, computed count, status, block
      └── Sample 9  "r#1"        tables (GPU, CPU), prefix hashes, what the worker was sent

Sequence ids (7, 8, 9) are the ids workers know: integers from one process-wide counter,
so no client id (whatever characters it holds) can collide with one. Labels ("r#0")
are for logs only. Everything the scheduler, the KV cache manager and the service keep
about a request lives on these two records; the managers hold references to them.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field, replace

from typing import TYPE_CHECKING

from llmserve.contract.outputs import ErrorCode, FinishReason, TokenLogprobs
from llmserve.contract.sampling import SamplingParams, sample_seed

if TYPE_CHECKING:  # The service's types; the core never imports them.
    from llmserve.scheduler.routers import RouterSession
    from llmserve.scheduler.telemetry import RequestSpans


class RequestStatus(enum.Enum):
    """Where a sample stands (every live sample of a request shares its queue state)."""

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


@dataclass
class HeldTokens:
    """A sample's tokens produced but not yet streamed (see stream_interval.py)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass
class StreamState:
    """The service's side of a request: who receives its outputs, what is held back, and
    its spans. Requests added straight to the core (tests, the in-process engine, the
    readiness probe) have no owner and no spans."""

    # The router session (routers.RouterSession) it streams to; None: nobody's.
    owner: RouterSession | None = None
    # By sample index: present once the sample's first token was sent, until it ends.
    held: dict[int, HeldTokens] = field(default_factory=dict)
    spans: RequestSpans | None = None  # Its queue / prefill / request spans (telemetry.py).


@dataclass(eq=False)  # Compared and hashed by identity: managers hold exactly this record.
class Request:
    """What a client asked for: one prompt, `n` samples (vLLM's SequenceGroup).

    With n > 1 the prompt is first prefilled once, without its last token, by a root
    sample; the root then forks into n samples sharing its blocks.
    """

    request_id: str  # The public id.
    prompt_token_ids: list[int]
    sampling: SamplingParams  # As asked; sample i of n > 1 draws with seed + i (wrapped, sample_seed).
    eos_token_ids: frozenset[int]
    n: int = 1
    priority: int = 0  # Lower is served first.
    arrival_order: int = 0  # FCFS rank among equal priorities.
    arrival_time: float = field(default_factory=time.monotonic)
    deadline: float | None = None  # time.monotonic() after which it ends with DEADLINE_EXCEEDED.
    # The parent key of its first block (block_hash.salt_key of its cache salt; None: unsalted):
    # its blocks are shared only with requests of the same salt.
    salt_key: bytes | None = None
    samples: list[Sample] = field(default_factory=list)  # Live ones (the root, or the samples).
    num_cached_tokens: int = 0  # Prompt tokens found in the prefix cache at admission.
    # With sampling.prompt_logprobs: prompt tokens 1.. so far (the workers compute them
    # chunk by chunk); each sample's first output carries them.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    admitted: bool = False
    stream: StreamState = field(default_factory=StreamState)

    @property
    def key(self) -> tuple[int, int]:
        """Scheduling order: the largest key is preempted first."""
        return (self.priority, self.arrival_order)

    @property
    def is_finished(self) -> bool:
        """No sample is left waiting, running or swapped."""
        return not self.samples

    def first_samples(self) -> list[Sample]:
        """What is queued at arrival: a root when n > 1 (and there is a prompt[:-1] to
        share), else the n samples themselves."""
        if self.n > 1 and len(self.prompt_token_ids) > 1:
            return [Sample(self, self.sampling, is_root=True)]
        return self.new_samples()

    def new_samples(self) -> list[Sample]:
        """The request's n samples, each with its own sequence id and seed."""
        return [Sample(self, self._sample_sampling(i), index=i) for i in range(self.n)]

    def _sample_sampling(self, index: int) -> SamplingParams:
        """Sample `index` draws with seed + index (wrapped into int64): alone with that
        seed it gives the same tokens."""
        if self.n == 1 or self.sampling.seed is None:
            return self.sampling
        return replace(self.sampling, seed=sample_seed(self.sampling.seed, index))


_SEQ_IDS = itertools.count(1)


@dataclass(eq=False)  # Compared and hashed by identity: the queues remove exactly this record.
class Sample:
    """One sequence: the only sample of a request, one of its n samples, or the root
    that prefills a multi-sample prompt.

    There are no prefill and decode phases: the tokens still to compute are
    `num_target_tokens - num_computed_tokens`, whether they are a prompt chunk, a whole
    prompt being recomputed after a preemption, or the one token sampled last step.
    """

    request: Request
    sampling: SamplingParams
    index: int = 0  # Which sample.
    is_root: bool = False  # Prefills prompt[:-1] for the samples, samples nothing.
    # The id on the wire to workers (uint64 there): unique in this process, never reused.
    seq_id: int = field(default_factory=lambda: next(_SEQ_IDS))
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # Tokens whose KV is in the cache (or is in this step).
    # Tokens planned to be sampled by plans not applied yet that may be followed by more
    # (a placeholder each: the worker knows the real id, the scheduler learns it with the
    # plan's result). They count as targets, so a pipelined next plan can compute them.
    num_pending_tokens: int = 0
    stop_token_id: int = -1  # The eos / stop token that finished the sample.
    error: str = ""
    error_code: ErrorCode = ErrorCode.OK  # Why it ended with ERROR.
    # ---- KV cache: kept by KVCacheManager only ----
    block_table: list[int] = field(default_factory=list)  # GPU block ids (see kv_cache_manager.py).
    cpu_table: list[int] = field(default_factory=list)  # While swapped out: CPU block ids.
    block_hashes: list[bytes] = field(default_factory=list)  # Of its full blocks so far (memo).
    num_offered_blocks: int = 0  # Leading table blocks offered to the prefix cache.
    num_released_blocks: int = 0  # Leading table entries a sliding window left behind (RELEASED).
    table_replaced: bool = False  # A copy-on-write replaced a table entry this step.
    # ---- worker view: kept by WorkerView only ----
    known_to_worker: bool = False  # Sent in full since the worker last dropped it.
    # ---- speculative decoding: kept by NgramDrafter only (an ngram_drafter.NgramIndex) ----
    ngram_index: object | None = None

    @property
    def label(self) -> str:
        """For logs: the public id, with "#<index>" for one of n > 1 samples, "#p" for a root."""
        request = self.request
        if self.is_root:
            return f"{request.request_id}#p"
        return request.request_id if request.n == 1 else f"{request.request_id}#{self.index}"

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then outputs (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building all_token_ids: a block's tokens, read
        each time a block fills (a 1,024-token prompt would be copied for every block)."""
        prompt = self.prompt_token_ids
        split = len(prompt)
        if end <= split:
            return prompt[start:end]
        if start >= split:
            return self.output_token_ids[start - split : end - split]
        return prompt[start:] + self.output_token_ids[: end - split]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        # NOTE: read several times per row per step: no property hops
        return len(self.request.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_target_tokens(self) -> int:
        """Tokens whose KV this sample needs before its next step is done."""
        if self.is_root:
            return len(self.request.prompt_token_ids) - 1
        return len(self.request.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        # NOTE: read several times per running sample per step: num_target_tokens inlined
        if self.is_root:
            return len(self.request.prompt_token_ids) - 1 - self.num_computed_tokens
        return (len(self.request.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens
                - self.num_computed_tokens)

    @property
    def key(self) -> tuple[int, int]:
        return self.request.key

    @property
    def arrival_order(self) -> int:
        return self.request.arrival_order

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
