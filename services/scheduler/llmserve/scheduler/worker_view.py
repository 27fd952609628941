"""What the worker already knows, and the StepPlan that tells it the rest.

A worker keeps its own copy of each sequence (tokens, block table, computed count). The
plan carries a sequence in full (NewRequestData) the first time the worker sees it, and
again after the worker dropped it (finished, preempted, forked, or a copy-on-write
replaced a table entry it holds); otherwise only a delta (CachedRequestData: its new
block ids). Dropped ids go out in the next non-empty plan's finished_seq_ids.

    step:              1          2          3 (preempted)   4 (back)
    plan carries s:    new        cached     finished id     new (in full again)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from llmserve.contract.plan import CachedRequestData, NewRequestData, StepPlan
from llmserve.contract.sampling import SamplingParams
from llmserve.scheduler.kv_cache_manager import KVCacheManager
from llmserve.scheduler.request import Sample


def _worker_sampling(sample: Sample) -> SamplingParams:
    """The sample's settings as its worker samples with them. The worker masks a row's
    stop token ids until it has min_tokens outputs; the ids that end a sample are the
    model's eos ids too (unless ignore_eos), which the scheduler holds: they join the
    worker's stop_token_ids here. Stopping itself stays the scheduler's (its own
    sample.sampling, unchanged)."""
    sampling = sample.sampling
    if not sampling.min_tokens or sampling.ignore_eos:
        return sampling
    extra = sorted(sample.request.eos_token_ids - set(sampling.stop_token_ids))
    return replace(sampling, stop_token_ids=sampling.stop_token_ids + tuple(extra)) if extra else sampling


@dataclass(slots=True)
class ScheduledSample:
    """One sample's share of a step: the tokens it computes and the blocks it gained."""

    sample: Sample
    num_tokens: int
    new_block_ids: list[int]
    table_changed: bool = False  # An entry was replaced (copy-on-write): resend in full.
    # Speculative decoding: tokens drafted after the sample's last one, counted in
    # num_tokens (1 + drafts), counted as computed only once the worker accepts them.
    draft_token_ids: list[int] = field(default_factory=list)


class WorkerView:
    """Builds each step's plan from the samples' known-to-worker flags."""

    def __init__(self, kv: KVCacheManager, max_model_len: int) -> None:
        """Plans for a worker that knows nothing yet, with block ops taken from `kv`, for
        samples of at most `max_model_len` tokens."""
        self.kv = kv
        self.max_model_len = max_model_len
        self._next_step_id = 0
        # By step id, until its result is applied: the samples the step samples a token
        # for, each with whether that token got a placeholder (Sample.num_pending_tokens).
        self._sampling: dict[int, dict[Sample, bool]] = {}
        # Sequence ids the worker must drop, in order (an ordered set). Ids, not records:
        # a finished sample's record is gone.
        self._to_drop: dict[int, None] = {}

    def drop(self, sample: Sample) -> None:
        """The worker must forget the sample (finished, preempted or forked)."""
        # NOTE: an id can be in finished_seq_ids and new_requests of one plan (a sample
        # resent in full after a preemption); workers apply finished_seq_ids first.
        if sample.known_to_worker:  # A sample never sent holds no worker state.
            sample.known_to_worker = False
            self._to_drop[sample.seq_id] = None

    def redrop(self, seq_ids: list[int]) -> None:
        """The ids a plan the worker may not have applied asked it to drop: they go out
        again with the next plan (dropping twice is harmless)."""
        self._to_drop.update(dict.fromkeys(seq_ids))

    def build_plan(self, scheduled: list[ScheduledSample], num_steps: int = 1) -> StepPlan:
        """The step's plan; advances each scheduled sample's computed count and offers
        the blocks it fills to the prefix cache.

        An empty plan may never reach the worker: its finished ids are kept for the next.
        """
        ops = self.kv.take_block_ops()
        plan = StepPlan(
            step_id=self._next_step_id, finished_seq_ids=list(self._to_drop),
            swap_out=ops.swap_out, swap_in=ops.swap_in, copies=ops.copies, num_steps=num_steps,
        )
        self._next_step_id += 1
        sampling: dict[Sample, bool] = {}
        for item in scheduled:
            self._add(plan, item, sampling)
        if sampling:
            self._sampling[plan.step_id] = sampling
        if not plan.is_empty:
            self._to_drop = {}
        return plan

    def _add(self, plan: StepPlan, item: ScheduledSample, sampling: dict[Sample, bool]) -> None:
        """Put the sample in the plan, in full or as a delta, and count its tokens computed;
        a sample the step samples a token for goes in `sampling` (see _sampling)."""
        sample = item.sample
        if sample.known_to_worker and not item.table_changed:
            plan.cached_requests.append(CachedRequestData(
                sample.seq_id, item.new_block_ids, sample.num_computed_tokens, item.num_tokens, item.draft_token_ids))
        else:
            self._add_in_full(plan, item)
        sample.num_computed_tokens += item.num_tokens - len(item.draft_token_ids)
        if not sample.is_root and sample.num_computed_tokens == sample.num_target_tokens:
            # NOTE: the last token (max_tokens or max_model_len) gets no placeholder, so no
            # later plan schedules the sample: with it, the step's target is what it computed.
            placeholder = self._continues(sample)
            sample.num_pending_tokens += placeholder
            sampling[sample] = placeholder
        self.kv.prefix.cache_full_blocks(sample)
        self.kv.release_outside_window(sample)

    def _add_in_full(self, plan: StepPlan, item: ScheduledSample) -> None:
        """The worker gets the whole sample: it never had it, dropped it, or holds a table
        a copy-on-write changed (it drops that copy first)."""
        sample = item.sample
        if sample.known_to_worker:  # (its table changed)
            plan.finished_seq_ids.append(sample.seq_id)
        if sample.num_pending_tokens:
            # Only the worker knows the placeholders' ids: a row sent in full would
            # lack them (Scheduler.can_schedule_ahead keeps such steps serial).
            raise RuntimeError(f"{sample.label} would be sent in full with {sample.num_pending_tokens} "
                               "tokens pending")
        sample.known_to_worker = True
        plan.new_requests.append(self._new_data(item))

    def _continues(self, sample: Sample) -> bool:
        """The token this row samples (after those pending) may be followed by more: its
        length limits are not reached (eos or a stop is only known from the result)."""
        after = sample.num_pending_tokens + 1
        return (sample.num_output_tokens + after < sample.sampling.max_tokens
                and sample.num_tokens + after < self.max_model_len)

    def in_flight(self, sample: Sample) -> bool:
        """A plan whose result is not applied yet samples a token for the sample."""
        return any(sample in sampling for sampling in self._sampling.values())

    def take_pending(self, step_id: int) -> set[Sample]:
        """The step's result is in (or never comes): its placeholders are resolved.
        Returns the samples it sampled a token for (whatever happened to them since)."""
        sampling = self._sampling.pop(step_id, {})
        for sample, placeholder in sampling.items():
            sample.num_pending_tokens -= placeholder
        return set(sampling)

    def _new_data(self, item: ScheduledSample) -> NewRequestData:
        sample = item.sample
        return NewRequestData(
            seq_id=sample.seq_id,
            token_ids=sample.all_token_ids,
            num_prompt_tokens=sample.num_prompt_tokens,
            sampling=_worker_sampling(sample),  # Whole: the worker reads what it samples with.
            block_ids=self.kv.get_block_ids(sample),
            num_computed_tokens=sample.num_computed_tokens,
            num_scheduled_tokens=item.num_tokens,
            draft_token_ids=item.draft_token_ids,
        )
