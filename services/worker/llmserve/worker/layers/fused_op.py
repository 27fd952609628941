"""One place that decides between a layer's plain torch path and its fused CPU kernel.

A layer with a C++ kernel (llmserve.kernels.cpu) defines `forward_native` (plain torch,
any device: the reference) and `forward_cpu` (one fused pass); `FusedCpuOp.forward`
picks per call. Layers say only what is particular to them: `fits` (a dtype their
kernel needs), or `uses_fused_cpu_kernel = False` where a subclass's math differs.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.kernels import cpu as cpu_kernels


def fused_cpu_applies(x: torch.Tensor) -> bool:
    """The fused CPU kernels take a 2-D activation with unit last stride, on the CPU, in a
    dtype they handle, once they are built."""
    return x.dim() == 2 and x.stride(-1) == 1 and cpu_kernels.usable_for(x)


class FusedCpuOp(nn.Module):
    uses_fused_cpu_kernel = True

    def forward(self, x: torch.Tensor, *args):
        if self.uses_fused_cpu_kernel and fused_cpu_applies(x) and self.fits(x):
            return self.forward_cpu(x, *args)
        return self.forward_native(x, *args)

    def fits(self, x: torch.Tensor) -> bool:
        return True

    def forward_native(self, x: torch.Tensor, *args):
        raise NotImplementedError

    def forward_cpu(self, x: torch.Tensor, *args):
        raise NotImplementedError
