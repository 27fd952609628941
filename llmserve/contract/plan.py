"""The step plan (scheduler -> worker) and the step result (worker -> scheduler).

Plain data: ids and ints only, as in vLLM v1's SchedulerOutput. A request travels in
full (NewRequestData) the first step a worker sees it, and again after a preemption;
otherwise only as a delta (CachedRequestData). The worker never allocates blocks:
block ids arrive ready-made.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserve.contract.outputs import TokenLogprobs
from llmserve.contract.sampling import SamplingParams


@dataclass
class NewRequestData:
    seq_id: int  # The scheduler's sequence id: its own namespace, never a client's id.
    token_ids: list[int]  # Prompt, then the tokens generated before a preemption.
    num_prompt_tokens: int
    sampling: SamplingParams  # The request's, with this sample's seed; the worker reads what it samples with.
    block_ids: list[int]  # The whole block table.
    num_computed_tokens: int  # KV already in the cache (prefix-cache hits).
    num_scheduled_tokens: int  # Tokens to compute this step.
    trace_context: dict[str, str] = field(default_factory=dict)  # W3C; empty when tracing is off.
    # Speculative decoding: tokens drafted after token_ids, computed after its last token
    # and counted in num_scheduled_tokens (1 + drafts); the worker samples at each.
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass
class CachedRequestData:
    seq_id: int
    new_block_ids: list[int]  # Appended to the worker's copy of the block table.
    num_computed_tokens: int  # Before this step.
    num_scheduled_tokens: int
    draft_token_ids: list[int] = field(default_factory=list)  # As NewRequestData's.


@dataclass
class StepPlan:
    step_id: int
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    # Requests whose state the worker drops: finished, aborted or preempted.
    finished_seq_ids: list[int] = field(default_factory=list)
    # Block moves the worker performs before the forward, in this order:
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, gpu block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src gpu block, dst gpu block)
    # Decode steps to run back to back (multi-step scheduling). Above 1 every scheduled
    # request computes one token, its last sampled one, and each step feeds its sampled
    # tokens to the next; block tables already hold the slots of all num_steps tokens.
    num_steps: int = 1
    trace_context: dict[str, str] = field(default_factory=dict)  # The step span's (W3C); may be empty.

    @property
    def total_scheduled_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.new_requests) + sum(
            r.num_scheduled_tokens for r in self.cached_requests
        )

    def num_drafts(self) -> dict[int, int]:
        """Draft tokens per sequence id, for the sequences that carry some."""
        return {r.seq_id: len(r.draft_token_ids) for r in (*self.new_requests, *self.cached_requests)
                if r.draft_token_ids}

    @property
    def has_block_ops(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.copies)

    @property
    def is_empty(self) -> bool:
        """Nothing for a worker to do (no request scheduled, no block to move)."""
        return not self.new_requests and not self.cached_requests and not self.has_block_ops


@dataclass
class SampledToken:
    seq_id: int
    token_id: int
    logprobs: TokenLogprobs | None = None


@dataclass
class PromptLogprobs:
    """One step's prompt logprobs for one request: logprobs[i] is of prompt token start + i
    (>= 1), given the tokens before it."""

    seq_id: int
    start: int
    logprobs: list[TokenLogprobs]


@dataclass
class StepResult:
    step_id: int
    # One per sampling request per step run, step by step (a request's tokens in order).
    sampled: list[SampledToken] = field(default_factory=list)
    error: str = ""
    num_steps: int = 1  # Steps run: the plan's num_steps, fewer when interrupted.
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)  # Rows that asked, mid-prefill.
