"""Tiny random-weight HF checkpoints, and a small plan driver standing in for the scheduler."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from llmserve.plan import CachedRequestData, NewRequestData, StepPlan, WorkerSamplingParams

TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=300, max_position_embeddings=256,
    initializer_range=0.25, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
VARIANTS = {
    "llama_tied": ("llama", True),
    "llama_untied": ("llama", False),
    "qwen2_untied": ("qwen2", False),
    "llama3_rope": ("llama3", True),
}
ROPE = {
    "llama": {"rope_type": "default", "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
}


def make_tiny_model(out_dir: Path, kind: str, tied: bool, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if kind in ROPE:
        cfg = LlamaConfig(**TINY, tie_word_embeddings=tied, rope_parameters=ROPE[kind])
        model = LlamaForCausalLM(cfg)
    else:
        cfg = Qwen2Config(**TINY, tie_word_embeddings=tied)
        model = Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # random (non-zero) q/k/v biases so they matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session", params=list(VARIANTS))
def tiny_model_dir(request, tmp_path_factory) -> Path:
    kind, tied = VARIANTS[request.param]
    return make_tiny_model(tmp_path_factory.mktemp(request.param), kind, tied)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llama_runner"), "llama", True, seed=1)


def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@dataclass
class _Req:
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: WorkerSamplingParams
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

    def add(self, rid: str, prompt: list[int], sampling: WorkerSamplingParams | None = None) -> None:
        self.reqs[rid] = _Req(list(prompt), len(prompt), sampling or WorkerSamplingParams(temperature=0.0))

    def preempt(self, rid: str) -> list[str]:
        r = self.reqs[rid]
        self.free.extend(r.blocks)
        r.blocks, r.computed, r.on_worker = [], 0, False
        return [rid]

    def step(self, schedule: dict[str, int | None], finished: list[str] = ()):
        """schedule: rid -> tokens to compute this step (None = all that remain)."""
        plan = StepPlan(self.step_id, finished_request_ids=list(finished))
        self.step_id += 1
        for rid, n in schedule.items():
            r = self.reqs[rid]
            n = n or len(r.token_ids) - r.computed
            need = -(-(r.computed + n) // self.block_size) - len(r.blocks)
            new_blocks = [self.free.pop() for _ in range(max(0, need))]
            r.blocks += new_blocks
            if not r.on_worker:
                plan.new_requests.append(NewRequestData(
                    rid, list(r.token_ids), r.num_prompt_tokens, r.sampling, list(r.blocks), r.computed, n))
                r.on_worker = True
            else:
                plan.cached_requests.append(CachedRequestData(rid, new_blocks, r.computed, n))
            r.computed += n
        result = self.runner.execute(plan)
        for s in result.sampled:
            self.reqs[s.request_id].token_ids.append(s.token_id)
        return result

    def outputs(self, rid: str) -> list[int]:
        r = self.reqs[rid]
        return r.token_ids[r.num_prompt_tokens :]
