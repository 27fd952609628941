"""Activations on fused projections, looked up by the config's `hidden_act`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.kernels import cpu as cpu_kernels
from llmserve.worker.layers.kernel_op import KernelOp


class SiluAndMul(KernelOp):
    """x: [T, 2*d] laid out [gate | up] -> silu(gate) * up: [T, d]. On CUDA the torch
    path (two element-wise kernels; in a CUDA graph their launches cost nothing)."""

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.silu_and_mul(x)  # one pass instead of silu + mul

    @staticmethod
    def forward_native(x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class GeluTanhAndMul(nn.Module):
    """GeGLU with the tanh approximation (Gemma): x [T, 2*d] -> gelu(gate) * up: [T, d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


GATED_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "silu": SiluAndMul,
    "gelu_pytorch_tanh": GeluTanhAndMul,
}


def gated_activation(name: str) -> nn.Module:
    if name not in GATED_ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {name!r} (supported: {', '.join(GATED_ACTIVATIONS)})")
    return GATED_ACTIVATIONS[name]()
