"""Which samples compute how many tokens this step: the batching policy.

Each step:
  0. A waiting sample of better priority than the worst running one, and with no room,
     preempts running requests, worst first.
  1. RUNNING samples, best first, each get min(uncomputed tokens, token budget left):
     a decode (1 token) or the next chunk of a prompt; a chunk leaves one token of
     budget for every decode after it. The samples of one request are allocated
     together (copy-on-write included). When blocks run out the worst running request
     is preempted, all its samples at once (see preemption.py).
  2. If nothing was preempted: swapped units are brought back, best first, while blocks
     and seats allow.
  3. If nothing was preempted in 1 and no swapped unit has a better key: WAITING
     samples are admitted in order while seats, the budget and free blocks allow,
     reusing their longest cached prefix (a long prompt gets a chunk).
  4. Speculative decoding: the scheduled plain decodes, best first, take drafts
     (ngram_drafter.py) from what is left of the token budget and the free blocks.
     Drafts only use what no sample needed: they never delay a prompt nor preempt.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.scheduler.kv_cache_manager import KVCacheManager
from llmserve.scheduler.ngram_drafter import NgramDrafter
from llmserve.scheduler.preemption import Preemptor
from llmserve.scheduler.queues import Queues
from llmserve.scheduler.request import Request, Sample
from llmserve.scheduler.stats import Counters
from llmserve.scheduler.worker_view import ScheduledSample

Items = list[tuple[Sample, int]]  # (sample, tokens to compute) pairs to allocate together.


@dataclass
class _Budget:
    """The step's token budget while the running queue is walked."""

    tokens: int
    decodes_left: int  # Decodes not visited yet: a chunk leaves one token for each.

    def take(self, sample: Sample) -> int:
        """The tokens `sample` computes this step (0: none), taken from the budget."""
        uncomputed = sample.num_uncomputed_tokens
        self.decodes_left -= uncomputed == 1
        room = self.tokens if uncomputed == 1 else self.tokens - self.decodes_left
        num_new = max(0, min(uncomputed, room))
        self.tokens -= num_new
        return num_new


