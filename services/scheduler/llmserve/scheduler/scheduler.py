"""Continuous-batching scheduler: it owns the KV block tables and turns queues of
samples into one StepPlan per step.

Loop: `plan = schedule()` -> a worker executes it -> `update_from_output(plan, result)`.

`Scheduler` is a facade over small parts that share the records of request.py (one
Request per client request, one Sample per sequence) and hold references to them:

    registry.py          LiveRequests: unfinished requests by public id, samples by sequence id
                         (the process's one request table; the service keeps none)
    queues.py            Queues: waiting / running / swapped, sorted by (priority, arrival)
    policy.py            StepPolicy: what runs this step (priority, running, swap-in, admission)
    preemption.py        Preemptor: swap or recompute a request's samples
    multi_step.py        num_steps_for / allocate_lookahead: decode runs of up to K steps
    worker_view.py       WorkerView: what the worker knows; builds the StepPlan
    output_processor.py  OutputProcessor: tokens, stops, the fork of n > 1 roots, ends
    kv_cache_manager.py  KVCacheManager: block tables, copy-on-write, prefix cache, swap
    block_audit.py       The block ledger (block -> live holders) and its leak check
    stats.py             Counters and the SchedulerStats snapshot
    admission.py         Admission: queue bounds, displacement by priority, retry hints, saturation
    deadlines.py         Deadlines: requests' end-to-end deadlines, earliest first

Multi-sample requests (n > 1): a root sample prefills prompt[:-1]; once done it forks
into n samples that share its blocks (ref counts). Each sample then computes the last
prompt token itself, writing into the shared partial block: copy-on-write.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from llmserve.contract.block_hash import salt_key
from llmserve.contract.outputs import ErrorCode, RequestOutput
from llmserve.contract.plan import StepPlan, StepResult
from llmserve.contract.sampling import SamplingParams
from llmserve.scheduler.admission import Admission, QueueFull, queue_bounds
from llmserve.scheduler.block_audit import BlockAudit, audit_blocks, ledger_balances
from llmserve.scheduler.block_events import BlockEvent, BlockStored
from llmserve.scheduler.config import SchedulerConfig
from llmserve.scheduler.deadlines import Deadlines
from llmserve.scheduler.kv_cache_manager import KVCacheManager
from llmserve.scheduler.multi_step import allocate_lookahead, num_steps_for
from llmserve.scheduler.output_processor import OutputProcessor
from llmserve.scheduler.policy import StepPolicy
from llmserve.scheduler.preemption import PreemptionMode, Preemptor
from llmserve.scheduler.queues import Queues
from llmserve.scheduler.registry import LiveRequests
from llmserve.scheduler.request import Request, RequestStatus, Sample
from llmserve.scheduler.stats import Counters, SchedulerStats, snapshot
from llmserve.scheduler.worker_view import WorkerView

__all__ = ["KVCacheShape", "PreemptionMode", "QueueFull", "Scheduler", "SchedulerConfig", "SchedulerStats"]


@dataclass(frozen=True, kw_only=True)
class KVCacheShape:
    """What the worker's registration tells the scheduler: facts, not settings."""

    num_blocks: int  # KV cache blocks on the worker.
    block_size: int  # Tokens per block.
    max_model_len: int  # Prompt + output tokens, at most.
    num_cpu_blocks: int = 0  # Swap space, in blocks.
    # Every layer attends to the last W tokens only: older blocks are released (0: none).
    sliding_window: int = 0

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


