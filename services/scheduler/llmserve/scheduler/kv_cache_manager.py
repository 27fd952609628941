"""Per-sample block tables on top of the block pools: prefix caching, copy-on-write
sharing between the samples of one request, and swapping to a CPU pool. The tables
live on the Sample records (`block_table`, `cpu_table`); only this manager changes them.

How tokens map to blocks and slots (block_size = 4, a sequence with 10 tokens):

    token index:   0  1  2  3 | 4  5  6  7 | 8  9  .  .
    logical block:      0     |     1      |     2
    block table:  [    7      ,     2      ,     5     ]   <- physical block ids
    slot of token i = block_table[i // block_size] * block_size + i % block_size
      token 9 -> block_table[2] * 4 + 1 = 5 * 4 + 1 = 21

A sequence holding T tokens of KV needs ceil(T / block_size) blocks; only its last block
may be partly empty. Physical blocks need not be contiguous or in order.

Sharing (n > 1): the samples of a request hold the same prompt blocks (ref count n).

    sample 0: [ 7 , 2 ]        7 = full block, shared by both; 2 = partial, shared
    sample 1: [ 7 , 2 ]        sample 0 writes token 5 into block 2 -> copy-on-write:
                               block 2 is copied to a fresh block 9, and sample 0 -> [7, 9]
                               The last holder of 2 (sample 1) then writes in place.

Sliding windows (every layer attends to the last W tokens only, `sliding_window`): a
block wholly before the next query's window is released as the sequence grows, its
table entry becoming RELEASED (the worker's copy keeps the old id, which no kernel reads
again), so a sequence holds about ceil(W / block_size) + 1 blocks however long it gets:

    W = 6, block_size = 4, 13 tokens computed: the next query (position 13) sees 8..13
    table: [ RELEASED , RELEASED , 5 , 3 ]      blocks 0 and 1 (tokens 0..7) released

Prefix caching lives in prefix_cache.py, the CPU swap space in swap_space.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from llmserve.contract.arith import cdiv
from llmserve.scheduler.block_pool import RELEASED, BlockPool, held_blocks
from llmserve.scheduler.prefix_cache import PrefixCache
from llmserve.scheduler.request import Sample
from llmserve.scheduler.swap_space import SwapSpace

__all__ = ["RELEASED", "BlockOps", "KVCacheManager"]


@dataclass
class BlockOps:
    """Block moves a worker performs before a step's forward, in this order."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, gpu block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src gpu block, dst gpu block)


