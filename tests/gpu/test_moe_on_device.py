"""On the device, mixture-of-experts models (tiny random Mixtral, and OLMoE with its
whole-projection q/k norms; 8 experts, top-2) give HF transformers' greedy tokens in
float32 through the engine: the Triton grouped-GEMM kernels on CUDA, captured in the
decode graphs (the expert sort and padding never wait on the host). The rule is
tests/gpu/test_hf_equivalence.py's float32 one."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.test_hf_equivalence import MAX_NEW_TOKENS, assert_same_greedy
from tests.tiny_models import make_tiny_moe_model

from .conftest import GPU
from .test_hf_equivalence import PROMPTS, engine_greedy, hf_generate, hf_model

pytestmark = GPU


@pytest.mark.parametrize("kind", ["mixtral", "olmoe"])
def test_moe_greedy_tokens_match_hf_on_device(kind, tmp_path):
    model_dir = make_tiny_moe_model(tmp_path / kind, kind, seed=5)
    ours = engine_greedy(model_dir, torch.float32)
    hf = hf_model(model_dir, torch.float32)
    for rid, prompt in PROMPTS.items():
        ref, ref_logprobs = hf_generate(hf, prompt, MAX_NEW_TOKENS)
        assert_same_greedy(ours[rid], ref, ref_logprobs, f"{kind} {rid}")
