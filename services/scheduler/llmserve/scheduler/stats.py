"""The scheduler's lifetime counters and the stats snapshot built from them."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserve.scheduler.admission import REFUSAL_REASONS, Admission
from llmserve.scheduler.kv_cache_manager import KVCacheManager
from llmserve.scheduler.queues import Queues
from llmserve.scheduler.request import RequestStatus


@dataclass(frozen=True)
class SchedulerStats:
    num_waiting: int  # Sequences.
    num_running: int
    num_swapped: int
    num_total_blocks: int
    num_free_blocks: int  # Cached-but-unused blocks count as free (evictable).
    kv_cache_usage: float  # Fraction of blocks in use.
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    num_preemptions: int  # Both modes.
    num_preemptions_recompute: int
    num_preemptions_swap: int
    num_swapped_out_blocks: int  # Blocks copied to the CPU, lifetime.
    num_cached_blocks: int  # Blocks carrying a prefix-cache hash.
    prefix_cache_queries: int  # Tokens looked up in the prefix cache.
    prefix_cache_hits: int  # Of those, tokens found.
    num_allocated_blocks: int  # Blocks handed out by the pool, lifetime.
    num_cow_copies: int  # Copy-on-write block copies, lifetime.
    num_steps: int  # Non-empty plans built.
    num_finished: int  # Sequences finished with STOP or LENGTH.
    num_aborted: int
    num_failed: int  # Finished with ERROR.
    prompt_tokens_total: int  # Prompt tokens of admitted requests (recomputes not counted).
    generation_tokens_total: int  # Tokens sampled and kept.
    # Admission control and deadlines (see admission.py, deadlines.py).
    num_queued_requests: int = 0  # Requests waiting or swapped out.
    num_queued_tokens: int = 0  # Tokens they must compute before their next token.
    max_queued_requests: int = 0  # The bounds.
    max_queued_tokens: int = 0
    saturated: bool = False
    num_refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REFUSAL_REASONS, 0))  # By reason.
    num_expired: int = 0  # Requests ended by their deadline.
    # Speculative decoding (see ngram_drafter.py), lifetime.
    spec_num_drafts: int = 0  # Sequence-steps that carried drafts.
    spec_num_draft_tokens: int = 0  # Tokens drafted and verified.
    spec_num_accepted_tokens: int = 0  # Of those, tokens kept.
    spec_accepted_per_position: tuple[int, ...] = ()  # [i]: drafts whose token i was kept.

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted over drafted tokens (0 when nothing was drafted)."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a drafted sequence-step produced on average: 1 + accepted drafts."""
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0


def _finished_counts() -> dict[RequestStatus, int]:
    return {status: 0 for status in RequestStatus if status.is_finished}


@dataclass
class Counters:
    """Lifetime counts the scheduler's parts add to (the KV cache keeps its own)."""

    preemptions_recompute: int = 0
    preemptions_swap: int = 0
    num_steps: int = 0  # Non-empty plans built.
    finished: dict[RequestStatus, int] = field(default_factory=_finished_counts)  # Samples, by end.
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    requests_admitted: int = 0  # Requests scheduled for the first time.
    requests_expired: int = 0  # Requests ended by their deadline.
    spec_drafts: int = 0  # Sequence-steps that carried drafts.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # [i]: drafts whose token i was kept; one entry per draft position 0..K-1 (the scheduler
    # sizes it), so every position is reported from the start.
    spec_accepted_per_position: list[int] = field(default_factory=list)

    @property
    def num_preemptions(self) -> int:
        return self.preemptions_recompute + self.preemptions_swap


def snapshot(counters: Counters, queues: Queues, kv: KVCacheManager, admission: Admission) -> SchedulerStats:
    """A SchedulerStats of the queues' lengths, the cache's use and the lifetime counters."""
    finished = counters.finished
    num_queued_requests, num_queued_tokens = admission.load()
    return SchedulerStats(
        num_waiting=len(queues.waiting),
        num_running=len(queues.running),
        num_swapped=sum(len(unit) for unit in queues.swapped),
        num_total_blocks=kv.num_total_blocks,
        num_free_blocks=kv.num_free_blocks,
        kv_cache_usage=kv.usage,
        num_cpu_blocks=kv.num_cpu_blocks,
        num_free_cpu_blocks=kv.num_free_cpu_blocks,
        num_preemptions=counters.num_preemptions,
        num_preemptions_recompute=counters.preemptions_recompute,
        num_preemptions_swap=counters.preemptions_swap,
        num_swapped_out_blocks=kv.num_swapped_out_blocks,
        num_cached_blocks=kv.pool.num_cached_blocks,
        prefix_cache_queries=kv.prefix.query_tokens,
        prefix_cache_hits=kv.prefix.hit_tokens,
        num_allocated_blocks=kv.pool.num_allocated_total,
        num_cow_copies=kv.num_cow_copies,
        num_steps=counters.num_steps,
        num_finished=finished[RequestStatus.FINISHED_STOPPED] + finished[RequestStatus.FINISHED_LENGTH],
        num_aborted=finished[RequestStatus.FINISHED_ABORTED],
        num_failed=finished[RequestStatus.FINISHED_ERROR],
        prompt_tokens_total=counters.prompt_tokens_total,
        generation_tokens_total=counters.generation_tokens_total,
        num_queued_requests=num_queued_requests,
        num_queued_tokens=num_queued_tokens,
        max_queued_requests=admission.max_requests,
        max_queued_tokens=admission.max_tokens,
        saturated=admission.saturated,
        num_refused=dict(admission.refused),
        num_expired=counters.requests_expired,
        spec_num_drafts=counters.spec_drafts,
        spec_num_draft_tokens=counters.spec_draft_tokens,
        spec_num_accepted_tokens=counters.spec_accepted_tokens,
        spec_accepted_per_position=tuple(counters.spec_accepted_per_position),
    )