class KVCacheManager:
    """Owns every sample's block tables; the only caller of the block pools."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = False,
        sliding_window: int = 0,
        prefill_chunk: int = 0,
    ) -> None:
        """A cache of `num_blocks` blocks of `block_size` tokens, plus an optional CPU pool.
        sliding_window W > 0: every layer attends to the last W tokens only, and blocks
        that left the window are released (0: every token stays). prefill_chunk: the
        most tokens one step computes for a sequence (0: a whole prompt at once)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0, got {sliding_window}")
        self.block_size = block_size
        self.sliding_window, self.prefill_chunk = sliding_window, prefill_chunk
        # Block events only with prefix caching: without it no hash is ever stored.
        self.pool = BlockPool(num_blocks, record_events=enable_prefix_caching)
        self.prefix = PrefixCache(self.pool, block_size, enable_prefix_caching)  # Lookups, offers.
        self.swap = SwapSpace(self.pool, num_cpu_blocks)
        # Samples holding a GPU table (an ordered set): for tables() and cache resets.
        self._on_gpu: dict[Sample, None] = {}
        self._ops = BlockOps()
        self.num_cow_copies = 0

    # ---- sizes ----

    @property
    def cpu_pool(self) -> BlockPool | None:
        return self.swap.pool

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.cpu_pool.num_blocks if self.cpu_pool else 0

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu_pool.num_free_blocks if self.cpu_pool else 0

    @property
    def num_swapped_out_blocks(self) -> int:
        return self.swap.num_swapped_out_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 to 1.0."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold the KV of `num_tokens` tokens."""
        return cdiv(num_tokens, self.block_size)

    def too_small_for(self, num_blocks: int, what: str) -> str:
        """Why the whole cache cannot hold `num_blocks` blocks of KV for `what`, or ""."""
        if num_blocks <= self.num_total_blocks:
            return ""
        return (
            f"{what} need {num_blocks} KV cache blocks but the cache has only"
            f" {self.num_total_blocks} blocks of {self.block_size} tokens"
        )

    # ---- admission and growth ----

    def admit(self, sample: Sample, cached_blocks: list[int], num_new: int) -> list[int] | None:
        """Give a sample holding nothing the cached blocks plus room for `num_new` tokens
        after them. Sets num_computed_tokens to the cached tokens.

        Returns the new block ids, or None (nothing taken) when the pool is short.
        """
        if sample.block_table:
            raise RuntimeError(f"admit of {sample.label}, which holds blocks")
        num_cached_tokens = len(cached_blocks) * self.block_size
        num_new_blocks = self.num_blocks_for(num_cached_tokens + num_new) - len(cached_blocks)
        num_free_hits = sum(1 for b in cached_blocks if self.pool.ref_count(b) == 0)
        if num_new_blocks + num_free_hits > self.pool.num_free_blocks:
            return None
        self.pool.touch(cached_blocks)
        new_block_ids = self.pool.allocate(num_new_blocks)
        self._hold(sample, list(cached_blocks) + new_block_ids)
        sample.num_offered_blocks = len(cached_blocks)  # The hits are in the cache already.
        sample.num_computed_tokens = num_cached_tokens
        self.prefix.count_admission(sample, num_cached_tokens)
        return new_block_ids

    def blocks_needed(self, items: Sequence[tuple[Sample, int]], swapped: bool = False) -> int:
        """Blocks that allocate_slots would take for every (sample, new tokens) pair,
        copy-on-write included (the last writer of a shared block writes in place).
        With `swapped`, for samples still on the CPU, as if they were swapped in."""
        pool = self.cpu_pool if swapped else self.pool
        needed, writers = self._new_blocks_and_shared_writes(items, swapped)
        for block_id, num_writers in (writers or {}).items():
            needed += num_writers if pool.ref_count(block_id) > num_writers else num_writers - 1
        return needed

    def blocks_needed_unshared(self, items: Sequence[tuple[Sample, int]]) -> int | None:
        """blocks_needed(items), or None when an item's first write goes into a block it
        shares (a copy-on-write)."""
        needed, writers = self._new_blocks_and_shared_writes(items)
        return None if writers else needed

    def _new_blocks_and_shared_writes(self, items: Sequence[tuple[Sample, int]],
                                      swapped: bool = False) -> tuple[int, Counter[int] | None]:
        """The blocks the items' tables grow by, and how many items write first into each
        shared block (None when none does: the common case)."""
        pool = self.cpu_pool if swapped else self.pool
        needed = 0
        writers: Counter[int] | None = None  # NOTE: built only when a shared block is written (rare)
        bs = self.block_size
        for sample, num_new in items:
            table = sample.cpu_table if swapped else sample.block_table
            start = sample.num_computed_tokens
            needed += max(0, cdiv(start + num_new, bs) - len(table))
            if start % bs and pool.ref_count(table[start // bs]) > 1:
                writers = writers if writers is not None else Counter()
                writers[table[start // bs]] += 1
        return needed, writers

    def writes_in_place(self, sample: Sample) -> bool:
        """The sample's next token goes into a block it holds alone: one decode token
        takes no block and copies none (grow(sample, 1) would change nothing)."""
        start, table = sample.num_computed_tokens, sample.block_table
        index = start // self.block_size
        if index >= len(table):
            return False
        return start % self.block_size == 0 or self.pool.ref_count(table[index]) == 1

    def allocate_slots(self, sample: Sample, num_new_tokens: int) -> list[int] | None:
        """Grow the table so that num_computed_tokens + num_new_tokens fit; copy the block
        written first if it is shared (copy-on-write: recorded in the step's ops, and
        `take_replaced` then answers True for this sample).

        Returns the appended block ids (often empty: the last block has room), or None
        when the pool cannot supply them, in which case nothing changes.
        """
        if self.blocks_needed([(sample, num_new_tokens)]) > self.pool.num_free_blocks:
            return None
        return self.grow(sample, num_new_tokens)

    def grow(self, sample: Sample, num_new_tokens: int) -> list[int]:
        """allocate_slots once the caller has checked that the blocks are there
        (blocks_needed of these items and any allocated with them <= num_free_blocks)."""
        self._on_gpu[sample] = None
        table = sample.block_table
        start = sample.num_computed_tokens
        self._copy_on_write(sample, start)
        needed = cdiv(start + num_new_tokens, self.block_size) - len(table)
        if needed <= 0:  # NOTE: the common decode step: the last block has room
            return []
        new_block_ids = self.pool.allocate(needed)
        table.extend(new_block_ids)
        return new_block_ids

    def _copy_on_write(self, sample: Sample, first_position: int) -> None:
        """Give the sample a private copy of the block it writes first, if it shares it."""
        table, index = sample.block_table, first_position // self.block_size
        if first_position % self.block_size == 0 or self.pool.ref_count(table[index]) == 1:
            return
        (new_block,) = self.pool.allocate(1)
        self._ops.copies.append((table[index], new_block))
        self.pool.free([table[index]])
        table[index] = new_block
        sample.table_replaced = True
        self.num_cow_copies += 1

    def take_replaced(self, sample: Sample) -> bool:
        """True (once) if a copy-on-write replaced an entry of the sample's table."""
        replaced, sample.table_replaced = sample.table_replaced, False
        return replaced

    def fork(self, parent: Sample, children: Iterable[Sample]) -> None:
        """Give each child the parent's table (shared: one more holder per child) and
        prefix-cache progress, then release the parent's hold."""
        table = parent.block_table
        for child in children:
            self.pool.incref(held_blocks(table))
            self._hold(child, list(table))
            child.block_hashes = list(parent.block_hashes)
            child.num_offered_blocks = parent.num_offered_blocks
            child.num_released_blocks = parent.num_released_blocks
        self.free(parent)

    def blocks_to_run(self, samples: Sequence[Sample]) -> int:
        """The most blocks the samples need at once to go on running, a recompute from
        scratch included. Without a window, every token's KV (blocks_to_hold). With one,
        released blocks need not come back, but a recompute writes a whole prefill chunk
        before it can release anything: per sample, the blocks of its window and one
        chunk (its whole length without chunked prefill), shared blocks counted each time."""
        if not self.sliding_window:
            return self.blocks_to_hold(samples)
        span = lambda s: s.num_tokens if not self.prefill_chunk else min(  # noqa: E731
            s.num_tokens, self.prefill_chunk + self.sliding_window)
        return sum(self.num_blocks_for(span(s)) + 1 for s in samples)

    def blocks_to_hold_at_most(self, samples: Sequence[Sample]) -> int:
        """An upper bound of blocks_to_hold and blocks_to_run in O(samples), not
        O(blocks): shared blocks counted once per holder, a copy-on-write for every sample."""
        bs, total = self.block_size, 0
        for s in samples:  # NOTE: once per sampled token: a plain loop, no generator
            total += max(len(s.block_table or s.cpu_table), cdiv(s.num_tokens, bs)) + 1
        return total

    def blocks_to_hold(self, samples: Sequence[Sample]) -> int:
        """Blocks the samples need to hold all their tokens' KV, counting the blocks they
        share now once (and a copy-on-write for each shared block still to be written)."""
        held: set[int] = set()
        needed = 0
        for sample in samples:
            table = sample.block_table or sample.cpu_table
            pool = self.pool if sample in self._on_gpu else self.cpu_pool
            held.update(held_blocks(table))
            needed += max(0, self.num_blocks_for(sample.num_tokens) - len(table))
            start = sample.num_computed_tokens
            if start % self.block_size and pool.ref_count(table[start // self.block_size]) > 1:
                needed += 1
        return len(held) + needed

    def _hold(self, sample: Sample, table: list[int]) -> None:
        sample.block_table = table
        self._on_gpu[sample] = None

    # ---- swapping ----

    def can_swap_out(self, samples: Sequence[Sample]) -> bool:
        """True if the CPU pool can take every block the samples hold."""
        return self.swap.can_swap_out(samples)

    def swap_out(self, samples: Sequence[Sample]) -> None:
        """Move the samples' blocks to the CPU pool (shared blocks stay shared)."""
        for sample in samples:
            self._on_gpu.pop(sample, None)
        self._ops.swap_out.extend(self.swap.swap_out(samples))

    def num_swap_in_blocks(self, samples: Sequence[Sample]) -> int:
        """GPU blocks a swap-in of the samples takes."""
        return self.swap.num_swap_in_blocks(samples)

    def swap_in(self, samples: Sequence[Sample]) -> None:
        """Move the samples' blocks back from the CPU pool to fresh GPU blocks."""
        self._ops.swap_in.extend(self.swap.swap_in(samples))
        for sample in samples:
            self._on_gpu[sample] = None
            sample.num_offered_blocks = 0  # Offer the fresh blocks to the cache.

    @property
    def has_block_ops(self) -> bool:
        """Swaps or copies are recorded for the plan being built."""
        return bool(self._ops.swap_out or self._ops.swap_in or self._ops.copies)

    def take_block_ops(self) -> BlockOps:
        """The swaps and copies recorded since the last call (for this step's plan)."""
        ops, self._ops = self._ops, BlockOps()
        return ops

    # ---- release ----

    def free(self, sample: Sample) -> None:
        """Return all of the sample's blocks (GPU or CPU) to their pools and forget its
        prefix-cache progress.

        NOTE: the tail is freed first: the free queue is LRU, so a sequence's last
        blocks, the least likely to be shared, are evicted before its first ones.
        """
        self.pool.free(held_blocks(reversed(sample.block_table)))
        sample.block_table = []
        self._on_gpu.pop(sample, None)
        self.swap.free(sample)
        sample.block_hashes = []
        sample.num_offered_blocks = 0
        sample.num_released_blocks = 0
        sample.table_replaced = False

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (the KV content of some blocks is unknown)."""
        self.pool.reset_cache()
        for sample in self._on_gpu:
            sample.num_offered_blocks = len(sample.block_table)  # Never offer them again.
        for sample in self.swap.holders:
            sample.num_offered_blocks = 0

    # ---- introspection ----

    def get_block_ids(self, sample: Sample) -> list[int]:
        """A copy of the sample's GPU block table ([] if it holds none), for the worker:
        a RELEASED entry becomes block 0, a valid id that no kernel reads (it lies wholly
        before every query's window)."""
        return [0 if b == RELEASED else b for b in sample.block_table]

    def release_outside_window(self, sample: Sample) -> None:
        """Release the sample's blocks wholly before the window of its next query (at
        position num_computed_tokens, seeing keys from num_computed_tokens - W + 1 on).
        Nothing without a sliding window.

        NOTE: a block released while the plan that reads it last is still in flight is
        safe: another sample can only get it from a later schedule(), whose plan runs
        after that one."""
        if not self.sliding_window:
            return
        first_key = sample.num_computed_tokens - self.sliding_window + 1
        table = sample.block_table
        end = min(max(0, first_key) // self.block_size, len(table))
        start = sample.num_released_blocks
        if end <= start:
            return
        self.pool.free(held_blocks(table[start:end]))
        table[start:end] = [RELEASED] * (end - start)
        sample.num_released_blocks = end

    def tables(self) -> dict[str, list[int]]:
        """Every GPU block table, by sequence id (copies). For checks and tests."""
        return {s.seq_id: list(s.block_table) for s in self._on_gpu}

    def cpu_tables(self) -> dict[str, list[int]]:
        """Every CPU block table, by sequence id (copies). For checks and tests."""
        return {s.seq_id: list(s.cpu_table) for s in self.swap.holders}
