"""A pool of fixed-size KV cache blocks with reference counts.

Blocks are plain ints 0..num_blocks-1; the tensors behind them live on the workers. The
pool only decides which ids are free. Free blocks wait in a queue with O(1) removal
(an insertion-ordered dict), so that a later prefix cache can pull a cached block back
out of the middle of the queue when it gets a hit.

Order is deterministic: at first blocks are handed out lowest id first; a freed block
goes to the back of the queue, so the blocks freed longest ago are reused first.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


class BlockPool:
    """Hands out block ids and tracks how many holders each block has."""

    def __init__(self, num_blocks: int) -> None:
        """Create a pool of `num_blocks` blocks, all free."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self._num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        # NOTE: a block is in the free queue if and only if its ref count is 0.
        self._free_queue: dict[int, None] = dict.fromkeys(range(num_blocks))

    @property
    def num_blocks(self) -> int:
        """Total number of blocks, free or not."""
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Number of blocks no one holds."""
        return len(self._free_queue)

    def ref_count(self, block_id: int) -> int:
        """How many holders `block_id` has (0 when free)."""
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks from the front of the free queue, each with ref count 1.

        Raises RuntimeError (allocating nothing) when fewer than `n` blocks are free.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free_queue):
            raise RuntimeError(
                f"out of KV cache blocks: asked for {n}, {len(self._free_queue)} free"
            )
        block_ids = []
        for _ in range(n):
            block_id = next(iter(self._free_queue))
            del self._free_queue[block_id]
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one holder to each block (sharing). The blocks must be allocated."""
        block_ids = list(block_ids)
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref_counts[block_id] == 0:
                raise RuntimeError(f"incref of free block {block_id}")
        for block_id in block_ids:
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one holder from each block; a block reaching 0 goes to the back of the queue.

        Blocks are released in the order given. Raises RuntimeError (changing nothing)
        if a block would be freed more times than it is held.
        """
        block_ids = list(block_ids)
        for block_id, times in Counter(block_ids).items():
            self._check_id(block_id)
            if times > self._ref_counts[block_id]:
                raise RuntimeError(
                    f"double free of block {block_id} "
                    f"(ref count {self._ref_counts[block_id]}, freed {times}x)"
                )
        for block_id in block_ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free_queue[block_id] = None

    def free_block_ids(self) -> list[int]:
        """The free queue, front (next handed out) first. For tests and debugging."""
        return list(self._free_queue)

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self._num_blocks:
            raise ValueError(f"block id {block_id} out of range 0..{self._num_blocks - 1}")
