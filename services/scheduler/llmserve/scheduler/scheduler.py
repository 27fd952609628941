"""Continuous-batching scheduler: it owns the KV block tables and turns queues of
sequences into one StepPlan per step.

Loop: `plan = schedule()` -> a worker executes it -> `update_from_output(plan, result)`.

Queues, each ordered by (priority, arrival): `waiting` (sequences holding no blocks),
`running` (holding GPU blocks), `swapped` (units of sequences whose blocks are on the CPU).

Each step:
  0. A waiting sequence of better priority than the worst running one, and with no room,
     preempts running requests, worst first.
  1. RUNNING sequences, best first, each get min(uncomputed tokens, token budget left):
     a decode (1 token) or the next chunk of a prompt; a chunk leaves one token of
     budget for every decode after it. The samples of one request are allocated
     together (copy-on-write included). When blocks run out the worst running request
     is preempted, all its sequences at once: swapped to the CPU when it has several
     live sequences (or in swap mode), else recomputed (blocks freed, back to WAITING);
     recomputed too when the CPU pool is full.
  2. If nothing was preempted: swapped units are brought back, best first, while blocks
     and seats allow.
  3. If nothing was preempted in 1 and no swapped unit has a better key: WAITING
     sequences are admitted in order while seats, the budget and free blocks allow,
     reusing their longest cached prefix (a long prompt gets a chunk).
  4. The plan carries each scheduled sequence in full the first time a worker sees it
     (or after a preemption, swap or copy-on-write), otherwise only its new block ids,
     plus the swaps and block copies to do before the forward.

Multi-sample requests (n > 1): a root sequence prefills prompt[:-1]; once done it forks
into n samples that share its blocks (ref counts). Each sample then computes the last
prompt token itself, writing into the shared partial block: copy-on-write.

Multi-step scheduling (num_scheduler_steps K > 1, vLLM's `--num-scheduler-steps`): when
a step would only decode (every scheduled sequence computes its one sampled token) and
nothing waits for admission or a swap-in, the plan asks the worker for up to K decode
steps back to back, the worker feeding each step's sampled tokens to the next. The
scheduler allocates the run's slots up front (lookahead) and applies the tokens when
the run's result comes back; tokens after a sequence's stop are dropped. One plan, one
result and one output message per sequence then stand for K tokens: the control
plane's cost per token falls by K.
"""

from __future__ import annotations

import bisect
import enum
import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace

from llmserve.contract.outputs import RequestOutput
from llmserve.contract.plan import (
    CachedRequestData,
    NewRequestData,
    SampledToken,
    StepPlan,
    StepResult,
    WorkerSamplingParams,
)
from llmserve.contract.sampling import SamplingParams
from llmserve.scheduler.kv_cache_manager import KVCacheManager
from llmserve.scheduler.request import Request, RequestGroup, RequestStatus

logger = logging.getLogger(__name__)


class PreemptionMode(str, enum.Enum):
    AUTO = "auto"  # Swap requests with several live sequences, recompute the others.
    SWAP = "swap"  # Swap whenever the CPU pool has room.
    RECOMPUTE = "recompute"  # Always drop the KV and recompute it later.


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_model_len: int  # Prompt + output tokens, at most.
    block_size: int = 16  # Tokens per KV cache block.
    max_num_seqs: int = 256  # Running sequences, at most.
    max_num_batched_tokens: int = 2048  # Tokens computed per step, at most.
    enable_chunked_prefill: bool = True  # Split prompts longer than the budget left.
    enable_prefix_caching: bool = True  # Reuse the KV of full blocks seen before.
    preemption_mode: PreemptionMode = PreemptionMode.AUTO
    num_scheduler_steps: int = 1  # Decode steps one plan may run back to back (multi-step).

    def __post_init__(self) -> None:
        for name in ("max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens",
                     "num_scheduler_steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens})"
                f" must be >= max_model_len ({self.max_model_len}), or long prompts never run"
            )
        object.__setattr__(self, "preemption_mode", PreemptionMode(self.preemption_mode))


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

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass
class _Scheduled:
    request: Request
    num_tokens: int
    new_block_ids: list[int]
    table_changed: bool = False  # An entry was replaced (copy-on-write): resend in full.


