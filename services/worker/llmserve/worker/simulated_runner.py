"""A worker whose forward is a simulated device step (`--simulated-step-ms X`): the host
path of a step measured without a GPU (`llmserve bench overhead`).

It loads no weights: only config.json's facts the scheduler and router use (vocab size,
eos ids, max_model_len). It has the real runner's launch / finish: a launch does the
real runner's host work as it is (InputBatch: validate the plan, add / extend / drop
rows, slot mapping, block tables, the step's tensors and attention metadata, the
sampling rows, placeholders) and queues the step on an asynchronous simulated device:
one thread that runs the launched steps in order, each taking X ms, then computing
`simulated_token` for every sampled row (a fixed function of the position and the
token before it, never an eos id, so anyone holding the prompt can check every output
token). A token before it still a placeholder is resolved there, from the previous
step's device result, as the GPU would. So the host prepares step N+1 while the device
runs N; finish waits for the device (step phase "sync") and fills the placeholders.

Multi-step plans run their steps (each read back before the next); plans carrying
speculative drafts, swaps or block copies are refused (ValueError fails the step, not
the worker).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path

import torch

from llmserve.contract.plan import SampledToken, StepPlan, StepResult
from llmserve.contract.worker_info import WorkerInfo
from llmserve.telemetry import step_phases
from llmserve.worker.attention import TorchPagedAttention
from llmserve.worker.config import RunnerConfig
from llmserve.worker.distributed import ParallelState
from llmserve.worker.input_batch import PLACEHOLDER, InputBatch, Placeholder, RequestState
from llmserve.worker.launched_step import must_finish_first

logger = logging.getLogger(__name__)

# KV blocks the scheduler may hand out when --num-kv-blocks is not given. No cache is
# allocated: a block id is only checked against this count, so it can be generous.
# NOTE: a GPU's count, so the host path is measured at the pool size it meets there (a
# 1B model's blocks of 16 tokens, 512 KiB each, in ~70 GB of an 80 GB card: ~137,000).
# At 16,384 a cost that grows with the pool hid: the free queue's (block_pool.py).
DEFAULT_NUM_BLOCKS = 131072


def simulated_token(position: int, previous: int, vocab_size: int, eos_ids: frozenset[int] = frozenset()) -> int:
    """The token a simulated step samples at `position` after `previous`: a fixed mix of
    the two (a multiplicative hash), stepped past eos ids so a stream never ends early."""
    token = (previous * 7919 + position * 104729 + 1) % vocab_size
    while token in eos_ids:
        token = (token + 1) % vocab_size
    return token


def _eos_ids(model_dir: Path, config: dict) -> tuple[int, ...]:
    """config.json's eos ids and generation_config.json's, as the real runner reports them."""
    ids: list[int] = []
    sources = [config]
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        sources.append(json.loads(gen.read_text()))
    for source in sources:
        value = source.get("eos_token_id")
        ids += [int(v) for v in value] if isinstance(value, list) else [] if value is None else [int(value)]
    return tuple(dict.fromkeys(ids))


def simulated_tokens(positions: torch.Tensor, previous: torch.Tensor, vocab_size: int,
                     eos_ids: frozenset[int] = frozenset()) -> torch.Tensor:
    """simulated_token of every row at once (positions, previous: [S] long -> [S] long):
    the device thread holds the interpreter for a few tensor ops a step, not a Python
    call per row, which would take the host's turn as no GPU does."""
    tokens = (previous * 7919 + positions * 104729 + 1) % vocab_size
    if eos_ids:
        eos = torch.tensor(sorted(eos_ids), dtype=torch.long)
        while (hit := torch.isin(tokens, eos)).any():
            tokens = torch.where(hit, (tokens + 1) % vocab_size, tokens)
    return tokens


@dataclass(eq=False)
class SimulatedStep:
    """One forward launched on the simulated device: what its kernels read (each sampled
    row's position and the token before it, or the index of that token in the previous
    step's result), and, once `done` is set, its sampled ids."""

    positions: list[int]  # [S]
    previous: list[int]  # [S]: the token before, or PLACEHOLDER: then previous_index's in `after`'s ids
    previous_index: list[int]  # [S]
    after: SimulatedStep | None  # the step launched before it, whose ids its placeholders read
    placeholders: list[Placeholder]  # [S]
    ids_stand_in: torch.Tensor  # [S] zeros: what the real runner's next inputs gather from
    ids: list[int] = field(default_factory=list)  # [S], written by the device thread
    ids_t: torch.Tensor | None = None  # [S] long: the same ids, which the next step's placeholders read
    enqueued: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)