class Scheduler:
    """Owns the request queues and the KV cache block tables. Not thread-safe."""

    def __init__(self, config: SchedulerConfig, cache: KVCacheShape, eos_token_ids: Iterable[int],
                 clock: Callable[[], float] = time.monotonic):
        """A scheduler following `config` for a worker whose KV cache has `cache`'s shape
        and whose model stops on `eos_token_ids`. `clock` (time.monotonic, or a test's)
        times the queue's drain rate; deadlines are on the same clock."""
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < cache.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({config.max_num_batched_tokens})"
                f" must be >= max_model_len ({cache.max_model_len}), or long prompts never run"
            )
        self.config = config
        self.cache = cache
        self.kv = KVCacheManager(cache.num_blocks, cache.block_size, cache.num_cpu_blocks,
                                 config.enable_prefix_caching, cache.sliding_window,
                                 config.max_num_batched_tokens if config.enable_chunked_prefill else 0)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.queues = Queues(config.max_num_seqs)
        self.live = LiveRequests()
        self.worker_view = WorkerView(self.kv, cache.max_model_len)
        self.counters = Counters(spec_accepted_per_position=[0] * config.num_speculative_tokens)
        preemptor = Preemptor(config.preemption_mode, self.kv, self.queues, self.worker_view, self.counters)
        self.policy = StepPolicy(config, self.kv, self.queues, preemptor, self.counters, cache.max_model_len)
        self.outputs = OutputProcessor(cache.max_model_len, self.kv, self.queues, self.live, self.worker_view, self.counters)
        self._next_arrival = 0
        self.clock = clock
        self.admission = Admission(*queue_bounds(config), self.queues, clock)
        self.deadlines = Deadlines()

    @property
    def waiting(self) -> list[Sample]:
        """Samples holding no blocks, best first."""
        return self.queues.waiting

    @property
    def running(self) -> list[Sample]:
        """Samples holding GPU blocks, best first."""
        return self.queues.running

    @property
    def swapped(self) -> list[list[Sample]]:
        """Units of samples whose blocks are on the CPU, best first."""
        return self.queues.swapped

    # ---- requests in and out ----

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    n: int = 1, priority: int = 0, deadline: float | None = None, cache_salt: str = "") -> Request:
        """Queue a request of `n` samples (WAITING) and return its record, whatever the
        queue bounds (see submit). Raises ValueError on a duplicate id or bad input.
        Sample i gets seed + i when a seed is set. `deadline` (on the scheduler's clock):
        see expire. `cache_salt`: it shares cached blocks only with requests of the same
        salt (block_hash.salt_key)."""
        self._validate(request_id, prompt_token_ids, sampling, n)
        request = Request(request_id, list(prompt_token_ids), sampling, self.eos_token_ids, n=n,
                          priority=priority, arrival_order=self._next_arrival, deadline=deadline,
                          salt_key=salt_key(cache_salt))
        self._next_arrival += 1
        samples = request.first_samples()
        self.live.add(request, samples)
        for sample in samples:
            self.queues.wait(sample)
        if deadline is not None:
            self.deadlines.add(request)
        return request

    def submit(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
               n: int = 1, priority: int = 0, deadline: float | None = None,
               cache_salt: str = "") -> tuple[Request, list[RequestOutput]]:
        """add_request within the queue bounds (max_queued_requests, max_queued_tokens).

        Returns the request and the end outputs of the queued requests of worse priority
        it displaced (RESOURCE_EXHAUSTED with a retry hint; usually none). Raises
        ValueError for bad input and QueueFull (with its retry hint) when it does not
        fit; either way nothing was queued and nothing displaced."""
        self._validate(request_id, prompt_token_ids, sampling, n)
        victims = self.admission.make_room(len(prompt_token_ids), priority)
        outputs = []
        if victims:
            retry_ms = self.admission.retry_after_ms()
            error = (f"the scheduler is saturated: a request of better priority took this queued request's place; "
                     f"retry in {retry_ms} ms")
            ended = self.outputs.end_requests([r.request_id for r in victims], RequestStatus.FINISHED_ERROR, error,
                                              ErrorCode.RESOURCE_EXHAUSTED)
            outputs = [replace(out, retry_after_ms=retry_ms) for out in ended]
        request = self.add_request(request_id, prompt_token_ids, sampling, n, priority, deadline, cache_salt)
        return request, outputs

    def expire(self, now: float) -> list[RequestOutput]:
        """End every request whose deadline is at or before `now` with ERROR
        (DEADLINE_EXCEEDED) and free its blocks: a queued one is never scheduled (again),
        a running one stops here (its worker state goes with the next plan). Call it
        before each schedule()."""
        due = self.deadlines.due(now)
        if not due:
            return []
        self.counters.requests_expired += len(due)
        return self.outputs.end_requests([r.request_id for r in due], RequestStatus.FINISHED_ERROR,
                                         "deadline exceeded", ErrorCode.DEADLINE_EXCEEDED)

    def next_deadline(self) -> float | None:
        """The earliest deadline of an unfinished request (scheduler clock), or None."""
        return self.deadlines.next()

    @property
    def saturated(self) -> bool:
        """The queue hit its bounds and has not drained to half of them since."""
        return self.admission.saturated

    def _validate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, n: int) -> None:
        """Raise ValueError for a request that can never be served."""
        if self.live.request(request_id) is not None:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        if len(prompt_token_ids) > self.cache.max_model_len:
            raise ValueError(
                f"request {request_id!r}: prompt of {len(prompt_token_ids)} tokens is longer"
                f" than max_model_len ({self.cache.max_model_len})"
            )
        if sampling.max_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_tokens must be >= 1")
        if not 1 <= n <= self.config.max_num_seqs:
            raise ValueError(f"request {request_id!r}: n must be in 1..max_num_seqs"
                             f" ({self.config.max_num_seqs}), got {n}")
        what = f"{len(prompt_token_ids)} tokens" + (f" x {n} samples" if n > 1 else "")
        if error := self.kv.too_small_for(n * self.kv.num_blocks_for(len(prompt_token_ids)), what):
            raise ValueError(f"request {request_id!r}: {error}")

    def abort_requests(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Finish requests with ABORT and free their blocks now. Unknown ids are ignored."""
        return self.outputs.end_requests(request_ids, RequestStatus.FINISHED_ABORTED, "")

    def fail_requests(self, request_ids: Iterable[str], error: str,
                      code: ErrorCode = ErrorCode.INTERNAL) -> list[RequestOutput]:
        """Finish requests with ERROR (`code` tells the client why) and free their blocks
        now. Unknown ids are ignored."""
        return self.outputs.end_requests(request_ids, RequestStatus.FINISHED_ERROR, error, code)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting, running or swapped."""
        return bool(self.live)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this public id, or None."""
        return self.live.request(request_id)

    def unfinished_requests(self) -> list[Request]:
        """Every unfinished request, oldest first."""
        return self.live.requests()

    def take_ended(self) -> list[Request]:
        """The records of the requests that ended since the last call (at most since the
        schedule() before the last), in end order: their end outputs name them by public
        id only, and the table no longer has them."""
        return self.live.take_ended()

    def get_sample(self, seq_id: int) -> Sample | None:
        """The live sample with this sequence id, or None."""
        return self.live.sample(seq_id)

    def audit(self) -> BlockAudit:
        """The KV block ledger checked against the live requests (see block_audit.py)."""
        return audit_blocks(self.live.samples(), self.kv.pool, self.kv.cpu_pool)

    def unbalanced_audit(self) -> BlockAudit | None:
        """None when the block ledger balances (decided without walking every block:
        block_audit.ledger_balances), else the audit that says what is wrong."""
        if ledger_balances(self.live.samples(), self.kv.pool, self.kv.cpu_pool):
            return None
        return self.audit()

    def num_orphaned_blocks(self) -> int:
        """Blocks held for requests that have ended (0 whenever the ledger balances)."""
        audit = self.unbalanced_audit()
        return 0 if audit is None else audit.num_orphaned_blocks

    def num_waiting_prompt_tokens(self) -> int:
        """Prompt tokens of the waiting samples whose KV is not computed yet."""
        return sum(max(0, s.num_prompt_tokens - s.num_computed_tokens) for s in self.queues.waiting)

    def take_block_events(self) -> list[BlockEvent]:
        """The prefix cache's block events since the last call, oldest first (none
        without prefix caching; see block_events.py)."""
        return self.kv.pool.take_events()

    def cached_block_events(self) -> list[BlockStored]:
        """A stored event for every block cached now (a snapshot's events)."""
        return self.kv.pool.snapshot_events()

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (the worker's KV content is lost or unknown)."""
        self.kv.reset_prefix_cache()

    def stats(self) -> SchedulerStats:
        """A snapshot of queue lengths, cache use and lifetime counters."""
        return snapshot(self.counters, self.queues, self.kv, self.admission)

    # ---- one step ----

    def schedule(self) -> StepPlan:
        """Choose this step's samples and token counts and allocate their blocks.

        An empty plan need not be sent to the worker: its finished_seq_ids are
        listed again in the next plan.
        """
        # NOTE: records nobody took for a step are dropped here, so a caller that never takes
        # them (the in-process engine) does not keep every request forever.
        self.live.age_ended()
        admitted = self.counters.requests_admitted, self.counters.prompt_tokens_total
        scheduled = self.policy.choose()
        self.admission.drain.record(self.clock(), self.counters.requests_admitted - admitted[0],
                                    self.counters.prompt_tokens_total - admitted[1])
        num_steps = num_steps_for(self.config.num_scheduler_steps, self.cache.max_model_len, self.kv, self.queues,
                                  scheduled)
        if num_steps > 1:
            allocate_lookahead(self.kv, scheduled, num_steps)
        plan = self.worker_view.build_plan(scheduled, num_steps)
        if not plan.is_empty:
            self.counters.num_steps += 1
        return plan

    def can_schedule_ahead(self, in_flight: StepPlan) -> bool:
        """Whether the next plan may be built now, while `in_flight` runs (a pipelined
        loop), exactly as if its result were known: its sampled tokens are placeholders
        (Sample.num_pending_tokens). False when the next step could need a real token or
        change what in_flight's samples hold: drafts or multi-step runs (their token counts
        vary), a swapped unit to bring back, or a preemption or copy-on-write (checked
        for the worst case: every running sample computing all it has left)."""
        config, queues = self.config, self.queues
        if config.num_speculative_tokens or config.num_scheduler_steps > 1 or in_flight.num_steps > 1:
            return False
        if queues.swapped:
            return False
        if queues.waiting and queues.running and queues.running[-1].request.priority > queues.waiting[0].request.priority:
            return False  # Could preempt for priority.
        items = [(s, n) for s in queues.running if (n := s.num_uncomputed_tokens) > 0]
        needed = self.kv.blocks_needed_unshared(items)  # None: a copy-on-write
        return needed is not None and needed <= self.kv.num_free_blocks

    def fail_step(self, plan: StepPlan, error: str) -> list[RequestOutput]:
        """The plan never reached the worker, or its result cannot be applied: end its
        requests (and those whose blocks it moved) with ERROR, freeing their blocks."""
        return self.outputs.fail_step(plan, self.outputs.in_plan(plan), error)

    def update_from_output(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Apply a step's sampled tokens; return one output per sample that got a token.

        Tokens for samples no longer running (aborted during the step), not in the
        plan, or still mid-prompt are ignored. A result with `error` fails (ERROR) every
        request of the plan still unfinished. Roots done with their prefill fork.
        """
        return self.outputs.apply(plan, result)
