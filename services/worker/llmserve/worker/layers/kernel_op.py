"""One place that decides, per call, which implementation of a layer runs.

A layer with kernels defines `forward_native` (plain torch, any device: the reference),
`forward_cpu` (a fused C++ kernel from llmserve.kernels.cpu) and/or `forward_cuda` (a
Triton kernel from llmserve.kernels.triton); `KernelOp.forward` picks by the input's
device. Layers say only what is particular to them: `fits` (a dtype or shape their
kernels need), or `uses_fused_cpu_kernel = False` / `uses_cuda_kernel = False` where a
subclass's math differs from the kernel's.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.kernels import cpu as cpu_kernels


def fused_cpu_applies(x: torch.Tensor) -> bool:
    """The fused CPU kernels take a 2-D activation with unit last stride, on the CPU, in a
    dtype they handle, once they are built."""
    return x.dim() == 2 and x.stride(-1) == 1 and cpu_kernels.usable_for(x)


def cuda_kernel_applies(x: torch.Tensor) -> bool:
    """The Triton kernels take a 2-D activation with unit last stride on a CUDA device."""
    return x.is_cuda and x.dim() == 2 and x.stride(-1) == 1


class KernelOp(nn.Module):
    uses_fused_cpu_kernel = True
    uses_cuda_kernel = True

    def forward(self, x: torch.Tensor, *args):
        # NOTE: the CPU test first: ~90 calls a decode step, where the CUDA test is
        # always False on a CPU host (and a CPU tensor never passes both).
        if self.uses_fused_cpu_kernel and fused_cpu_applies(x) and self.fits(x):
            return self.forward_cpu(x, *args)
        if self.uses_cuda_kernel and cuda_kernel_applies(x) and self.fits(x):
            return self.forward_cuda(x, *args)
        return self.forward_native(x, *args)

    def fits(self, x: torch.Tensor) -> bool:
        return True

    def forward_native(self, x: torch.Tensor, *args):
        raise NotImplementedError

    def forward_cpu(self, x: torch.Tensor, *args):
        return self.forward_native(x, *args)

    def forward_cuda(self, x: torch.Tensor, *args):
        return self.forward_native(x, *args)
