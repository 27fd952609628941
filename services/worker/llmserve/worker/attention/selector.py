"""Attention backend choice: a registry, "auto" = Triton on CUDA, torch elsewhere."""

from __future__ import annotations

import importlib
import os

import torch
from torch import nn

from llmserve.worker.attention.backend import AttentionBackend

# name -> (module, class); imported on first use so the torch path never imports triton
BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("llmserve.worker.attention.torch_paged", "TorchPagedAttention"),
    "triton": ("llmserve.worker.attention.triton_backend", "TritonPagedAttention"),
}
BACKEND_CHOICES = ("auto", *BACKENDS)


def resolve_backend_name(name: str, device: torch.device | str) -> str:
    if name not in BACKEND_CHOICES:
        raise ValueError(f"unknown attention backend {name!r} (choices: {', '.join(BACKEND_CHOICES)})")
    if name == "auto":
        return "triton" if torch.device(device).type == "cuda" else "torch"
    return name


def backend_class(name: str, device: torch.device | str) -> type[AttentionBackend]:
    """The backend class for `name` on `device`. Triton off CUDA only runs under Triton's
    interpreter (TRITON_INTERPRET=1 set before triton is imported: tests do this)."""
    resolved = resolve_backend_name(name, device)
    if resolved == "triton" and torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"attention backend 'triton' needs a CUDA device (got {device}); "
                         "on CPU it runs only under TRITON_INTERPRET=1")
    module, cls = BACKENDS[resolved]
    return getattr(importlib.import_module(module), cls)


def install_backend(model: nn.Module, cls: type[AttentionBackend]) -> int:
    """Swap every attention backend object held by the model's layers (the model files
    build the torch one) for `cls` with the same heads, scale, window and soft-cap.
    Returns how many."""
    n = 0
    for module in model.modules():
        for attr, value in list(vars(module).items()):
            if isinstance(value, AttentionBackend):
                if type(value) is not cls:
                    setattr(module, attr, cls(value.num_heads, value.head_dim, value.num_kv_heads, value.scale,
                                              value.sliding_window, value.softcap))
                n += 1
    return n
