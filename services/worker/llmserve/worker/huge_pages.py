"""The CPU worker's large long-lived tensors (the KV cache, packed weights) on transparent
huge pages (2 MiB) where Linux offers them.

Why: a CPU decode step reads every weight and its rows' K/V once, from memory. On 4 KiB
pages that is a TLB miss, and a page walk, every 4 KiB: the layouts' blocks (6 KiB of
K/V a block of SmolLM2's cache, scattered) are each a page or two. Measured on the
2-core Intel Xeon (AMX host), in one process taking turns with the same engine on 4 KiB
pages (ABBA), SmolLM2-135M bfloat16 decode steps were 1.08x faster at batch 1, 1.09x at
16, W8A8 int8 1.05x at 8 (the harness read 1.01-1.02x with both engines alike).

How: an anonymous private mapping (zero-filled by the kernel), madvise(MADV_HUGEPAGE)
before any page is touched, viewed as a tensor (torch.frombuffer keeps the mapping alive
while the tensor lives). NOTE: not torch's THP_MEM_ALLOC_ENABLE, which puts every large
allocation on huge pages: a step's transient activations and logits then fault in fresh
2 MiB pages (zeroed, compacted for) every step, and whole steps ran slower here.

Only where it helps and is safe: CPU tensors of at least one huge page, strided and
contiguous (not torch's opaque oneDNN and MKL packed weights: float32 products keep 4 KiB
pages), on Linux with MADV_HUGEPAGE; elsewhere the tensor is left as it is. Under THP
"never" the advice is ignored: plain pages. LLMSERVE_CPU_HUGE_PAGES=0 turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os

import torch

logger = logging.getLogger(__name__)

ENV = "LLMSERVE_CPU_HUGE_PAGES"
HUGE_PAGE_BYTES = 2 << 20


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor, on huge pages when it is large enough and they are enabled (its
    pages come in as it is first written)."""
    mapped = _mapped(math.prod(shape) * torch.empty(0, dtype=dtype).element_size())
    if mapped is None:
        return torch.zeros(shape, dtype=dtype)
    return mapped.view(dtype).view(shape)


def moved(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values in a tensor on huge pages (a copy), or `t` itself where they do not
    apply (see the module doc)."""
    if t.device.type != "cpu" or t.layout != torch.strided or not t.is_contiguous():
        return t
    mapped = _mapped(t.numel() * t.element_size())
    if mapped is None:
        return t
    return mapped.view(t.dtype).view(t.shape).copy_(t)


def _mapped(nbytes: int) -> torch.Tensor | None:
    """[nbytes] uint8 from a 2 MiB boundary of a fresh huge-page-advised mapping; None
    when huge pages are off, nbytes is under one, or the kernel refused. NOTE: one huge
    page more is mapped than needed (never touched, so never backed): kernels before 6.7
    may place an anonymous mapping at any 4 KiB boundary, and only whole aligned 2 MiB
    ranges of it can be huge pages."""
    if not enabled() or nbytes < HUGE_PAGE_BYTES:
        return None
    size = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES + HUGE_PAGE_BYTES
    try:
        region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError as err:  # (a kernel without THP refuses the advice)
        logger.debug("no huge pages for %d bytes: %s", nbytes, err)
        return None
    offset = -ctypes.addressof(ctypes.c_char.from_buffer(region)) % HUGE_PAGE_BYTES
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset)
