"""`llmserve bench make-model`: a random-weight Llama checkpoint of a realistic shape,
made on the spot (no download), as an HF directory (config.json + model.safetensors).

Throughput does not depend on the weights' values, only on the shapes, so random
weights measure what a real checkpoint of that shape would. The benchmarks' workloads
are random token ids (`--workload random|reference`); the tokenizer written beside the
weights (one word `<tN>` per id N) is there for the router, which a cluster cannot start
without (`bench loops`).

Presets:
- `llama-1b`: Llama 3.2 1B's exact shape (hidden 2048, 16 layers, 32 query heads, 8 KV
  heads of dim 64, MLP 8192, vocab 128256, tied embeddings, llama3 rope): 1.24 B
  parameters, 2.5 GB in bf16. The 128256-entry vocabulary matters: its LM head is a
  fifth of the weights a decode step reads, which a 32000 vocab would understate.
- `llama-8b`: Llama 3.1 8B's shape (hidden 4096, 32 layers, 32 query heads, 8 KV heads
  of dim 128, MLP 14336, vocab 128256, an untied LM head, llama3 rope with factor 8):
  8.03 B parameters, 16 GB in bf16, written in shards of at most SHARD_BYTES.
- `tiny`: the same architecture at toy size, for CPU dry runs and tests; `tiny-untied`
  its untied-head twin, standing in for `llama-8b` there.

The values are drawn in the checkpoint's dtype on the chosen device, one tensor at a
time, and each shard is written and dropped before the next is drawn: no float32 copy
of the weights exists anywhere, and the host holds one shard at most.
"""

from __future__ import annotations

import json
import math
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
    "llama-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
    ),
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    ),
}
PRESETS["tiny-untied"] = {**PRESETS["tiny"], "tie_word_embeddings": False,
                          "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 256}}
INIT_STD = 0.02  # Llama's initializer_range: activations stay in bf16's comfortable range.
SHARD_BYTES = 4 * 2**30  # Per safetensors file: HF's own default is 5 GB.


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


def random_weights(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, gen: torch.Generator
                   ) -> dict[str, torch.Tensor]:
    """N(0, 0.02) for every matrix, ones for the RMSNorm gains (random gains would scale
    the residual stream layer after layer), drawn in `dtype` on the generator's device (a
    GPU fills a billion values in milliseconds) and returned on the CPU for saving."""
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=dtype)
        else:
            tensors[name] = torch.randn(shape, generator=gen, device=gen.device, dtype=dtype).mul_(INIT_STD).cpu()
    return tensors


def shard_names(shapes: dict[str, tuple[int, ...]], element_size: int, shard_bytes: int = SHARD_BYTES
                ) -> list[list[str]]:
    """The tensor names in checkpoint order, cut into shards of at most `shard_bytes` (a
    tensor larger than that is a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * element_size
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _shard_file(index: int, count: int) -> str:
    """HF's names: model.safetensors alone, else model-00001-of-0000N.safetensors."""
    return "model.safetensors" if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_tokenizer(out: Path, vocab_size: int, bos_token_id: int, eos_token_id: int) -> None:
    """tokenizer.json and tokenizer_config.json of a word-level tokenizer with one word per
    id (`<t17>` is id 17): ids decode to text and back, which is all a router needs here."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    word = "<t{}>".format
    tokenizer = Tokenizer(models.WordLevel({word(i): i for i in range(vocab_size)}, unk_token=word(0)))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=word(bos_token_id), eos_token=word(eos_token_id),
                            unk_token=word(0)).save_pretrained(out)


def make_random_model(out_dir: str | Path, preset: str = "llama-1b", dtype: torch.dtype = torch.bfloat16,
                      device: str | torch.device = "cpu", seed: int = 0, shard_bytes: int = SHARD_BYTES) -> dict:
    """Writes the checkpoint, one shard at a time (with HF's index file when there are
    several); returns what it made (parameters, bytes, shape, files)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # NOTE: `architectures` is what a loader (ours, HF's Auto classes) picks the class by.
    config = LlamaConfig(**PRESETS[preset], dtype=dtype, architectures=["LlamaForCausalLM"])
    shapes = parameter_shapes(config)
    element_size = torch.empty((), dtype=dtype).element_size()
    shards = shard_names(shapes, element_size, shard_bytes)
    gen = torch.Generator(device=torch.device(device)).manual_seed(seed)
    weight_map = {}
    for index, names in enumerate(shards):
        file = _shard_file(index, len(shards))
        save_file(random_weights({n: shapes[n] for n in names}, dtype, gen), str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    parameters = sum(math.prod(shape) for shape in shapes.values())
    if len(shards) > 1:
        index_file = {"metadata": {"total_size": parameters * element_size}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=2))
    config.save_pretrained(out)
    write_tokenizer(out, config.vocab_size, config.bos_token_id, config.eos_token_id)
    made = {"preset": preset, "dir": str(out), "dtype": str(dtype).removeprefix("torch."),
            "parameters": parameters, "bytes": parameters * element_size, "files": len(shards),
            "shape": {k: v for k, v in PRESETS[preset].items() if k != "rope_parameters"}}
    (out / "random-model.json").write_text(json.dumps(made, indent=2))
    return made


def bench_make_model(args) -> int:
    from llmserve.worker.device import DTYPE_NAMES, resolve_device

    made = make_random_model(args.out, args.preset, DTYPE_NAMES[args.dtype], resolve_device(args.device), args.seed,
                             args.shard_bytes)
    print(f"random {args.preset} model: {made['parameters'] / 1e6:,.1f} M parameters, {made['dtype']}, "
          f"{made['bytes'] / 2**20:,.1f} MiB in {made['files']} file(s) in {made['dir']}", flush=True)
    return 0