class StepPolicy:
    """Chooses a step's scheduled samples and allocates their blocks."""

    def __init__(self, config, kv: KVCacheManager, queues: Queues, preemptor: Preemptor,
                 counters: Counters, max_model_len: int) -> None:
        """Schedule under `config`'s budgets (a SchedulerConfig) for samples of at most
        `max_model_len` tokens."""
        self.config = config
        self.kv = kv
        self.queues = queues
        self.preemptor = preemptor
        self.counters = counters
        self.max_model_len = max_model_len
        k = config.num_speculative_tokens
        self.drafter = NgramDrafter(k, config.speculative_ngram_min, config.speculative_ngram_max) if k else None

    def choose(self) -> list[ScheduledSample]:
        """This step's samples and token counts, their blocks allocated (steps 0-4)."""
        scheduled: list[ScheduledSample] = []
        start = self.counters.num_preemptions
        self._preempt_for_priority()
        after_priority = self.counters.num_preemptions
        budget = self._schedule_running(self.config.max_num_batched_tokens, scheduled)
        if self.counters.num_preemptions == start:
            budget = self._schedule_swapped(budget, scheduled)
        if self.counters.num_preemptions == after_priority and self.queues.waiting_goes_first():
            budget = self._schedule_waiting(budget, scheduled)
        if self.drafter is not None and self._drafts_pay_off(scheduled):
            self._add_drafts(budget, scheduled)
        return scheduled

    # ---- 0. priority ----

    def _preempt_for_priority(self) -> None:
        """Preempt running requests of worse priority than the first waiting sample
        while it has no seat or no blocks for its first chunk."""
        queues = self.queues
        while queues.waiting and queues.running:
            head, victim = queues.waiting[0], queues.running[-1]
            if victim.request.priority <= head.request.priority:
                return
            if queues.has_seats(head) and self._admissible(head):
                return
            self.preemptor.preempt(victim.request)

    def _admissible(self, sample: Sample) -> bool:
        """The free blocks hold the sample's first chunk (after its cached prefix)."""
        cached = self.kv.prefix.computed_blocks(sample)
        num_cached = len(cached) * self.kv.block_size
        num_new = sample.num_target_tokens - num_cached
        if self.config.enable_chunked_prefill:
            num_new = min(num_new, self.config.max_num_batched_tokens)
        needed = self.kv.num_blocks_for(num_cached + num_new) - len(cached)
        needed += sum(1 for b in cached if self.kv.pool.ref_count(b) == 0)
        return needed <= self.kv.num_free_blocks

    # ---- 1. running ----

    def _schedule_running(self, tokens: int, scheduled: list[ScheduledSample]) -> int:
        """Schedule running samples best first, one request (all its samples) at a time,
        preempting the worst request when blocks run out. Returns the budget left."""
        running = self.queues.running
        budget = _Budget(tokens, sum(1 for s in running if s.num_uncomputed_tokens == 1))
        i = 0
        while i < len(running) and budget.tokens > 0:
            i = self._schedule_in_place_decodes(i, budget, scheduled)
            if i == len(running) or budget.tokens <= 0:
                break
            # NOTE: preemptions only remove requests after this one: i stays valid.
            end = self.queues.end_of_request(i)
            items = [(s, n) for s in running[i:end] if (n := budget.take(s)) > 0]
            if items and not self._allocate_or_preempt(running[i].request, items, scheduled):
                break  # It preempted itself: no room for anyone after it.
            i = end
        return budget.tokens

    def _schedule_in_place_decodes(self, i: int, budget: _Budget, scheduled: list[ScheduledSample]) -> int:
        """Schedule running[i:] while each is its request's only running sample and a
        decode whose token fits a block it holds alone (the common step at large batches):
        nothing to allocate, copy or preempt, so none of the general path's checks.
        Returns the index of the first sample that is not such a decode."""
        running, kv = self.queues.running, self.kv
        last = len(running) - 1
        while budget.tokens > 0 and i <= last:
            sample = running[i]
            if (sample.num_uncomputed_tokens != 1 or not kv.writes_in_place(sample)
                    or (i < last and running[i + 1].request is sample.request)):
                break
            budget.tokens -= 1
            budget.decodes_left -= 1
            scheduled.append(ScheduledSample(sample, 1, []))
            i += 1
        return i

    def _allocate_or_preempt(self, request: Request, items: Items, scheduled: list[ScheduledSample]) -> bool:
        """Allocate slots for the request's items, preempting the worst running request
        until they fit. Returns False if `request` itself had to be preempted."""
        while self.kv.blocks_needed(items) > self.kv.num_free_blocks:
            victim = self.queues.running[-1].request
            self.preemptor.preempt(victim)
            if victim is request:
                return False
        self._allocate(items, scheduled)
        return True

    def _allocate(self, items: Items, scheduled: list[ScheduledSample]) -> None:
        """Allocate the items' slots (they fit: the caller checked) and schedule them."""
        for sample, num_new in items:
            new_block_ids = self.kv.grow(sample, num_new)
            replaced = self.kv.take_replaced(sample)
            scheduled.append(ScheduledSample(sample, num_new, new_block_ids, replaced))

    # ---- 2. swapped ----

    def _schedule_swapped(self, budget: int, scheduled: list[ScheduledSample]) -> int:
        """Bring swapped units back, best first, while blocks, seats and budget allow,
        and schedule them in the same step. Returns the budget left."""
        queues = self.queues
        while queues.swapped and budget > 0 and queues.swapped_goes_first():
            unit = queues.swapped[0]
            if not queues.has_seats(unit[0], len(unit)):
                break
            items, left = _swap_in_items(unit, budget)
            needed = self.kv.num_swap_in_blocks(unit) + self.kv.blocks_needed(items, swapped=True)
            if needed > self.kv.num_free_blocks:
                break
            budget = left
            self._swap_in(unit, items, scheduled)
        return budget

    def _swap_in(self, unit: list[Sample], items: Items, scheduled: list[ScheduledSample]) -> None:
        """Bring the first swapped unit back to the GPU and schedule its items."""
        self.queues.swapped.pop(0)
        self.kv.swap_in(unit)
        for sample in unit:
            self.queues.run(sample)
        self._allocate(items, scheduled)

    # ---- 3. waiting ----

    def _schedule_waiting(self, budget: int, scheduled: list[ScheduledSample]) -> int:
        """Admit waiting samples in order while seats, token budget and blocks allow.
        Returns the budget left."""
        while self.queues.waiting and budget > 0:
            sample = self.queues.waiting[0]
            if not self.queues.has_seats(sample):
                break
            num_new = self._admit(sample, budget, scheduled)
            if num_new is None:
                break
            budget -= num_new
        return budget

    def _admit(self, sample: Sample, budget: int, scheduled: list[ScheduledSample]) -> int | None:
        """Admit the first waiting sample with its cached prefix and a first chunk of at
        most `budget` tokens. Returns the chunk, or None when it cannot start now."""
        cached = self.kv.prefix.computed_blocks(sample)
        num_new = sample.num_target_tokens - len(cached) * self.kv.block_size
        if num_new > budget:
            if not self.config.enable_chunked_prefill:
                return None
            num_new = budget
        new_block_ids = self.kv.admit(sample, cached, num_new)
        if new_block_ids is None:
            return None
        self.queues.waiting.pop(0)
        self.queues.run(sample)
        scheduled.append(ScheduledSample(sample, num_new, new_block_ids))
        self._count_admission(sample)
        return num_new

    # ---- 4. drafts ----

    def _drafts_pay_off(self, scheduled: list[ScheduledSample]) -> bool:
        """False above --speculative-disable-by-batch-size scheduled sequences."""
        cap = self.config.speculative_disable_by_batch_size
        return cap is None or len(scheduled) <= cap

    def _add_drafts(self, budget: int, scheduled: list[ScheduledSample]) -> None:
        """Give the scheduled plain decodes, best first, the drafts the budget left and
        the free blocks hold; each keeps max_tokens and max_model_len (the step's tokens
        after its drafts are kept whole)."""
        for item in scheduled:
            if budget <= 0:
                return
            sample = item.sample
            if item.num_tokens != 1 or sample.is_root or sample.num_uncomputed_tokens != 1:
                continue
            if sample.sampling.structured_output is not None:
                continue  # NOTE: constrained rows take no drafts (the worker's grammar matcher
                # advances one sampled token at a time; it refuses drafts).
            limit = min(budget, sample.sampling.max_tokens - sample.num_output_tokens - 1,
                        self.max_model_len - sample.num_tokens - 1)
            drafts = self.drafter.propose(sample, limit)
            if not drafts:
                continue
            more = self.kv.allocate_slots(sample, 1 + len(drafts))
            if more is None:
                continue  # No free blocks for them: the decode goes alone.
            item.new_block_ids = item.new_block_ids + more
            item.num_tokens += len(drafts)
            item.draft_token_ids = drafts
            budget -= len(drafts)

    def _count_admission(self, sample: Sample) -> None:
        """The request's first admission: its prefix hits and prompt tokens (a recompute
        after a preemption is not counted again)."""
        request = sample.request
        if not request.admitted:
            request.admitted = True
            request.num_cached_tokens = sample.num_computed_tokens
            self.counters.requests_admitted += 1
            self.counters.prompt_tokens_total += sample.num_prompt_tokens


def _swap_in_items(unit: list[Sample], budget: int) -> tuple[Items, int]:
    """The unit's samples' tokens to compute within `budget`, and the budget left."""
    items = []
    for sample in unit:
        num_new = min(sample.num_uncomputed_tokens, budget)
        if num_new > 0:
            items.append((sample, num_new))
            budget -= num_new
    return items, budget
