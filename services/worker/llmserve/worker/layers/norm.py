"""RMSNorm, with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from llmserve.kernels import cpu as cpu_kernels
from llmserve.worker.layers.kernel_op import KernelOp


class RMSNorm(KernelOp):
    """Without residual: norm(x). With residual: s = x + residual; returns (norm(s), s).
    On CPU (C++) and CUDA (Triton) one fused pass does it (and may overwrite x and
    residual)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]; statistics in float32, result cast back before the weight.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return super().forward(x, residual)

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.weight.dtype

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return cpu_kernels.rms_norm(x, self.weight, self.eps)
        return cpu_kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def forward_cuda(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from llmserve.kernels.triton import rms_norm

        out = rms_norm(x, self.weight, self.eps, residual)  # residual <- x + residual, in place
        return out if residual is None else (out, residual)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The plain torch path (any device); the reference for the fused kernels."""
        if residual is None:
            return self._norm(x)
        s = x + residual
        return self._norm(s), s


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), all in float32, cast back at
    the end (the checkpoint stores w around 0, not around 1). The fused kernels compute
    w * x, so this norm always takes the torch path."""

    uses_fused_cpu_kernel = False
    uses_cuda_kernel = False

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        self.weight.data.zero_()

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a width split across the TP ranks (OLMoE's q/k norms span the whole
    q and k projection, not one head): each rank holds `local_width` columns of x and of
    the weight; the mean square is the group's all-reduced sum of squares over the full
    width. `replicas` ranks hold the same columns (KV heads replicated when fewer than
    ranks): their copies are counted once. x [T, local_width] -> [T, local_width]."""

    def __init__(self, full_width: int, local_width: int, eps: float, tp, shard: int = 0, replicas: int = 1):
        super().__init__()
        self.full_width, self.eps, self.tp, self.shard, self.replicas = full_width, eps, tp, shard, replicas
        self.weight = nn.Parameter(torch.ones(local_width), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = param.shape[0]
        if loaded.shape != (self.full_width,):
            raise ValueError(f"ShardedRMSNorm: checkpoint {tuple(loaded.shape)} != ({self.full_width},)")
        param.data.copy_(loaded.narrow(0, self.shard * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        sum_sq = xf.pow(2).sum(-1, keepdim=True)  # [T, 1] this rank's columns
        if self.tp.size > 1:
            sum_sq = self.tp.all_reduce(sum_sq) / self.replicas
        xf = xf * torch.rsqrt(sum_sq / self.full_width + self.eps)
        return self.weight * xf.to(x.dtype)
