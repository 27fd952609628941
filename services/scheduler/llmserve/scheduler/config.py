"""The scheduler service's settings (flags, LLMSERVE_* variables and config-file keys alike)."""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.scheduler.preemption import PreemptionMode
from llmserve.contract.grpc_server import ServerOptions, service_command
from llmserve.contract.security import SecurityOptions
from llmserve.contract.step_budget import by_device_help
from llmserve.settings import group, positive_int, setting
from llmserve.scheduler.admission import QUEUED_TOKENS_PER_STEP_BUDGET


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """The scheduling policy: what the scheduler core, the in-process engine and the
    service all take. The worker's cache shape is not here: it is a fact the worker
    reports when it registers (KVCacheShape), not a setting."""

    # None: by the device the worker reports at registration (step_budget.py resolves it).
    max_num_seqs: int | None = setting(None, parse=positive_int, unset=by_device_help("max_num_seqs"),
                                       help="most sequences in one step")
    max_num_batched_tokens: int | None = setting(
        None, parse=positive_int, unset=by_device_help("max_num_batched_tokens"),
        help="most tokens computed in one step (long prompts are chunked to fit)")
    enable_chunked_prefill: bool = setting(True, flag="chunked-prefill",
                                           help="split prompts longer than a step's token budget (off: prompts fit one step whole)")
    enable_prefix_caching: bool = setting(True, flag="prefix-caching",
                                          help="reuse the KV of earlier prompts' full blocks")
    preemption_mode: PreemptionMode = setting(PreemptionMode.AUTO, parse=PreemptionMode, choices=tuple(PreemptionMode),
                                              help="when KV blocks run out: swap to CPU, recompute later, or auto "
                                                   "(swap requests with several samples, recompute the others)")
    num_scheduler_steps: int = setting(1, parse=positive_int,
                                       help="decode steps one plan may run back to back on the worker (multi-step "
                                            "scheduling) while nothing waits: one plan, result and message per K tokens; "
                                            "tokens reach clients K at a time; an arrival cuts a run short after one step")
    num_speculative_tokens: int = setting(
        0, flag="speculative-tokens", parse=int,
        help="speculative decoding: draft up to K tokens per decoding sequence by n-gram lookup in its own prompt "
             "and output (vLLM's ngram method) and verify them in the same pass; output is unchanged (greedy: "
             "identical; sampled: the same distribution); 0 = off")
    speculative_ngram_min: int = setting(2, parse=positive_int,
                                         help="shortest suffix (tokens) looked up for a draft")
    speculative_ngram_max: int = setting(4, parse=positive_int,
                                         help="longest suffix (tokens) looked up for a draft; the longest match wins")
    speculative_disable_by_batch_size: int | None = setting(
        None, parse=positive_int, unset="never",
        help="no drafts in a step that schedules more than N sequences: a full batch is compute-bound, so rejected "
             "drafts' extra rows cost it the most and accepted ones save it the least (vLLM's setting of this name)")
    # NOTE: by device because on a CPU worker the overlap has no idle device to fill: the
    # scheduler's planning competes with the forward for the same cores (the reference
    # workload through gRPC measured ~4% slower pipelined on a 2-core host).
    async_scheduling: bool | None = setting(
        None, flag="async-scheduling", unset="by device: on for a GPU worker, off on the CPU",
        help="pipelined engine loop: plan step N+1 while the worker runs step N (tokens sampled at N are "
             "placeholders the worker fills in); steps that need the real tokens first (a possible preemption, "
             "swap-in, copy-on-write, drafts, multi-step) run serially; off: the serial loop")
    # NOTE: the bounds apply to requests from routers (the service); the in-process
    # engine queues whatever its caller adds. See admission.py.
    max_queued_requests: int | None = setting(
        None, parse=positive_int, unset="max-num-seqs: a full batch waits at most",
        help="most requests waiting for a seat (queued or swapped out, beyond the seats the next step frees); "
             "past it a new request is refused at once with RESOURCE_EXHAUSTED and a retry hint, unless it has "
             "better priority than a queued request that has not started, which is refused instead")
    max_queued_tokens: int | None = setting(
        None, parse=positive_int, unset=f"{QUEUED_TOKENS_PER_STEP_BUDGET} x max-num-batched-tokens",
        help="most prompt tokens the queued requests may still have to compute; past it new requests are refused "
             "the same way (a request that finds the queue empty is always queued)")

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "num_scheduler_steps", "max_queued_requests",
                     "max_queued_tokens", "speculative_ngram_min", "speculative_ngram_max",
                     "speculative_disable_by_batch_size"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.speculative_ngram_min > self.speculative_ngram_max:
            raise ValueError(f"speculative_ngram_min ({self.speculative_ngram_min}) is above speculative_ngram_max "
                             f"({self.speculative_ngram_max})")
        object.__setattr__(self, "preemption_mode", PreemptionMode(self.preemption_mode))


@dataclass(frozen=True, kw_only=True)
class StepWatchdogConfig:
    """How long a worker has to answer a step before it counts as stopped (step_watchdog.py):
    max(floor, factor x the 99th percentile of recent steps' seconds per step x the plan's
    steps), the floor raised for the first steps and for prefill-heavy plans."""

    enabled: bool = setting(True, flag="step-watchdog",
                            help="drop a worker whose step goes unanswered past its bound (a frozen GPU or "
                                 "collective looks so from outside): its requests end with UNAVAILABLE, health "
                                 "turns NOT_SERVING and the worker may register again")
    floor_s: float = setting(5.0, flag="step-watchdog-floor",
                             help="seconds every step has, however fast recent steps were")
    factor: float = setting(5.0, flag="step-watchdog-factor",
                            help="a step has this many times the 99th percentile of recent steps' time (per step "
                                 "of a multi-step plan)")
    warmup_steps: int = setting(16, flag="step-watchdog-warmup-steps", parse=int,
                                help="steps after a registration that get --step-watchdog-warmup-floor (lazy "
                                     "compilation and first allocations make them slow)")
    warmup_floor_s: float = setting(60.0, flag="step-watchdog-warmup-floor",
                                    help="seconds each of the first steps after a registration has")
    prefill_floor_s: float = setting(20.0, flag="step-watchdog-prefill-floor",
                                     help="seconds a prefill-heavy step (half its tokens or more from prompts) has")

    def __post_init__(self) -> None:
        for name in ("floor_s", "factor", "warmup_floor_s", "prefill_floor_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"step watchdog: {name} must be positive, got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise ValueError(f"step watchdog: warmup_steps must be >= 0, got {self.warmup_steps}")


@dataclass(frozen=True)
class SchedulerServiceConfig:
    scheduling: SchedulerConfig = group(SchedulerConfig)
    server: ServerOptions = group(lambda: ServerOptions(port=50052))
    security: SecurityOptions = group(SecurityOptions)
    stream_interval: int = setting(1, parse=positive_int,
                                   help="stream each sample's tokens N at a time (its first and last at once): fewer "
                                        "messages, less control-plane CPU beside the model; 1 = every token")
    log_stats_interval_s: float = setting(10.0, flag="log-stats-interval",
                                          help="seconds between queue / KV-usage log lines while busy")
    step_timeout_s: float = setting(300.0, flag="step-timeout",
                                    help="seconds a worker group has to answer a step before it counts as lost")
    step_watchdog: StepWatchdogConfig = group(StepWatchdogConfig)


COMMAND = service_command("scheduler", "request queues, KV block tables, engine loop", SchedulerServiceConfig,
                          "llmserve.scheduler.service:serve")
