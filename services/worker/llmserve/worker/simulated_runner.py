"""A worker whose forward is a simulated device step (`--simulated-step-ms X`): the host
path of a step measured without a GPU (`llmserve bench overhead`).

It loads no weights: only config.json's facts the scheduler and router use (vocab size,
eos ids, max_model_len). Each step does the real runner's host work as it is (InputBatch:
validate the plan, add / extend / drop rows, slot mapping, block tables, the step's
tensors and attention metadata, the sampling rows), then sleeps X ms on the compute
thread, standing for the device, then returns `simulated_token` for every sampled row:
a fixed function of the position and the token before it, never an eos id, so anyone
holding the prompt can check every output token.

Multi-step plans run their steps (one sleep each); plans carrying speculative drafts,
swaps or block copies are refused (ValueError fails the step, not the worker).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from llmserve.contract.plan import SampledToken, StepPlan, StepResult
from llmserve.contract.worker_info import WorkerInfo
from llmserve.telemetry import step_phases
from llmserve.worker.attention import TorchPagedAttention
from llmserve.worker.config import RunnerConfig
from llmserve.worker.distributed import ParallelState
from llmserve.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)

# KV blocks the scheduler may hand out when --num-kv-blocks is not given. No cache is
# allocated: a block id is only checked against this count, so it can be generous.
DEFAULT_NUM_BLOCKS = 16384


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


class SimulatedRunner:
    """ModelRunner's interface as the worker service uses it (execute, interrupt,
    reset_requests, info, parallel) over a simulated device; see the module docstring."""

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
        self.batch.clear()

    def interrupt(self, step_id: int) -> None:
        self._interrupted_step_id = step_id

    def execute(self, plan: StepPlan) -> StepResult:
        if plan.swap_in or plan.swap_out or plan.copies:
            raise ValueError("a simulated worker holds no KV cache: it cannot swap or copy blocks")
        if any(r.draft_token_ids for r in plan.new_requests) or any(c.draft_token_ids for c in plan.cached_requests):
            raise ValueError("a simulated worker does not verify speculative drafts")
        start = time.perf_counter()
        rows = self.batch.apply_plan(plan)
        step_phases.add("prepare", time.perf_counter() - start)
        sampled: list[SampledToken] = []
        steps_run = 0
        while rows and steps_run < plan.num_steps and (steps_run == 0 or self._interrupted_step_id != plan.step_id):
            sampled += self._step(rows)
            steps_run += 1
        step_phases.add("plans", 1)
        return StepResult(step_id=plan.step_id, sampled=sampled, num_steps=max(steps_run, 1))

    def _step(self, rows) -> list[SampledToken]:
        """One step: inputs as the real runner builds them, the device's time, the tokens."""
        start = time.perf_counter()
        inp = self.batch.build_inputs(rows)
        launched = time.perf_counter()
        time.sleep(self.step_s)  # The device computing; the GIL is free meanwhile, as under a CUDA sync.
        for st, n in rows:
            st.num_computed_tokens += n
        out = []
        for st in inp.sample_states:
            tok = simulated_token(len(st.token_ids), st.token_ids[-1], self.vocab_size, self.eos_ids)
            st.token_ids.append(tok)
            out.append(SampledToken(st.seq_id, tok, None))
        end = time.perf_counter()
        step_phases.add("prepare", launched - start)
        step_phases.add("device", self.step_s)
        # What a real step spends past the device's work: waking from the blocking wait
        # (the sleep's overshoot) and turning the sampled ids into the step's results.
        step_phases.add("sync", end - launched - self.step_s)
        step_phases.add("steps", 1)
        if any(n > 1 for _, n in rows) and any(n == 1 for _, n in rows):
            step_phases.add("mixed_steps", 1)
        return out
