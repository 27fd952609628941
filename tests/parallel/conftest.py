"""Tiny random models for the parallel tests, their TP=1 references and HF's greedy ids."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.tiny_models import make_tiny_model

STEPS = 6
_rng = random.Random(5)
PROMPTS = [[_rng.randrange(3, 300) for _ in range(n)] for n in (5, 11, 1, 8)]

# name -> (kind, tied, overrides)
MODELS = {
    "llama_kv2": ("llama", True, {"num_hidden_layers": 4}),  # 4 query heads, 2 KV heads
    "qwen2_kv1": ("qwen2", False, {"num_key_value_heads": 1}),  # KV heads < TP size; 3 layers: uneven PP split
    "gemma": ("gemma", True, {"num_hidden_layers": 2}),
    # Fused qkv/gate_up checkpoint tensors split per rank; partial rotary. Original length =
    # max length: short LongRoPE factors, as HF's for these short prompts.
    "phi3": ("phi3", False, {"num_hidden_layers": 2, "original_max_position_embeddings": 256}),
}


@pytest.fixture(scope="session")
def parallel_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("parallel-models")
    return {name: make_tiny_model(root / name, kind, tied, seed=3, **ov) for name, (kind, tied, ov) in MODELS.items()}


def hf_greedy(model_dir: Path, prompt: list[int], steps: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(steps):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="session")
def references(parallel_models):
    """name -> (TP=1 tokens, TP=1 logits per prompt, TP=1 parameter shapes, HF tokens)."""
    from llmserve.worker.distributed import ParallelState
    from llmserve.worker.models.loader import load_model

    from .harness import greedy, resident_weight_shapes

    out = {}
    for name, d in parallel_models.items():
        model = load_model(d, "float32")
        tokens, logits = greedy(model, ParallelState(), PROMPTS, STEPS)
        shapes = resident_weight_shapes(model)
        out[name] = (tokens, logits, shapes, [hf_greedy(d, p, STEPS) for p in PROMPTS])
    return out


@pytest.fixture(scope="session")
def served_tiny_model(tmp_path_factory) -> Path:
    """A tiny random Llama (4 query / 2 KV heads) with SmolLM2's tokenizer and vocabulary
    size, so the router can serve it: clusters start in seconds."""
    import shutil

    from llmserve.model_store import default_model_dir

    d = make_tiny_model(tmp_path_factory.mktemp("served-tiny"), "llama", True, seed=7, num_hidden_layers=4,
                        vocab_size=49152, max_position_embeddings=512)
    src = default_model_dir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / name).exists():
            shutil.copy(src / name, d / name)
    return d
