"""`llmserve bench make-model`: a random-weight Llama checkpoint of a realistic shape,
made on the spot (no download), as an HF directory (config.json + model.safetensors).

Throughput does not depend on the weights' values, only on the shapes, so random
weights measure what a real checkpoint of that shape would. No tokenizer is written:
the benchmarks' workloads are random token ids (`--workload random|reference`).

Presets:
- `llama-1b`: Llama 3.2 1B's exact shape (hidden 2048, 16 layers, 32 query heads, 8 KV
  heads of dim 64, MLP 8192, vocab 128256, tied embeddings, llama3 rope): 1.24 B
  parameters, 2.5 GB in bf16. The 128256-entry vocabulary matters: its LM head is a
  fifth of the weights a decode step reads, which a 32000 vocab would understate.
- `tiny`: the same architecture at toy size, for CPU dry runs and tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

PRESETS = {
    "llama-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
    ),
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    ),
}
INIT_STD = 0.02  # Llama's initializer_range: activations stay in bf16's comfortable range.


def parameter_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape of the HF checkpoint, as transformers' own Llama class
    declares them (built on the meta device: no memory, no init). A tied LM head is
    stored once, as the embedding."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def random_weights(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device,
                   seed: int) -> dict[str, torch.Tensor]:
    """N(0, 0.02) for every matrix, ones for the RMSNorm gains (random gains would scale
    the residual stream layer after layer), generated on `device` (a GPU fills 1.2 B
    values in milliseconds) and returned on the CPU for saving."""
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=dtype)
        else:
            t = (torch.randn(shape, generator=gen, device=device) * INIT_STD).to(dtype).cpu()
        tensors[name] = t
    return tensors


def make_random_model(out_dir: str | Path, preset: str = "llama-1b", dtype: torch.dtype = torch.bfloat16,
                      device: str | torch.device = "cpu", seed: int = 0) -> dict:
    """Writes the checkpoint; returns what it made (parameters, bytes, shape)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # NOTE: `architectures` is what a loader (ours, HF's Auto classes) picks the class by.
    config = LlamaConfig(**PRESETS[preset], dtype=dtype, architectures=["LlamaForCausalLM"])
    tensors = random_weights(parameter_shapes(config), dtype, torch.device(device), seed)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    made = {"preset": preset, "dir": str(out), "dtype": str(dtype).removeprefix("torch."),
            "parameters": sum(t.numel() for t in tensors.values()),
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "shape": {k: v for k, v in PRESETS[preset].items() if k != "rope_parameters"}}
    (out / "random-model.json").write_text(json.dumps(made, indent=2))
    return made


def bench_make_model(args) -> int:
    from llmserve.worker.device import DTYPE_NAMES, resolve_device

    made = make_random_model(args.out, args.preset, DTYPE_NAMES[args.dtype], resolve_device(args.device), args.seed)
    print(f"random {args.preset} model: {made['parameters'] / 1e6:,.1f} M parameters, {made['dtype']}, "
          f"{made['bytes'] / 2**20:,.1f} MiB in {made['dir']}", flush=True)
    return 0