def _worker_sampling(sampling: SamplingParams) -> WorkerSamplingParams:
    return WorkerSamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        seed=sampling.seed,
        logprobs=sampling.logprobs,
    )


def _key(request: Request) -> tuple[int, int]:
    return request.key


def _unit_key(unit: list[Request]) -> tuple[int, int]:
    return unit[0].key


class Scheduler:
    """Owns the request queues and the KV cache block tables. Not thread-safe."""

    def __init__(self, config: SchedulerConfig, num_blocks: int, eos_token_ids: Iterable[int],
                 num_cpu_blocks: int = 0):
        self.config = config
        self.kv = KVCacheManager(num_blocks, config.block_size, num_cpu_blocks,
                                 config.enable_prefix_caching)
        self.eos_token_ids = frozenset(eos_token_ids)
        # NOTE: all three kept sorted by key, so the preemption victim is always last
        # and never a sequence already scheduled earlier in the same step.
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[list[Request]] = []  # Units swapped out together.
        self._groups: dict[str, RequestGroup] = {}  # Unfinished requests by public id.
        self._requests: dict[str, Request] = {}  # Unfinished sequences by sequence id.
        self._known_to_worker: set[str] = set()  # Sent in full since the last drop.
        self._finished_since_plan: dict[str, None] = {}  # Ordered set.
        self._next_arrival = 0
        self._next_step_id = 0
        self._preemptions = {PreemptionMode.RECOMPUTE: 0, PreemptionMode.SWAP: 0}
        self._num_steps = 0
        self._finished_counts = {status: 0 for status in RequestStatus if status.is_finished}
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0

    # ---- requests in and out ----

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    n: int = 1, priority: int = 0) -> None:
        """Queue a request of `n` samples (WAITING). Raises ValueError on a duplicate id or
        bad input. Sample i gets seed + i when a seed is set."""
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        if len(prompt_token_ids) > self.config.max_model_len:
            raise ValueError(
                f"request {request_id!r}: prompt of {len(prompt_token_ids)} tokens is longer"
                f" than max_model_len ({self.config.max_model_len})"
            )
        if sampling.max_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_tokens must be >= 1")
        if not 1 <= n <= self.config.max_num_seqs:
            raise ValueError(f"request {request_id!r}: n must be in 1..max_num_seqs"
                             f" ({self.config.max_num_seqs}), got {n}")
        what = f"{len(prompt_token_ids)} tokens" + (f" x {n} samples" if n > 1 else "")
        if error := self._cache_too_small(n * self.kv.num_blocks_for(len(prompt_token_ids)), what):
            raise ValueError(f"request {request_id!r}: {error}")
        group = RequestGroup(request_id, n, priority, self._next_arrival)
        self._next_arrival += 1
        if n > 1 and len(prompt_token_ids) > 1:
            seqs = [self._sequence(group, f"{request_id}#p", prompt_token_ids, sampling, 0, True)]
        else:
            seqs = [self._sequence(group, self._sample_id(group, i), prompt_token_ids,
                                   self._sample_sampling(sampling, i, n), i) for i in range(n)]
        group.sequences = seqs
        self._groups[request_id] = group
        for seq in seqs:
            self._requests[seq.request_id] = seq
            bisect.insort(self.waiting, seq, key=_key)

    def _sequence(self, group: RequestGroup, seq_id: str, prompt: list[int], sampling: SamplingParams,
                  index: int, is_root: bool = False) -> Request:
        if seq_id in self._requests:
            raise ValueError(f"sequence id {seq_id!r} is already in use")
        return Request(request_id=seq_id, prompt_token_ids=list(prompt), sampling=sampling,
                       eos_token_ids=self.eos_token_ids, group=group, index=index, is_root=is_root)

    @staticmethod
    def _sample_id(group: RequestGroup, index: int) -> str:
        return group.request_id if group.n == 1 else f"{group.request_id}#{index}"

    @staticmethod
    def _sample_sampling(sampling: SamplingParams, index: int, n: int) -> SamplingParams:
        """Sample `index` draws with seed + index: alone with that seed it gives the same tokens."""
        if n == 1 or sampling.seed is None:
            return sampling
        return replace(sampling, seed=sampling.seed + index)

    def abort_requests(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Finish requests with ABORT and free their blocks now. Unknown ids are ignored."""
        return self._remove_requests(request_ids, RequestStatus.FINISHED_ABORTED, "")

    def fail_requests(self, request_ids: Iterable[str], error: str) -> list[RequestOutput]:
        """Finish requests with ERROR and free their blocks now. Unknown ids are ignored."""
        return self._remove_requests(request_ids, RequestStatus.FINISHED_ERROR, error)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting, running or swapped."""
        return bool(self._groups)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished sequence with this id, or None."""
        return self._requests.get(request_id)

    def get_group(self, request_id: str) -> RequestGroup | None:
        """The unfinished request with this public id, or None."""
        return self._groups.get(request_id)

    def stats(self) -> SchedulerStats:
        """A snapshot of queue lengths, cache use and lifetime counters."""
        counts, kv = self._finished_counts, self.kv
        recompute, swap = self._preemptions[PreemptionMode.RECOMPUTE], self._preemptions[PreemptionMode.SWAP]
        return SchedulerStats(
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            num_swapped=sum(len(unit) for unit in self.swapped),
            num_total_blocks=kv.num_total_blocks,
            num_free_blocks=kv.num_free_blocks,
            kv_cache_usage=kv.usage,
            num_cpu_blocks=kv.num_cpu_blocks,
            num_free_cpu_blocks=kv.num_free_cpu_blocks,
            num_preemptions=recompute + swap,
            num_preemptions_recompute=recompute,
            num_preemptions_swap=swap,
            num_swapped_out_blocks=kv.num_swapped_out_blocks,
            num_cached_blocks=kv.pool.num_cached_blocks,
            prefix_cache_queries=kv.prefix_query_tokens,
            prefix_cache_hits=kv.prefix_hit_tokens,
            num_allocated_blocks=kv.pool.num_allocated_total,
            num_cow_copies=kv.num_cow_copies,
            num_steps=self._num_steps,
            num_finished=counts[RequestStatus.FINISHED_STOPPED]
            + counts[RequestStatus.FINISHED_LENGTH],
            num_aborted=counts[RequestStatus.FINISHED_ABORTED],
            num_failed=counts[RequestStatus.FINISHED_ERROR],
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
        )

    @property
    def _num_preemptions(self) -> int:
        return sum(self._preemptions.values())

    # ---- one step ----

    def schedule(self) -> StepPlan:
        """Choose this step's sequences and token counts and allocate their blocks.

        An empty plan need not be sent to the worker: its finished_request_ids are
        listed again in the next plan.
        """
        scheduled: list[_Scheduled] = []
        start = self._num_preemptions
        self._preempt_for_priority()
        after_priority = self._num_preemptions
        budget = self._schedule_running(self.config.max_num_batched_tokens, scheduled)
        if self._num_preemptions == start:
            budget = self._schedule_swapped(budget, scheduled)
        if self._num_preemptions == after_priority and self._waiting_goes_first():
            self._schedule_waiting(budget, scheduled)
        num_steps = self._num_steps_for(scheduled)
        if num_steps > 1:
            self._allocate_lookahead(scheduled, num_steps)
        return self._build_plan(scheduled, num_steps)

    def _num_steps_for(self, scheduled: list[_Scheduled]) -> int:
        """Decode steps this plan runs back to back: 1, or with multi-step scheduling up to
        num_scheduler_steps when every scheduled sequence is a plain decode and no sequence
        waits for room (an arrival or a swapped request would otherwise wait for the run).
        Capped so that no sequence passes its max_tokens or max_model_len, and shrunk until
        the run's extra slots fit in the free blocks."""
        k = self.config.num_scheduler_steps
        if k == 1 or not scheduled or self.waiting or self.swapped or self.kv.has_block_ops:
            return 1
        for item in scheduled:
            request = item.request
            if item.num_tokens != 1 or request.num_uncomputed_tokens != 1 or request.is_root or item.table_changed:
                return 1
            k = min(k, request.sampling.max_tokens - request.num_output_tokens,
                    self.config.max_model_len - request.num_tokens)
        while k > 1 and self.kv.blocks_needed([(item.request, k) for item in scheduled]) > self.kv.num_free_blocks:
            k -= 1
        return max(k, 1)

    def _allocate_lookahead(self, scheduled: list[_Scheduled], num_steps: int) -> None:
        """Grow each decoding sequence's table to hold the run's num_steps tokens."""
        for item in scheduled:
            more = self.kv.allocate_slots(item.request, num_steps)
            assert more is not None, "_num_steps_for checked the free blocks"
            item.new_block_ids = item.new_block_ids + more

    def _waiting_goes_first(self) -> bool:
        """Waiting sequences are admitted only when no swapped unit comes before them."""
        return bool(self.waiting) and (not self.swapped or self.waiting[0].key < _unit_key(self.swapped[0]))

    def update_from_output(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Apply a step's sampled tokens; return one output per sequence that got a token.

        Tokens for sequences no longer running (aborted during the step), not in the
        plan, or still mid-prompt are ignored. A result with `error` fails (ERROR) every
        request of the plan still unfinished. Roots done with their prefill fork.
        """
        if result.step_id != plan.step_id:
            raise ValueError(f"result for step {result.step_id} given with plan {plan.step_id}")
        in_plan = [self._requests.get(r.request_id) for r in plan.new_requests + plan.cached_requests]
        in_plan = [r for r in in_plan if r is not None]
        if result.error:
            self.kv.reset_prefix_cache()  # The failed step may have left blocks half written.
            return self.fail_requests(dict.fromkeys(r.group.request_id for r in in_plan), result.error)
        in_plan_set = {r.request_id for r in in_plan}
        # A multi-step result lists each request once per step run, step by step.
        per_request: dict[str, list[SampledToken]] = {}
        for sampled in result.sampled:
            per_request.setdefault(sampled.request_id, []).append(sampled)
        outputs = []
        for request_id, sampled in per_request.items():
            request = self._requests.get(request_id)
            if (
                request is None
                or request.request_id not in in_plan_set
                or request.status is not RequestStatus.RUNNING
                or request.num_uncomputed_tokens
                or request.is_root
            ):
                logger.debug("ignoring token for %s", request_id)
                continue
            outputs.append(self._append_tokens(request, sampled[: plan.num_steps]))
        for request in in_plan:
            if request.is_root and request.status is RequestStatus.RUNNING and not request.num_uncomputed_tokens:
                self._fork(request)
        return outputs

    # ---- scheduling helpers ----

    def _preempt_for_priority(self) -> None:
        """Preempt running requests of worse priority than the first waiting sequence
        while it has no seat or no blocks for its first chunk."""
        while self.waiting and self.running:
            head, victim = self.waiting[0], self.running[-1]
            if victim.group.priority <= head.group.priority:
                return
            if self._has_seats(head) and self._admissible(head):
                return
            self._preempt(victim.group)

    def _has_seats(self, request: Request, num_sequences: int = 1) -> bool:
        """Room for `num_sequences` more running sequences; a root reserves a seat for
        each sample it forks into."""
        used = len(self.running) + sum(r.group.n - 1 for r in self.running if r.is_root)
        wanted = request.group.n if request.is_root else num_sequences
        return used + wanted <= self.config.max_num_seqs

    def _admissible(self, request: Request) -> bool:
        cached = self.kv.get_computed_blocks(request)
        num_cached = len(cached) * self.config.block_size
        num_new = request.num_target_tokens - num_cached
        if self.config.enable_chunked_prefill:
            num_new = min(num_new, self.config.max_num_batched_tokens)
        needed = self.kv.num_blocks_for(num_cached + num_new) - len(cached)
        needed += sum(1 for b in cached if self.kv.pool.ref_count(b) == 0)
        return needed <= self.kv.num_free_blocks

    def _schedule_running(self, budget: int, scheduled: list[_Scheduled]) -> int:
        """Schedule running sequences best first, one request (all its samples) at a time,
        preempting the worst request when blocks run out. Returns the budget left."""
        decodes_left = sum(1 for r in self.running if r.num_uncomputed_tokens == 1)
        i = 0
        while i < len(self.running) and budget > 0:
            group = self.running[i].group
            j = i
            while j < len(self.running) and self.running[j].group is group:
                j += 1
            items = []
            for request in self.running[i:j]:
                uncomputed = request.num_uncomputed_tokens
                decodes_left -= uncomputed == 1
                # A chunk leaves one token of budget to each decode after it.
                room = budget if uncomputed == 1 else budget - decodes_left
                num_new = min(uncomputed, room)
                if num_new > 0:
                    items.append((request, num_new))
                    budget -= num_new
            if items and not self._allocate_or_preempt(group, items, scheduled):
                break  # It preempted itself: no room for anyone after it.
            i = j
        return budget

    def _allocate_or_preempt(self, group: RequestGroup, items: list[tuple[Request, int]],
                             scheduled: list[_Scheduled]) -> bool:
        """Allocate slots for the group's items, preempting the worst running request
        until they fit. Returns False if `group` itself had to be preempted."""
        while self.kv.blocks_needed(items) > self.kv.num_free_blocks:
            victim = self.running[-1].group
            self._preempt(victim)
            if victim is group:
                return False
        self._allocate(items, scheduled)
        return True

    def _allocate(self, items: list[tuple[Request, int]], scheduled: list[_Scheduled]) -> None:
        for request, num_new in items:
            new_block_ids = self.kv.allocate_slots(request, num_new)
            replaced = self.kv.take_replaced(request.request_id)
            scheduled.append(_Scheduled(request, num_new, new_block_ids, replaced))

    def _preempt(self, group: RequestGroup) -> None:
        """Preempt every running sequence of the group, by swap or by recompute."""
        live = [r for r in self.running if r.group is group]
        for request in live:
            self.running.remove(request)
            request.num_preemptions += 1
            self._drop_from_worker(request.request_id)
        mode = self.config.preemption_mode
        swap = mode is PreemptionMode.SWAP or (mode is PreemptionMode.AUTO and len(live) > 1)
        if swap and self.kv.can_swap_out(live):
            logger.debug("preempting %s by swap", group.request_id)
            self.kv.swap_out(live)
            for request in live:
                request.status = RequestStatus.SWAPPED
            bisect.insort(self.swapped, live, key=_unit_key)
            self._preemptions[PreemptionMode.SWAP] += 1
            return
        logger.debug("preempting %s by recompute", group.request_id)
        for request in live:
            self.kv.free(request)
            request.status = RequestStatus.WAITING
            request.num_computed_tokens = 0
            bisect.insort(self.waiting, request, key=_key)
        self._preemptions[PreemptionMode.RECOMPUTE] += 1

    def _schedule_swapped(self, budget: int, scheduled: list[_Scheduled]) -> int:
        """Bring swapped units back, best first, while blocks, seats and budget allow,
        and schedule them in the same step."""
        while self.swapped and budget > 0:
            unit = self.swapped[0]
            if self.waiting and self.waiting[0].key < _unit_key(unit):
                break  # A better waiting sequence gets the room first.
            if not self._has_seats(unit[0], len(unit)):
                break
            items = []
            for request in unit:
                num_new = min(request.num_uncomputed_tokens, budget)
                if num_new > 0:
                    items.append((request, num_new))
                    budget -= num_new
            needed = self.kv.num_swap_in_blocks(unit) + self.kv.blocks_needed(items, swapped=True)
            if needed > self.kv.num_free_blocks:
                budget += sum(num_new for _, num_new in items)
                break
            self.swapped.pop(0)
            self.kv.swap_in(unit)
            for request in unit:
                request.status = RequestStatus.RUNNING
                bisect.insort(self.running, request, key=_key)
            self._allocate(items, scheduled)
        return budget

    def _schedule_waiting(self, budget: int, scheduled: list[_Scheduled]) -> None:
        """Admit waiting sequences in order while seats, token budget and blocks allow."""
        chunked = self.config.enable_chunked_prefill
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if not self._has_seats(request):
                break
            cached = self.kv.get_computed_blocks(request)
            num_new = request.num_target_tokens - len(cached) * self.config.block_size
            if num_new > budget:
                if not chunked:
                    break
                num_new = budget
            new_block_ids = self.kv.admit(request, cached, num_new)
            if new_block_ids is None:
                break
            self.waiting.pop(0)
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=_key)
            scheduled.append(_Scheduled(request, num_new, new_block_ids))
            budget -= num_new
            group = request.group
            if not group.admitted:
                group.admitted = True
                group.num_cached_tokens = request.num_computed_tokens
                self._prompt_tokens_total += request.num_prompt_tokens

    def _fork(self, root: Request) -> None:
        """Replace a root that prefilled prompt[:-1] by the group's n samples, which share
        its blocks and each compute the last prompt token themselves."""
        group = root.group
        samples = [self._sequence(group, self._sample_id(group, i), root.prompt_token_ids,
                                  self._sample_sampling(root.sampling, i, group.n), i)
                   for i in range(group.n)]
        for sample in samples:
            sample.status = RequestStatus.RUNNING
            sample.num_computed_tokens = root.num_computed_tokens
            self._requests[sample.request_id] = sample
        self.kv.fork(root, samples)
        at = self.running.index(root)
        self.running[at : at + 1] = samples
        group.sequences = samples
        del self._requests[root.request_id]
        self._drop_from_worker(root.request_id)

    def _build_plan(self, scheduled: list[_Scheduled], num_steps: int = 1) -> StepPlan:
        ops = self.kv.take_block_ops()
        plan = StepPlan(
            step_id=self._next_step_id, finished_request_ids=list(self._finished_since_plan),
            swap_out=ops.swap_out, swap_in=ops.swap_in, copies=ops.copies, num_steps=num_steps,
        )
        self._next_step_id += 1
        for item in scheduled:
            request = item.request
            if item.table_changed and request.request_id in self._known_to_worker:
                # Resent in full: the worker drops its copy first.
                self._known_to_worker.discard(request.request_id)
                plan.finished_request_ids.append(request.request_id)
            if request.request_id in self._known_to_worker:
                plan.cached_requests.append(self._cached_data(item))
            else:
                self._known_to_worker.add(request.request_id)
                plan.new_requests.append(self._new_data(item))
            request.num_computed_tokens += item.num_tokens
            self.kv.cache_full_blocks(request)
        if not plan.is_empty:  # NOTE: an empty plan may never reach the worker; keep the ids.
            self._finished_since_plan = {}
            self._num_steps += 1
        return plan

    def _new_data(self, item: _Scheduled) -> NewRequestData:
        request = item.request
        return NewRequestData(
            request_id=request.request_id,
            token_ids=request.all_token_ids,
            num_prompt_tokens=request.num_prompt_tokens,
            sampling=_worker_sampling(request.sampling),
            block_ids=self.kv.get_block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
            num_scheduled_tokens=item.num_tokens,
        )

    @staticmethod
    def _cached_data(item: _Scheduled) -> CachedRequestData:
        return CachedRequestData(
            request_id=item.request.request_id,
            new_block_ids=item.new_block_ids,
            num_computed_tokens=item.request.num_computed_tokens,
            num_scheduled_tokens=item.num_tokens,
        )

    # ---- output helpers ----

    def _append_tokens(self, request: Request, sampled: list[SampledToken]) -> RequestOutput:
        """Append a step's token, or a multi-step run's tokens in order: each token after
        the first was computed by the run's next step. Tokens after a stop are dropped."""
        new_token_ids, logprobs, status = [], [], None
        for i, token in enumerate(sampled):
            if i:
                request.num_computed_tokens += 1
            request.output_token_ids.append(token.token_id)
            new_token_ids.append(token.token_id)
            if token.logprobs is not None:
                logprobs.append(token.logprobs)
            self._generation_tokens_total += 1
            status = self._stop_status(request, token.token_id)
            if status is not None:
                break
        if len(sampled) > 1:
            self.kv.cache_full_blocks(request)  # Blocks the run filled (before a finish frees them).
        if status is not None:
            self.running.remove(request)
            self._finish(request, status, request.error)
        return RequestOutput(
            request_id=request.group.request_id,
            index=request.index,
            new_token_ids=new_token_ids,
            logprobs=logprobs,
            finish_reason=request.status.finish_reason,
            num_cached_tokens=request.group.num_cached_tokens,
            stop_token_id=request.stop_token_id,
            error=request.error,
        )

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        """The finished status the token just appended causes, or None.

        Sets request.stop_token_id (STOP) or request.error (ERROR) on the way.
        """
        sampling = request.sampling
        if token_id in request.eos_token_ids and not sampling.ignore_eos:
            request.stop_token_id = token_id
            return RequestStatus.FINISHED_STOPPED
        if token_id in sampling.stop_token_ids:
            request.stop_token_id = token_id
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= sampling.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        # NOTE: the next step needs KV for all num_tokens tokens of every live sample.
        # Failing here, rather than in schedule(), keeps the running loop free of
        # requests that could only preempt everyone and then themselves, forever.
        seqs = request.group.sequences
        num_blocks = self.kv.blocks_to_hold(seqs)
        what = f"{request.num_tokens} tokens" if len(seqs) == 1 else f"{len(seqs)} samples"
        if error := self._cache_too_small(num_blocks, what):
            request.error = error
            return RequestStatus.FINISHED_ERROR
        return None

    def _cache_too_small(self, num_blocks: int, what: str) -> str:
        """Why the whole cache cannot hold `num_blocks` blocks of KV for `what`, or ""."""
        if num_blocks <= self.kv.num_total_blocks:
            return ""
        return (
            f"{what} need {num_blocks} KV cache blocks but the cache has only"
            f" {self.kv.num_total_blocks} blocks of {self.kv.block_size} tokens"
        )

    def _remove_requests(
        self, request_ids: Iterable[str], status: RequestStatus, error: str
    ) -> list[RequestOutput]:
        """Finish every live sequence of the given public ids; one output per sequence."""
        outputs = []
        for request_id in request_ids:
            group = self._groups.get(request_id)
            if group is None:
                continue
            for request in list(group.sequences):
                self._dequeue(request)
                self._finish(request, status, error)
                if not request.is_root:
                    outputs.append(self._final_output(request))
                else:  # The samples did not exist yet: each still gets its end.
                    outputs += [RequestOutput(request_id, index=i, finish_reason=status.finish_reason,
                                              error=error) for i in range(group.n)]
        return outputs

    def _dequeue(self, request: Request) -> None:
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            unit = next(u for u in self.swapped if request in u)
            unit.remove(request)
            if not unit:
                self.swapped.remove(unit)

    def _finish(self, request: Request, status: RequestStatus, error: str = "") -> None:
        """Give the sequence its final status, free its blocks and forget it (and its
        request once no sequence is left). The caller has already dequeued it."""
        request.status = status
        request.error = error
        self.kv.free(request)
        del self._requests[request.request_id]
        self._finished_counts[status] += 1
        self._drop_from_worker(request.request_id)
        group = request.group
        group.sequences.remove(request)
        if not group.sequences:
            del self._groups[group.request_id]

    def _drop_from_worker(self, request_id: str) -> None:
        # NOTE: an id can be in finished_request_ids and new_requests of one plan (an id
        # reused after finishing); workers apply finished_request_ids first.
        self._known_to_worker.discard(request_id)
        self._finished_since_plan[request_id] = None

    @staticmethod
    def _final_output(request: Request) -> RequestOutput:
        return RequestOutput(
            request_id=request.group.request_id,
            index=request.index,
            finish_reason=request.status.finish_reason,
            num_cached_tokens=request.group.num_cached_tokens,
            error=request.error,
        )
