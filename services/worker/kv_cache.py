"""KV cache sizing and allocation.

One layer's cache: [2, num_blocks, block_size, num_kv_heads, head_dim] (K and V).
bytes_per_block counts all layers: a block id addresses the same slot range in every layer.
"""

from __future__ import annotations

from pathlib import Path

import torch

DEFAULT_MEMORY_FRACTION = 0.1


def bytes_per_block(block_size: int, num_kv_heads: int, head_dim: int, num_layers: int, dtype: torch.dtype) -> int:
    dtype_bytes = torch.empty(0, dtype=dtype).element_size()
    return 2 * block_size * num_kv_heads * head_dim * num_layers * dtype_bytes


def mem_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"no MemAvailable in {meminfo}")


def default_kv_cache_bytes(fraction: float = DEFAULT_MEMORY_FRACTION) -> int:
    """CPU default: a fraction of the memory available now."""
    return int(mem_available_bytes() * fraction)


def num_blocks_for_budget(budget_bytes: int, block_bytes: int) -> int:
    n = budget_bytes // block_bytes
    if n < 1:
        raise ValueError(f"KV cache budget {budget_bytes} B is smaller than one block ({block_bytes} B)")
    return n


def allocate_kv_caches(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
