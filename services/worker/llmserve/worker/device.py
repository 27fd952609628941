"""Where a worker rank computes, and in which dtype.

`--device auto` is CUDA when this process sees a GPU, else the CPU. A rank of a parallel
group takes `cuda:{local_rank}`: LOCAL_RANK when a launcher (torchrun, Kubernetes) sets
it, else its global rank modulo the GPUs this host shows.

`--dtype auto` is the model's own `torch_dtype` on CUDA (float16 or bfloat16, as trained);
on the CPU, a bfloat16 checkpoint's own bfloat16 where this CPU multiplies it fast
(cpu_dtype.py: its instruction sets, and a measurement), float32 otherwise (float16
matmuls are unusably slow there); bfloat16 on the CPU with `--quantization int8`: torch's
weight-only int8 kernel vectorizes bfloat16 activations only (float32 ones fall back to a
dequantized product, slower than float32 itself). A checkpoint stored quantized (a
GGUF's Q4_1, Q8_0, ...) has no float dtype to keep: on the CPU the fastest of int8 W8A8,
bfloat16 and float32 here (cpu_dtype.py; its int8 choice sets the quantization too), on
CUDA bfloat16 where the GPU has it. `dtype_choice` says which, and why.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from llmserve.worker.cpu_dtype import DtypeChoice, choose_cpu_dtype, choose_cpu_for_quantized

DEVICES = ("auto", "cpu", "cuda")
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def local_rank(rank: int) -> int:
    """This rank's GPU index on its host."""
    env = os.environ.get("LOCAL_RANK")
    if env is not None:
        return int(env)
    return rank % max(1, torch.cuda.device_count())


def resolve_device(name: str, rank: int = 0) -> torch.device:
    """The torch device for `--device NAME` on global rank `rank`; makes it current on CUDA."""
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r} (choices: {', '.join(DEVICES)})")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda: this process sees no CUDA device (torch.cuda.is_available() is False; "
                         f"torch {torch.__version__}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    index = local_rank(rank)
    if index >= torch.cuda.device_count():
        raise ValueError(f"rank {rank} wants cuda:{index} but this host shows {torch.cuda.device_count()} GPU(s)")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def model_dtype(config: Any) -> torch.dtype:
    """The checkpoint's own dtype (config.json's `torch_dtype` / `dtype`), float32 if unsaid."""
    # NOTE: transformers 5 names it `dtype` (reading `torch_dtype` warns); older configs `torch_dtype`.
    value = getattr(config, "dtype", None) if hasattr(config, "dtype") else None
    value = value or getattr(config, "torch_dtype", None)
    if isinstance(value, torch.dtype):
        return value if value in DTYPE_NAMES.values() else torch.float32
    return DTYPE_NAMES.get(str(value).removeprefix("torch."), torch.float32)


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """A dtype by name (float32, bfloat16, float16 and their short forms) or as is."""
    if isinstance(name, torch.dtype):
        if name in DTYPE_NAMES.values():
            return name
    elif DTYPE_ALIASES.get(name, name) in DTYPE_NAMES:
        return DTYPE_NAMES[DTYPE_ALIASES.get(name, name)]
    raise ValueError(f"unsupported dtype {name!r}; use auto, {', '.join(DTYPE_NAMES)}")


def _quantized_on_cuda(weight_type: str) -> DtypeChoice:
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return DtypeChoice(dtype, f"{weight_type} checkpoint, dequantized to {dtype_name(dtype)} on CUDA")


def dtype_choice(name: str | torch.dtype, device: torch.device, config: Any = None,
                 quantization: str = "none", quantized_weights: str | None = None) -> DtypeChoice:
    """The dtype weights (but int8 ones), activations and the KV cache take on `device`, and
    why. `quantized_weights`: the type a checkpoint's matrices are stored in when they are
    quantized blocks (gguf_checkpoint.quantized_weight_type), else None."""
    if name == "auto" and quantized_weights and device.type == "cuda":
        choice = _quantized_on_cuda(quantized_weights)
    elif name == "auto" and device.type == "cuda":
        dtype = model_dtype(config)
        choice = DtypeChoice(dtype, f"the checkpoint's own dtype ({dtype_name(dtype)}) on CUDA")
    elif name == "auto" and quantization in ("int8", "int8-weight-only"):
        choice = DtypeChoice(torch.bfloat16, "int8 weights: bfloat16 activations (torch's weight-only int8 kernel "
                                             "vectorizes bfloat16 only; under W8A8 the rest of the step runs bfloat16)")
    elif name == "auto" and quantized_weights:
        choice = choose_cpu_for_quantized(quantized_weights)
    elif name == "auto":
        choice = choose_cpu_dtype(model_dtype(config))
    else:
        choice = DtypeChoice(dtype_from_name(name), "--dtype")
    if choice.dtype == torch.float16 and device.type != "cuda":
        raise ValueError("float16 runs on CUDA only (CPU matmuls in float16 are unusably slow): "
                         "use --dtype bfloat16 or float32 on the CPU")
    return choice


def resolve_dtype(name: str | torch.dtype, device: torch.device, config: Any = None,
                  quantization: str = "none", quantized_weights: str | None = None) -> torch.dtype:
    """The dtype weights (but int8 ones), activations and the KV cache take on `device`."""
    return dtype_choice(name, device, config, quantization, quantized_weights).dtype


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, d in DTYPE_NAMES.items() if d == dtype)


def to_device_async(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor (a column of settings, indices, lengths) on `device`. NOTE: on CUDA
    staged in pinned memory and copied without blocking: a blocking copy, or one from
    pageable memory, waits for the stream (a host sync every step). The caching host
    allocator keeps the pinned block until the copy is done."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
