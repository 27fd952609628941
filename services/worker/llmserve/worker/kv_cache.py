"""KV cache sizing and allocation.

One layer's cache: [2, num_blocks, block_size, num_kv_heads, head_dim] (K and V).
bytes_per_block counts all layers: a block id addresses the same slot range in every layer.
"""

from __future__ import annotations

from pathlib import Path

import torch

from llmserve.worker import huge_pages

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
    zeroed: bool = True, device: torch.device | str = "cpu", pin_memory: bool = False,
) -> list[torch.Tensor]:
    """One [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer on `device`
    (zeroed, on huge pages on a CPU: huge_pages.py; or left uninitialized: a swap pool is
    only read where it was written, and an untouched pageable host page costs no memory).
    `pin_memory`: page-locked host memory, which a GPU copies to and from asynchronously
    (the swap pool of a CUDA worker); it is locked whole at allocation, so --swap-space is
    resident on every CUDA rank."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    if pin_memory:
        return [torch.empty(shape, dtype=dtype, pin_memory=True) for _ in range(num_layers)]
    if zeroed and torch.device(device).type == "cpu":  # (the swap pool stays sparse: plain pages)
        return [huge_pages.zeros(shape, dtype) for _ in range(num_layers)]
    make = torch.zeros if zeroed else torch.empty
    return [make(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def move_blocks(src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor], moves: list[tuple[int, int]]) -> None:
    """Copy whole blocks (K and V, every layer): dst[:, dst_id] = src[:, src_id] for each move,
    every source read before any destination is written.

    src_caches / dst_caches: one [2, num_blocks, block_size, kv_heads, head_dim] tensor per
    layer (the device cache and the swap pool for swaps; the same list for copy-on-write
    copies). One gather and one scatter per layer, on the caches' own devices."""
    if not moves:
        return
    src_ids = torch.tensor([s for s, _ in moves], dtype=torch.long).to(src_caches[0].device, non_blocking=True)
    dst_ids = torch.tensor([d for _, d in moves], dtype=torch.long).to(dst_caches[0].device, non_blocking=True)
    for src, dst in zip(src_caches, dst_caches, strict=True):
        dst.index_copy_(1, dst_ids, src.index_select(1, src_ids).to(dst.device))


def contiguous_runs(moves: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs of consecutive moves: (3,7),(4,8),(5,9) is one run
    of 3, so a swap of a long sequence's blocks is a few large copies, not many small ones."""
    runs: list[list[int]] = []
    for src, dst in moves:
        if runs and src == runs[-1][0] + runs[-1][2] and dst == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([src, dst, 1])
    return [tuple(r) for r in runs]


class BlockMover:
    """A step plan's block moves, before its forward: swap-outs (device cache -> host pool),
    swap-ins (host pool -> device cache), then copy-on-write copies (device -> device).

    On the CPU every move is a gather and a scatter (`move_blocks`). On CUDA the swaps are
    asynchronous copies between the device cache and the pinned host pool, issued on a side
    stream so the host never waits for them: the side stream first waits for the compute
    stream (the blocks' last writes), and the compute stream then waits for the side stream
    (the next forward may overwrite a block just swapped out, or read one just swapped in).
    Swaps stay ordered among themselves on that one stream, so a pool block swapped out is
    complete before a later swap-in reads it."""

    def __init__(self, device_caches: list[torch.Tensor], host_caches: list[torch.Tensor]):
        self.device_caches, self.host_caches = device_caches, host_caches
        device = device_caches[0].device if device_caches else torch.device("cpu")
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def run(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]],
            copies: list[tuple[int, int]]) -> None:
        if self.stream is None:
            move_blocks(self.device_caches, self.host_caches, swap_out)
            move_blocks(self.host_caches, self.device_caches, swap_in)
        elif swap_out or swap_in:
            compute = torch.cuda.current_stream(self.stream.device)
            self.stream.wait_stream(compute)
            with torch.cuda.stream(self.stream):
                self._copy_runs(self.device_caches, self.host_caches, swap_out)
                self._copy_runs(self.host_caches, self.device_caches, swap_in)
            compute.wait_stream(self.stream)
        move_blocks(self.device_caches, self.device_caches, copies)

    @staticmethod
    def _copy_runs(src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor],
                   moves: list[tuple[int, int]]) -> None:
        # NOTE: per layer and per K/V, a run of blocks is one contiguous range on both sides:
        # cache[kv, start:start + n] is [n, block_size, kv_heads, head_dim], contiguous.
        for src_start, dst_start, n in contiguous_runs(moves):
            for src, dst in zip(src_caches, dst_caches, strict=True):
                for kv in range(2):
                    dst[kv, dst_start:dst_start + n].copy_(src[kv, src_start:src_start + n], non_blocking=True)


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