class SimulatedDevice:
    """One thread standing for the device: runs the launched steps in launch order, each
    taking `step_s` and then computing its tokens. `idle_starts` counts the steps it
    started idle: launched only after the step before had ended (the host was late)."""

    def __init__(self, step_s: float, vocab_size: int, eos_ids: frozenset[int]):
        self.step_s, self.vocab_size, self.eos_ids = step_s, vocab_size, eos_ids
        self.steps = 0
        self.idle_starts = 0
        self._last_end = 0.0
        self._queue: queue.SimpleQueue[SimulatedStep] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="simulated-device", daemon=True).start()

    def submit(self, step: SimulatedStep) -> None:
        step.enqueued = time.perf_counter()
        self._queue.put(step)

    def _run(self) -> None:
        while True:
            step = self._queue.get()
            if step.enqueued >= self._last_end:
                self.idle_starts += 1
            time.sleep(self.step_s)  # The kernels.
            previous = torch.tensor(step.previous, dtype=torch.long)
            if step.after is not None:  # Placeholders: the ids of the step before, by row.
                pending = previous == PLACEHOLDER
                previous[pending] = step.after.ids_t[torch.tensor(step.previous_index, dtype=torch.long)[pending]]
            step.ids_t = simulated_tokens(torch.tensor(step.positions, dtype=torch.long), previous, self.vocab_size,
                                          self.eos_ids)
            step.ids = step.ids_t.tolist()
            step.after = None  # (no chain of steps kept alive)
            self.steps += 1
            self._last_end = time.perf_counter()
            step.done.set()


@dataclass(eq=False)
class SimulatedLaunch:
    """A plan launched on the simulated device (model_runner's LaunchedStep, simulated)."""

    plan: StepPlan
    rows: list[tuple[RequestState, int]]
    sampled: list[SampledToken] = field(default_factory=list)
    num_steps: int = 1
    pending: SimulatedStep | None = None
    result: StepResult | None = None
    verifies_drafts: bool = False  # (refused here)

    def device_done(self) -> bool:
        pending = self.pending
        return pending is None or pending.done.is_set()

    def wait(self) -> None:
        pending = self.pending  # (finish may clear it meanwhile, on the compute thread)
        if pending is not None:
            pending.done.wait()


