"""Continuous-batching scheduler (vLLM v1 style): it owns the KV block tables and turns
queues of requests into one StepPlan per step.

Loop: `plan = schedule()` -> a worker executes it -> `update_from_output(plan, result)`.

Each step:
  1. RUNNING requests, oldest first, each get min(uncomputed tokens, token budget left):
     a decode (1 token) or the next chunk of a prompt. When blocks run out the most
     recently arrived running request is preempted by recompute (its blocks freed, back
     to the front of WAITING) until the allocation fits.
  2. If nothing was preempted, WAITING requests are admitted in FCFS order while
     max_num_seqs, the token budget and free blocks allow (a long prompt gets a chunk).
  3. The plan carries each scheduled request in full the first time a worker sees it
     (or after a preemption), otherwise only its new block ids; num_computed_tokens
     advances as the plan is built.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from llmserve.outputs import RequestOutput
from llmserve.plan import (
    CachedRequestData,
    NewRequestData,
    SampledToken,
    StepPlan,
    StepResult,
    WorkerSamplingParams,
)
from llmserve.sampling import SamplingParams
from llmserve.scheduler.kv_cache_manager import KVCacheManager
from llmserve.scheduler.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_model_len: int  # Prompt + output tokens, at most.
    block_size: int = 16  # Tokens per KV cache block.
    max_num_seqs: int = 256  # Running requests, at most.
    max_num_batched_tokens: int = 2048  # Tokens computed per step, at most.
    enable_chunked_prefill: bool = True  # Split prompts longer than the budget left.

    def __post_init__(self) -> None:
        for name in ("max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens})"
                f" must be >= max_model_len ({self.max_model_len}), or long prompts never run"
            )


@dataclass(frozen=True)
class SchedulerStats:
    num_waiting: int
    num_running: int
    num_total_blocks: int
    num_free_blocks: int
    kv_cache_usage: float  # Fraction of blocks in use.
    num_preemptions: int
    num_steps: int  # Non-empty plans built.
    num_finished: int  # Finished with STOP or LENGTH.
    num_aborted: int
    num_failed: int  # Finished with ERROR.
    prompt_tokens_total: int  # Prompt tokens of admitted requests (recomputes not counted).
    generation_tokens_total: int  # Tokens sampled and kept.


@dataclass
class _Scheduled:
    request: Request
    num_tokens: int
    new_block_ids: list[int]


def _worker_sampling(sampling: SamplingParams) -> WorkerSamplingParams:
    return WorkerSamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        seed=sampling.seed,
        logprobs=sampling.logprobs,
    )


def _arrival(request: Request) -> int:
    return request.arrival_order


class Scheduler:
    """Owns the request queues and the KV cache block tables. Not thread-safe."""

    def __init__(self, config: SchedulerConfig, num_blocks: int, eos_token_ids: Iterable[int]):
        self.config = config
        self.kv = KVCacheManager(num_blocks, config.block_size)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()  # Arrival order; preempted ones in front.
        # NOTE: kept sorted by arrival_order, so the preemption victim is always last
        # and never a request already scheduled earlier in the same step.
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}  # Unfinished requests.
        self._known_to_worker: set[str] = set()  # Sent in full since the last drop.
        self._finished_since_plan: dict[str, None] = {}  # Ordered set.
        self._next_arrival = 0
        self._next_step_id = 0
        self._num_preemptions = 0
        self._num_steps = 0
        self._finished_counts = {status: 0 for status in RequestStatus if status.is_finished}
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0

    # ---- requests in and out ----

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> None:
        """Queue a request (WAITING). Raises ValueError on a duplicate id or bad input."""
        if request_id in self._requests:
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
        if error := self._cache_too_small(len(prompt_token_ids)):
            raise ValueError(f"request {request_id!r}: {error}")
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling,
            eos_token_ids=self.eos_token_ids,
            arrival_order=self._next_arrival,
        )
        self._next_arrival += 1
        self._requests[request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Finish requests with ABORT and free their blocks now. Unknown ids are ignored."""
        return self._remove_requests(request_ids, RequestStatus.FINISHED_ABORTED, "")

    def fail_requests(self, request_ids: Iterable[str], error: str) -> list[RequestOutput]:
        """Finish requests with ERROR and free their blocks now. Unknown ids are ignored."""
        return self._remove_requests(request_ids, RequestStatus.FINISHED_ERROR, error)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self._requests.get(request_id)

    def stats(self) -> SchedulerStats:
        """A snapshot of queue lengths, cache use and lifetime counters."""
        counts = self._finished_counts
        return SchedulerStats(
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            num_total_blocks=self.kv.num_total_blocks,
            num_free_blocks=self.kv.num_free_blocks,
            kv_cache_usage=self.kv.usage,
            num_preemptions=self._num_preemptions,
            num_steps=self._num_steps,
            num_finished=counts[RequestStatus.FINISHED_STOPPED]
            + counts[RequestStatus.FINISHED_LENGTH],
            num_aborted=counts[RequestStatus.FINISHED_ABORTED],
            num_failed=counts[RequestStatus.FINISHED_ERROR],
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
        )

    # ---- one step ----

    def schedule(self) -> StepPlan:
        """Choose this step's requests and token counts and allocate their blocks.

        An empty plan need not be sent to the worker: its finished_request_ids are
        listed again in the next plan.
        """
        scheduled: list[_Scheduled] = []
        preemptions_before = self._num_preemptions
        budget = self._schedule_running(self.config.max_num_batched_tokens, scheduled)
        if self._num_preemptions == preemptions_before:
            self._schedule_waiting(budget, scheduled)
        return self._build_plan(scheduled)

    def update_from_output(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Apply a step's sampled tokens; return one output per request that got a token.

        Tokens for requests no longer running (aborted during the step), not in the
        plan, or still mid-prompt are ignored. A result with `error` fails (ERROR) every
        request of the plan still unfinished.
        """
        if result.step_id != plan.step_id:
            raise ValueError(f"result for step {result.step_id} given with plan {plan.step_id}")
        in_plan = [r.request_id for r in plan.new_requests + plan.cached_requests]
        if result.error:
            return self.fail_requests(in_plan, result.error)
        in_plan_set = set(in_plan)
        outputs = []
        for sampled in result.sampled:
            request = self._requests.get(sampled.request_id)
            if (
                request is None
                or request.request_id not in in_plan_set
                or request.status is not RequestStatus.RUNNING
                or request.num_uncomputed_tokens
            ):
                logger.debug("ignoring token for %s", sampled.request_id)
                continue
            outputs.append(self._append_token(request, sampled))
        return outputs

    # ---- scheduling helpers ----

    def _schedule_running(self, budget: int, scheduled: list[_Scheduled]) -> int:
        """Schedule running requests oldest first, preempting when blocks run out.

        Returns the token budget left.
        """
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_uncomputed_tokens, budget)
            if num_new == 0:  # The worker sent no token for it last step.
                i += 1
                continue
            new_block_ids = self._allocate_or_preempt(request, num_new)
            if new_block_ids is None:  # It preempted itself: no room for anyone after it.
                break
            scheduled.append(_Scheduled(request, num_new, new_block_ids))
            budget -= num_new
            i += 1
        return budget

    def _allocate_or_preempt(self, request: Request, num_new: int) -> list[int] | None:
        """Allocate slots, preempting the latest running request until they fit.

        Returns the new block ids, or None if `request` itself had to be preempted.
        """
        while (new_block_ids := self.kv.allocate_slots(request, num_new)) is None:
            victim = self.running.pop()
            self._preempt(victim)
            if victim is request:
                return None
        return new_block_ids

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: drop its KV; it reruns prompt + outputs from scratch."""
        logger.debug("preempting %s", request.request_id)
        self.kv.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.appendleft(request)
        self._drop_from_worker(request.request_id)

    def _schedule_waiting(self, budget: int, scheduled: list[_Scheduled]) -> None:
        """Admit waiting requests FCFS while seats, token budget and blocks allow."""
        chunked = self.config.enable_chunked_prefill
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            num_new = request.num_uncomputed_tokens
            if num_new > budget:
                if not chunked:
                    break
                num_new = budget
            new_block_ids = self.kv.allocate_slots(request, num_new)
            if new_block_ids is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=_arrival)
            scheduled.append(_Scheduled(request, num_new, new_block_ids))
            budget -= num_new
            if request.num_preemptions == 0:
                self._prompt_tokens_total += request.num_prompt_tokens

    def _build_plan(self, scheduled: list[_Scheduled]) -> StepPlan:
        plan = StepPlan(
            step_id=self._next_step_id, finished_request_ids=list(self._finished_since_plan)
        )
        self._next_step_id += 1
        if scheduled:  # NOTE: an empty plan may never reach the worker; keep the ids.
            self._finished_since_plan = {}
        for item in scheduled:
            request = item.request
            if request.request_id in self._known_to_worker:
                plan.cached_requests.append(self._cached_data(item))
            else:
                self._known_to_worker.add(request.request_id)
                plan.new_requests.append(self._new_data(item))
            request.num_computed_tokens += item.num_tokens
        if not plan.is_empty:
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

    def _append_token(self, request: Request, sampled: SampledToken) -> RequestOutput:
        request.output_token_ids.append(sampled.token_id)
        self._generation_tokens_total += 1
        status = self._stop_status(request, sampled.token_id)
        if status is not None:
            self.running.remove(request)
            self._finish(request, status, request.error)
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=[sampled.token_id],
            logprobs=[sampled.logprobs] if sampled.logprobs is not None else [],
            finish_reason=request.status.finish_reason,
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
        # NOTE: the next step needs KV for all num_tokens tokens. Failing here, rather
        # than in schedule(), keeps the running loop free of requests that could only
        # preempt everyone and then themselves, forever.
        if error := self._cache_too_small(request.num_tokens):
            request.error = error
            return RequestStatus.FINISHED_ERROR
        return None

    def _cache_too_small(self, num_tokens: int) -> str:
        """Why the whole cache cannot hold `num_tokens` tokens of KV, or ""."""
        num_blocks = self.kv.num_blocks_for(num_tokens)
        if num_blocks <= self.kv.num_total_blocks:
            return ""
        return (
            f"{num_tokens} tokens need {num_blocks} KV cache blocks but the cache has only"
            f" {self.kv.num_total_blocks} blocks of {self.kv.block_size} tokens"
        )

    def _remove_requests(
        self, request_ids: Iterable[str], status: RequestStatus, error: str
    ) -> list[RequestOutput]:
        outputs = []
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is None:
                continue
            if request.status is RequestStatus.WAITING:
                self.waiting.remove(request)
            else:
                self.running.remove(request)
            self._finish(request, status, error)
            outputs.append(self._final_output(request))
        return outputs

    def _finish(self, request: Request, status: RequestStatus, error: str = "") -> None:
        """Give the request its final status, free its blocks and forget it.

        The caller has already taken it out of `waiting` / `running`.
        """
        request.status = status
        request.error = error
        self.kv.free(request)
        del self._requests[request.request_id]
        self._finished_counts[status] += 1
        self._drop_from_worker(request.request_id)

    def _drop_from_worker(self, request_id: str) -> None:
        # NOTE: an id can be in finished_request_ids and new_requests of one plan (an id
        # reused after finishing); workers apply finished_request_ids first.
        self._known_to_worker.discard(request_id)
        self._finished_since_plan[request_id] = None

    @staticmethod
    def _final_output(request: Request) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            finish_reason=request.status.finish_reason,
            error=request.error,
        )
