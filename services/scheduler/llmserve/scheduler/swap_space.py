"""The CPU swap space: a second block pool that preempted samples' blocks wait in.

A swap moves whole tables, keeping sharing intact: blocks two samples share on the GPU
are copied once and shared on the CPU too (and the other way round).

    GPU tables:  s0 [ 7 , 2 ]    s1 [ 7 , 4 ]      swap_out(s0, s1)
    CPU tables:  s0 [ 0 , 1 ]    s1 [ 0 , 2 ]      moves: 7->0, 2->1, 4->2 (3 copies)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from llmserve.scheduler.block_pool import RELEASED, BlockPool, held_blocks
from llmserve.scheduler.request import Sample


class SwapSpace:
    """The CPU pool (None when there is none) and the samples holding CPU tables."""

    def __init__(self, gpu_pool: BlockPool, num_cpu_blocks: int) -> None:
        """A CPU pool of `num_cpu_blocks` blocks beside `gpu_pool` (none when 0)."""
        self.gpu_pool = gpu_pool
        self.pool = BlockPool(num_cpu_blocks) if num_cpu_blocks > 0 else None
        self.holders: dict[Sample, None] = {}  # Samples holding a CPU table (an ordered set).
        self.num_swapped_out_blocks = 0  # Lifetime count of blocks copied to the CPU.

    def can_swap_out(self, samples: Sequence[Sample]) -> bool:
        """True if the CPU pool can take every block the samples hold."""
        needed = len({b for s in samples for b in held_blocks(s.block_table)})
        return self.pool is not None and needed <= self.pool.num_free_blocks

    def num_swap_in_blocks(self, samples: Sequence[Sample]) -> int:
        """GPU blocks a swap-in of the samples takes (shared blocks once)."""
        return len({b for s in samples for b in held_blocks(s.cpu_table)})

    def swap_out(self, samples: Sequence[Sample]) -> list[tuple[int, int]]:
        """Move the samples' GPU tables to the CPU; returns the (gpu, cpu) block copies."""
        tables = [s.block_table for s in samples]
        for sample in samples:
            sample.block_table = []
        new_tables, mapping = _move(tables, self.gpu_pool, self.pool)
        for sample, table in zip(samples, new_tables):
            sample.cpu_table = table
            self.holders[sample] = None
        self.num_swapped_out_blocks += len(mapping)
        return list(mapping.items())

    def swap_in(self, samples: Sequence[Sample]) -> list[tuple[int, int]]:
        """Move the samples' CPU tables to fresh GPU blocks; returns the (cpu, gpu) copies."""
        tables = [s.cpu_table for s in samples]
        for sample in samples:
            sample.cpu_table = []
            self.holders.pop(sample, None)
        new_tables, mapping = _move(tables, self.pool, self.gpu_pool)
        for sample, table in zip(samples, new_tables):
            sample.block_table = table
        return list(mapping.items())

    def free(self, sample: Sample) -> None:
        """Return the sample's CPU blocks (if any), tail first."""
        if sample.cpu_table:
            self.pool.free(held_blocks(reversed(sample.cpu_table)))
        sample.cpu_table = []
        self.holders.pop(sample, None)


def _move(tables: list[list[int]], src_pool: BlockPool,
          dst_pool: BlockPool) -> tuple[list[list[int]], dict[int, int]]:
    """Copy the tables' blocks to `dst_pool`, each distinct block once, and release them
    in `src_pool`. Returns the new tables and the block mapping (src -> dst)."""
    unique = list(dict.fromkeys(b for table in tables for b in held_blocks(table)))
    mapping = dict(zip(unique, dst_pool.allocate(len(unique))))
    # A block held by k tables gets k holders in dst_pool too (allocate gave it one).
    holders = Counter(b for table in tables for b in held_blocks(table))
    dst_pool.incref(mapping[b] for b, times in holders.items() for _ in range(times - 1))
    for table in tables:
        src_pool.free(held_blocks(reversed(table)))
    # NOTE: a RELEASED entry stays one: a window left it behind on either side.
    return [[mapping.get(b, RELEASED) for b in table] for table in tables], mapping
