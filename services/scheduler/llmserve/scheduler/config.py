"""The scheduler service's settings (flags, LLMSERVE_* variables and config-file keys alike)."""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.settings import Command, positive_int, setting


@dataclass(frozen=True)
class SchedulerServiceConfig:
    host: str = setting("0.0.0.0", help="address to listen on")
    port: int = setting(50052, help="port the router and the workers dial")
    max_num_seqs: int = setting(256, parse=positive_int, help="most sequences in one step")
    max_num_batched_tokens: int = setting(512, parse=positive_int,
                                          help="most tokens computed in one step (long prompts are chunked to fit)")
    enable_chunked_prefill: bool = setting(True, flag="chunked-prefill",
                                           help="split prompts longer than a step's token budget (off: prompts fit one step whole)")
    enable_prefix_caching: bool = setting(True, flag="prefix-caching",
                                          help="reuse the KV of earlier prompts' full blocks")
    preemption_mode: str = setting("auto", choices=("auto", "swap", "recompute"),
                                   help="when KV blocks run out: swap to CPU, recompute later, or auto "
                                        "(swap requests with several samples, recompute the others)")
    stream_interval: int = setting(1, parse=positive_int,
                                   help="stream each sample's tokens N at a time (its first and last at once): fewer "
                                        "messages, less control-plane CPU beside the model; 1 = every token")
    num_scheduler_steps: int = setting(1, parse=positive_int,
                                       help="decode steps one plan may run back to back on the worker (multi-step "
                                            "scheduling) while nothing waits: one plan, result and message per K tokens; "
                                            "tokens reach clients K at a time; an arrival cuts a run short after one step")
    log_stats_interval_s: float = setting(10.0, flag="log-stats-interval",
                                          help="seconds between queue / KV-usage log lines while busy")
    step_timeout_s: float = setting(300.0, flag="step-timeout",
                                    help="seconds a worker group has to answer a step before it counts as lost")
    metrics_port: int = setting(0, help="Prometheus endpoint http://HOST:PORT/metrics (0 = off)")
    shutdown_timeout_s: float = setting(30.0, flag="shutdown-timeout",
                                        help="after SIGTERM, seconds running requests may go on before they are failed")


def _run(config: SchedulerServiceConfig) -> int:
    from llmserve.contract.grpc_server import run_until_signal
    from llmserve.scheduler.service import serve

    return run_until_signal(serve, config)


COMMAND = Command("scheduler", "request queues, KV block tables, engine loop", SchedulerServiceConfig, _run)