class SimulatedRunner:
    """ModelRunner's interface as the worker service uses it (launch, finish, execute,
    interrupt, reset_requests, info, parallel) over a simulated device; see the module
    docstring."""

    def __init__(self, model_dir: Path, settings: RunnerConfig, step_ms: float, *, model_name: str | None = None):
        if step_ms <= 0:
            raise ValueError(f"a simulated step needs a positive duration, got {step_ms} ms")
        self.model_dir = Path(model_dir)
        self.step_s = step_ms / 1000.0
        config = json.loads((self.model_dir / "config.json").read_text())
        self.vocab_size = int(config["vocab_size"])
        own_len = int(config.get("max_position_embeddings", 2048))
        max_model_len = min(settings.max_model_len or own_len, own_len)
        eos = _eos_ids(self.model_dir, config)
        self.eos_ids = frozenset(eos)
        self.parallel = ParallelState()  # One process: no group to join.
        self.num_kv_blocks = settings.num_kv_blocks or DEFAULT_NUM_BLOCKS
        self.batch = InputBatch(settings.block_size, self.num_kv_blocks, max_model_len, TorchPagedAttention, "cpu")
        self.device = SimulatedDevice(self.step_s, self.vocab_size, self.eos_ids)
        self._unfinished: list[SimulatedLaunch] = []  # Launched, not read back (oldest first; at most two)
        self._interrupted_step_id = -1
        bos = config.get("bos_token_id")
        self.info = WorkerInfo(
            model=model_name or self.model_dir.name, model_path=str(self.model_dir),
            num_kv_blocks=self.num_kv_blocks, block_size=settings.block_size, dtype="simulated",
            max_model_len=max_model_len, vocab_size=self.vocab_size, eos_token_ids=eos,
            bos_token_id=int(bos) if isinstance(bos, int) else -1, device=f"simulated ({step_ms:g} ms per step)",
            dtype_reason="--simulated-step-ms: no weights loaded")
        logger.info("simulated device: %g ms per step, %d KV block ids, no weights loaded", step_ms,
                    self.num_kv_blocks)

    def reset_requests(self) -> None:
        for launched in self._unfinished:
            launched.wait()
        self._unfinished.clear()
        self.batch.clear()

    def interrupt(self, step_id: int) -> None:
        self._interrupted_step_id = step_id

    def execute(self, plan: StepPlan) -> StepResult:
        return self.finish(self.launch(plan))

    def launch(self, plan: StepPlan) -> SimulatedLaunch:
        """As ModelRunner.launch: the plan's host work, its step queued on the device."""
        if plan.swap_in or plan.swap_out or plan.copies:
            raise ValueError("a simulated worker holds no KV cache: it cannot swap or copy blocks")
        if any(map(attrgetter("draft_token_ids"), (*plan.new_requests, *plan.cached_requests))):
            raise ValueError("a simulated worker does not verify speculative drafts")
        while len(self._unfinished) > 1:
            self.finish(self._unfinished[0])
        if self._unfinished and must_finish_first(self._unfinished[-1], plan, self.batch.states):
            self.finish(self._unfinished[-1])
        prev = self._unfinished[-1].pending if self._unfinished else None
        start = time.perf_counter()
        rows = self.batch.apply_plan(plan)
        step_phases.add("prepare", time.perf_counter() - start)
        launched = SimulatedLaunch(plan, rows)
        steps_run = 0
        while rows and steps_run < plan.num_steps and (steps_run == 0 or self._interrupted_step_id != plan.step_id):
            if launched.pending is not None:  # A multi-step run: its next step reads these ids.
                launched.sampled += self._read_back(launched.pending)
            launched.pending = self._launch_step(rows, prev)
            steps_run += 1
        launched.num_steps = max(steps_run, 1)
        step_phases.add("plans", 1)
        self._unfinished.append(launched)
        return launched

    def finish(self, launched: SimulatedLaunch) -> StepResult:
        """As ModelRunner.finish: waits for the device, fills the placeholders."""
        if launched.result is None:
            if launched.pending is not None:
                launched.sampled += self._read_back(launched.pending)
                launched.pending = None
            launched.result = StepResult(step_id=launched.plan.step_id, sampled=launched.sampled,
                                         num_steps=launched.num_steps)
            self._unfinished.remove(launched)
        return launched.result

    def _launch_step(self, rows, prev: SimulatedStep | None) -> SimulatedStep:
        """One step's inputs as the real runner builds them, queued on the device."""
        start = time.perf_counter()
        inp = self.batch.build_inputs(rows, prev.ids_stand_in if prev is not None else None)
        for st, n in rows:
            st.num_computed_tokens += n
        states = inp.sample_states
        step = SimulatedStep([len(st.token_ids) for st in states], [st.token_ids[-1] for st in states],
                             [st.placeholder.index if st.placeholder is not None else -1 for st in states],
                             prev, [], torch.zeros(len(states), dtype=torch.long))
        for k, st in enumerate(states):
            st.token_ids.append(PLACEHOLDER)
            st.placeholder = Placeholder(st, len(st.token_ids) - 1, k)
            step.placeholders.append(st.placeholder)
        self.device.submit(step)
        step_phases.add("prepare", time.perf_counter() - start)
        step_phases.add("device", self.step_s)
        step_phases.add("steps", 1)
        if 0 < [n for _, n in rows].count(1) < len(rows):  # (every row computes n >= 1 tokens)
            step_phases.add("mixed_steps", 1)
        return step

    def _read_back(self, step: SimulatedStep) -> list[SampledToken]:
        """The step's ids once the device is done (the wait is phase "sync"), over its placeholders."""
        start = time.perf_counter()
        step.done.wait()
        out = []
        for ph, tok in zip(step.placeholders, step.ids):
            ph.state.token_ids[ph.position] = tok
            if ph.state.placeholder is ph:
                ph.state.placeholder = None
            out.append(SampledToken(ph.state.seq_id, tok, None))
        step_phases.add("sync", time.perf_counter() - start)
        return out
