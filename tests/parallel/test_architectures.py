"""Each registered family (Llama, Qwen2 with q/k/v bias and a replicated KV head, Gemma)
through the paged KV cache at TP=1 vs HF transformers: logits of a prefill and decodes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from llmserve.worker.distributed import ParallelState
from llmserve.worker.models.loader import load_model
from llmserve.worker.models.registry import model_class

from .conftest import MODELS, PROMPTS, STEPS
from .harness import greedy


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_match_hf(name, parallel_models):
    d = parallel_models[name]
    ours = load_model(d, "float32")
    assert type(ours).__name__ == ours.config.architectures[0]
    tokens, logits = greedy(ours, ParallelState(), PROMPTS[:2], STEPS)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    for prompt, gen, mine in zip(PROMPTS[:2], tokens, logits):
        with torch.inference_mode():
            ref = hf(torch.tensor([prompt + gen])).logits[0, len(prompt) - 1 : -1]  # [STEPS, V]
        torch.testing.assert_close(mine, ref, atol=1e-4, rtol=0)


def test_registry_knows_gemma():
    from types import SimpleNamespace

    assert model_class(SimpleNamespace(architectures=["GemmaForCausalLM"])).__name__ == "GemmaForCausalLM"
