"""Load an HF checkpoint directory (config.json + *.safetensors, or the metadata directory
of a GGUF whose weights stay in the file) into our model classes."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors import safe_open
from torch import nn

from llmserve.gguf_checkpoint import gguf_weights
from llmserve.worker.device import dtype_from_name
from llmserve.worker.models.checkpoint import check_weights
from llmserve.worker.models.registry import model_class

# Checkpoint entries that are not weights of ours (recomputed buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_config(model_dir: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir))


@contextlib.contextmanager
def _building(dtype: torch.dtype, device: torch.device):
    """Parameters and buffers created inside are born on `device` in `dtype` (a GPU
    model never exists on the host first)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


def iter_safetensors(model_dir: Path, keep: Callable[[str], bool] | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every checkpoint tensor, read one at a time into host memory
    (the weight loaders copy each into its device parameter, so the host holds one
    tensor at a time); names `keep` rejects are never read (a pipeline stage reads only
    its own layers)."""
    for f in check_weights(Path(model_dir)):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                if keep is None or keep(name):
                    yield name, st.get_tensor(name)


def iter_checkpoint(model_dir: Path, config: Any, keep: Callable[[str], bool] | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every checkpoint tensor: from the directory's safetensors, or
    from the GGUF its weights live in (gguf_weights.py), one tensor at a time either way."""
    gguf = gguf_weights(Path(model_dir))
    if gguf is None:
        return iter_safetensors(model_dir, keep)
    from llmserve.worker.models.gguf_weights import iter_gguf

    check_weights(Path(model_dir))  # (a GGUF gone since its directory was written fails in a line)
    return iter_gguf(gguf, config, keep)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor {tuple(loaded.shape)} != parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


def load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Route each checkpoint tensor to its parameter's weight_loader; fused parameters
    (qkv_proj, gate_up_proj) receive one call per shard. Errors on missing/unexpected."""
    params = dict(model.named_parameters())
    local_name = getattr(model, "local_weight_name", lambda n: n)
    mapping: dict[str, tuple[str, Any]] = getattr(model, "packed_modules_mapping", {})
    # Optional: name -> (parameter name, shard id) ahead of `mapping`, or None (MoE experts).
    remap: Callable[[str], tuple[str, Any] | None] | None = getattr(model, "remap_weight_name", None)
    tied = getattr(model.config, "tie_word_embeddings", False)
    loaded: set[tuple[str, Any]] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for ckpt_name, tensor in weights:
            if ckpt_name.endswith(_IGNORED_SUFFIXES) or (tied and ckpt_name == "lm_head.weight"):
                continue
            name, shard_id = local_name(ckpt_name), None
            if name is None:  # held by another pipeline stage
                continue
            remapped = remap(name) if remap is not None else None  # (name, shard id): an expert weight
            if remapped is not None:
                name, shard_id = remapped
            else:
                for frag, (fused, sid) in mapping.items():
                    if f".{frag}." in name:
                        name, shard_id = name.replace(f".{frag}.", f".{fused}."), sid
                        break
            param = params.get(name)
            if param is None:
                unexpected.append(ckpt_name)
                continue
            getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard_id)
            loaded.add((name, shard_id))
    if unexpected:
        raise ValueError(f"unexpected weights in checkpoint: {unexpected[:10]}")
    missing = [n for n in params if n not in {name for name, _ in loaded}]
    shards = {fused: {sid for f2, sid in mapping.values() if f2 == fused} for fused, _ in mapping.values()}
    for name in params:
        for fused, need in shards.items():
            if f".{fused}." in name and name not in missing:
                have = {sid for n, sid in loaded if n == name}
                # shard id None: the checkpoint stored the tensor already fused (Phi-3's qkv_proj).
                if have != need and None not in have:
                    missing.append(f"{name} (shards {sorted(map(str, need - have))})")
    if missing:
        raise ValueError(f"weights missing from checkpoint: {missing[:10]}")
    for module in model.modules():
        hook = getattr(module, "process_weights_after_loading", None)
        if hook is not None:
            hook()


def load_model(model_dir: Path, dtype: str | torch.dtype = "float32", config: Any = None,
               parallel: Any = None, device: torch.device | str = "cpu", quantization: str = "none") -> nn.Module:
    """Build the registered class for config.json's architecture (this rank's shard when
    `parallel`, a ParallelState, says so) on `device` and load its weights (the linear
    projections quantized as they load with `quantization="int8"`)."""
    config = config if config is not None else load_config(model_dir)
    torch_dtype = dtype_from_name(dtype)
    cls = model_class(config)
    with _building(torch_dtype, torch.device(device)):
        model = cls(config, parallel, quantization=quantization)
    keep = getattr(model, "local_weight_name", None)
    load_weights(model, iter_checkpoint(model_dir, config, None if keep is None else (lambda n: keep(n) is not None)))
    return model.eval()
