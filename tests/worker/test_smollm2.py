"""The real embedded model (SmolLM2-135M-Instruct, fp32) against HF transformers."""

from __future__ import annotations

import pytest
import torch

from llmserve.model_store import default_model_dir

from .conftest import PlanDriver, hf_model

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3717, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575]


@pytest.fixture(scope="module")
def model_dir():
    try:
        return default_model_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_smollm2_prefill_logits_and_greedy_match_hf(model_dir):
    from llmserve.worker.model_runner import ModelRunner
    from llmserve.worker.config import RunnerConfig

    # float32 said explicitly: `auto` serves the file's Q4_1 as int8 or bfloat16 (cpu_dtype.py).
    runner = ModelRunner(model_dir, RunnerConfig(dtype="float32", block_size=16, num_kv_blocks=8, swap_space=0))
    assert runner.info.eos_token_ids[0] == 2 and runner.info.vocab_size == 49152
    hf = hf_model(model_dir)
    with torch.inference_mode():
        ref = hf(torch.tensor([PROMPT])).logits[0]
        hf_greedy = hf.generate(torch.tensor([PROMPT]), max_new_tokens=16, min_new_tokens=16,
                                do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    # our prefill logits: run the model directly on every position
    from llmserve.worker.attention import TorchPagedAttention

    T = len(PROMPT)
    meta = TorchPagedAttention.build_metadata([T], [T], [[3, 1]], torch.tensor([3 * 16 + i if i < 16 else 16 + i - 16 for i in range(T)]), 16)
    with torch.inference_mode():
        mine = runner.model.compute_logits(runner.model(torch.tensor(PROMPT), torch.arange(T), runner.kv_caches, meta))
    diff = (mine - ref).abs().max().item()
    print(f"SmolLM2 prefill max |logit diff| vs HF: {diff:.2e}")
    assert diff < 1e-3

    d = PlanDriver(runner, 16, 8)
    d.add("r", PROMPT)
    for _ in range(16):
        d.step({"r": None if not d.reqs["r"].on_worker else 1})
    assert d.outputs("r") == hf_greedy
