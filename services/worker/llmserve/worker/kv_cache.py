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
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    zeroed: bool = True,
) -> list[torch.Tensor]:
    """One [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer (zeroed, or
    left uninitialized: a swap pool is only read where it was written, and untouched pages
    cost no memory)."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    make = torch.zeros if zeroed else torch.empty
    return [make(shape, dtype=dtype) for _ in range(num_layers)]


def move_blocks(src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor], moves: list[tuple[int, int]]) -> None:
    """Copy whole blocks (K and V, every layer): dst[:, dst_id] = src[:, src_id] for each move.

    src_caches / dst_caches: one [2, num_blocks, block_size, kv_heads, head_dim] tensor per
    layer (GPU and CPU pools for swaps; the same list for copy-on-write copies)."""
    if not moves:
        return
    src_ids = torch.tensor([s for s, _ in moves], dtype=torch.long)
    dst_ids = torch.tensor([d for _, d in moves], dtype=torch.long)
    for src, dst in zip(src_caches, dst_caches):
        dst[:, dst_ids.to(dst.device)] = src[:, src_ids.to(src.device)].to(dst.device)


def check_moves(moves: list[tuple[int, int]], num_src: int, num_dst: int, what: str) -> None:
    for src, dst in moves:
        if not (0 <= src < num_src and 0 <= dst < num_dst):
            raise ValueError(f"{what} {src} -> {dst} is outside 0..{num_src - 1} -> 0..{num_dst - 1}")


class PeakMemory:
    """Peak memory a block of code adds: torch.cuda's peak statistics on a GPU; on CPU the
    process's peak resident set (VmHWM), reset first through /proc/self/clear_refs."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak_bytes = 0

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            try:
                Path("/proc/self/clear_refs").write_text("5")  # Resets VmHWM to the current RSS.
            except OSError:
                pass
            self._base = _proc_status_bytes("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._base
        else:
            self.peak_bytes = max(0, _proc_status_bytes("VmHWM") - self._base)


def _proc_status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0
