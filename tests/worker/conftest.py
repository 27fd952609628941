"""Tiny random-weight HF checkpoints, and a small plan driver standing in for the scheduler."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llmserve.contract.plan import CachedRequestData, NewRequestData, StepPlan
from llmserve.contract.sampling import SamplingParams

from tests.tiny_models import VARIANTS, make_tiny_model  # noqa: F401  (fixtures live in tests/conftest.py)


def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir: Path, prompts: dict[str, list[int]], num_tokens: int) -> dict[str, list[int]]:
    """HF transformers' greedy continuation of each prompt: exactly num_tokens tokens
    (eos ignored), one prompt at a time (no padding)."""
    hf = hf_model(model_dir)
    with torch.inference_mode():
        return {rid: hf.generate(torch.tensor([p]), max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for rid, p in prompts.items()}


@dataclass
class _Req:
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    on_worker: bool = False


class PlanDriver:
    """Builds StepPlans the way the scheduler would: new requests in full, then deltas;
    blocks handed out from a shuffled free list (non-contiguous ids)."""

    def __init__(self, runner, block_size: int, num_blocks: int, seed: int = 0):
        self.runner, self.block_size = runner, block_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.reqs: dict[str, _Req] = {}
        self.step_id = 0

    def add(self, rid: str, prompt: list[int], sampling: SamplingParams | None = None) -> None:
        self.reqs[rid] = _Req(list(prompt), len(prompt), sampling or SamplingParams(temperature=0.0))

    def preempt(self, rid: str) -> list[str]:
        r = self.reqs[rid]
        self.free.extend(r.blocks)
        r.blocks, r.computed, r.on_worker = [], 0, False
        return [rid]

    def step(self, schedule: dict[str, int | None], finished: list[str] = (), num_steps: int = 1):
        """schedule: rid -> tokens to compute this step (None = all that remain);
        num_steps > 1: a multi-step plan of one-token decodes (slots for every step)."""
        plan = StepPlan(self.step_id, finished_seq_ids=[self.seq_id(rid) for rid in finished], num_steps=num_steps)
        self.step_id += 1
        for rid, n in schedule.items():
            r = self.reqs[rid]
            n = n or len(r.token_ids) - r.computed
            need = -(-(r.computed + max(n, num_steps)) // self.block_size) - len(r.blocks)
            new_blocks = [self.free.pop() for _ in range(max(0, need))]
            r.blocks += new_blocks
            if not r.on_worker:
                plan.new_requests.append(NewRequestData(
                    self.seq_id(rid), list(r.token_ids), r.num_prompt_tokens, r.sampling, list(r.blocks), r.computed, n))
                r.on_worker = True
            else:
                plan.cached_requests.append(CachedRequestData(self.seq_id(rid), new_blocks, r.computed, n))
            r.computed += n
        result = self.runner.execute(plan)
        for s in result.sampled:
            self.reqs[self.name(s.seq_id)].token_ids.append(s.token_id)
        for rid in schedule:  # Each further step of a run computed the token sampled before it.
            self.reqs[rid].computed += result.num_steps - 1
        return result

    def seq_id(self, rid: str) -> int:
        """The sequence id the plans give request `rid` (its place among added requests)."""
        return list(self.reqs).index(rid) + 1

    def name(self, seq_id: int) -> str:
        return list(self.reqs)[seq_id - 1]

    def outputs(self, rid: str) -> list[int]:
        r = self.reqs[rid]
        return r.token_ids[r.num_prompt_tokens :]
