"""The engine without the network: the scheduler core and a model runner in one
process, driven by the same loop as the services (schedule -> execute -> update).

Where the scheduling config is pipelined (async_scheduling: on for a CUDA runner unless
set) and the runner can launch a plan without reading its tokens back (ModelRunner.launch
/ finish), each step plans and launches N+1 while N runs on the device, then reads N back
and applies it, as the scheduler service's loop does (scheduler/engine_loop.py):

    serial:     schedule N | launch N, read N | apply N | schedule N+1 | ...
    pipelined:  schedule N+1 | launch N+1 | read N, apply N | schedule N+2 | launch N+2 | read N+1 ...
                             (device: N ........ N+1 .......................... N+2)

N's sampled ids are placeholders in N+1 (the runner fills them on the device); a step the
core cannot plan without N's real tokens (Scheduler.can_schedule_ahead) reads N back first.

Used for offline batch generation; `llmserve bench` also runs it as the in-process
baseline that the services are compared with (its figures are taken outside this class,
in bench/llmserve/bench/).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

from llmserve.contract.heap import collector_for_step_loop
from llmserve.contract.outputs import RequestOutput
from llmserve.contract.plan import StepPlan
from llmserve.contract.sampling import SamplingParams
from llmserve.scheduler.config import SchedulerConfig
from llmserve.scheduler.scheduler import KVCacheShape, Scheduler
from llmserve.scheduler.step_budget import config_for


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""


class InProcessEngine:
    def __init__(self, runner, config: SchedulerConfig = SchedulerConfig()):
        """The scheduler core under `config` driving `runner` (a ModelRunner, or anything
        with its `info` and `execute`); a step budget left "by device" is resolved from the
        runner's device, as the scheduler service does at registration."""
        info = runner.info
        self.runner = runner
        config, self.step_budget = config_for(config, info)
        # NOTE: the cache must hold one whole sequence, or a request could never run;
        # unless every layer has a window and prefills are chunked: a sequence then holds
        # its window's blocks only.
        windowed = info.sliding_window and config.enable_chunked_prefill
        cache = KVCacheShape(num_blocks=info.num_kv_blocks, block_size=info.block_size,
                             max_model_len=info.max_model_len if windowed else min(
                                 info.max_model_len, info.num_kv_blocks * info.block_size),
                             num_cpu_blocks=info.num_cpu_blocks, sliding_window=info.sliding_window)
        self.scheduler = Scheduler(config, cache, info.eos_token_ids)
        self.pipelined = bool(config.async_scheduling) and callable(getattr(runner, "launch", None))
        self._in_flight: deque[tuple[StepPlan, object]] = deque()  # (plan, its LaunchedStep), oldest first
        self.num_plans = 0  # Plans run, lifetime.

    @classmethod
    def from_model_dir(cls, model_dir: Path, **settings) -> "InProcessEngine":
        """An engine for a model directory: each keyword is a setting of the runner
        (`RunnerConfig`: dtype, num_kv_blocks, kv_cache_memory, swap_space, ...) or of the
        scheduler (`SchedulerConfig`); max_num_batched_tokens is both (the runner's
        profiling forward is one full step). Offline use has no swap space unless asked for."""
        from llmserve.worker.config import RunnerConfig
        from llmserve.worker.model_runner import ModelRunner

        runner_fields, scheduler_fields = ({f.name for f in fields(c)} for c in (RunnerConfig, SchedulerConfig))
        unknown = set(settings) - runner_fields - scheduler_fields
        if unknown:
            raise TypeError(f"unknown engine settings: {sorted(unknown)}")
        runner = ModelRunner(model_dir, RunnerConfig(**{"swap_space": 0, **{k: v for k, v in settings.items()
                                                                            if k in runner_fields}}))
        return cls(runner, SchedulerConfig(**{k: v for k, v in settings.items() if k in scheduler_fields}))

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    n: int = 1, priority: int = 0, cache_salt: str = "") -> None:
        """Queue a request (Scheduler.add_request: a `cache_salt` shares cached prefix
        blocks only with requests of the same salt, as the gRPC and OpenAI APIs' field)."""
        self.scheduler.add_request(request_id, prompt_token_ids, sampling, n=n, priority=priority,
                                   cache_salt=cache_salt)

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, execute, apply (pipelined: launch the next plan, then
        read back and apply the one before it). Returns the outputs applied."""
        if self.pipelined:
            return self._pipelined_step()
        plan: StepPlan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        self.num_plans += 1
        result = self.runner.execute(plan)
        return self.scheduler.update_from_output(plan, result)

    def has_unfinished(self) -> bool:
        """Requests left to run, or a plan still in flight (whose tokens are not applied)."""
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def _pipelined_step(self) -> list[RequestOutput]:
        outputs = []
        if self._in_flight and not self.scheduler.can_schedule_ahead(self._in_flight[-1][0]):
            outputs += self._apply_oldest()  # N+1 needs N's real tokens: a serial step.
        plan = self.scheduler.schedule() if self.scheduler.has_unfinished_requests() else None
        if plan is None or plan.is_empty:
            return outputs + (self._apply_oldest() if self._in_flight else [])
        self.num_plans += 1
        self._in_flight.append((plan, self.runner.launch(plan)))
        if len(self._in_flight) > 1:
            outputs += self._apply_oldest()  # (N+1 is on the device meanwhile)
        return outputs

    def _apply_oldest(self) -> list[RequestOutput]:
        plan, launched = self._in_flight.popleft()
        return self.scheduler.update_from_output(plan, self.runner.finish(launched))

    def run(self, requests: list[tuple[str, list[int], SamplingParams]],
            on_output: Callable[[RequestOutput], None] | None = None) -> dict[str, Completion]:
        """Adds every request, steps until all finish, returns their completions.

        The steps run with the collector set as the services set theirs
        (heap.collector_for_step_loop): with CPython's default a young collection walks the
        step's live records every 700 allocations, and a full one the caller's whole heap."""
        completions = {}
        for request_id, prompt, sampling in requests:
            self.add_request(request_id, prompt, sampling)
            completions[request_id] = Completion(request_id, list(prompt))
        with collector_for_step_loop():
            while self.has_unfinished():
                for out in self.step():
                    done = completions[out.request_id]
                    done.output_token_ids += out.new_token_ids
                    if out.finished:
                        done.finish_reason = out.finish_reason.name.lower()
                    if on_output is not None:
                        on_output(out)
        return completions
