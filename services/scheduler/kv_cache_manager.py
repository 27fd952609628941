"""Per-request block tables on top of the block pool.

How tokens map to blocks and slots (block_size = 4, a request with 10 tokens):

    token index:   0  1  2  3 | 4  5  6  7 | 8  9  .  .
    logical block:      0     |     1      |     2
    block table:  [    7      ,     2      ,     5     ]   <- physical block ids
    slot of token i = block_table[i // block_size] * block_size + i % block_size
      token 9 -> block_table[2] * 4 + 1 = 5 * 4 + 1 = 21

A request holding T tokens of KV needs ceil(T / block_size) blocks; only its last block
may be partly empty. Physical blocks need not be contiguous or in order.
"""

from __future__ import annotations

from llmserve.scheduler.block_pool import BlockPool
from llmserve.scheduler.request import Request


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints."""
    return -(-a // b)


class KVCacheManager:
    """Owns every request's block table; the only caller of the block pool."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        """A cache of `num_blocks` blocks of `block_size` tokens each."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._block_tables: dict[str, list[int]] = {}

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 to 1.0."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold the KV of `num_tokens` tokens."""
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Grow the request's table so that num_computed_tokens + num_new_tokens fit.

        Returns the newly added block ids (often empty: the last block has room), or
        None when the pool cannot supply them, in which case nothing is allocated.
        """
        table = self._block_tables.setdefault(request.request_id, [])
        needed = self.num_blocks_for(request.num_computed_tokens + num_new_tokens)
        num_new_blocks = needed - len(table)
        if num_new_blocks <= 0:
            return []
        if num_new_blocks > self.pool.num_free_blocks:
            return None
        new_block_ids = self.pool.allocate(num_new_blocks)
        table.extend(new_block_ids)
        return new_block_ids

    def free(self, request: Request) -> None:
        """Return all of the request's blocks to the pool (no-op if it holds none).

        NOTE: the tail is freed first (vLLM's order): once prefix caching lands, the
        last blocks of a sequence are the least likely to be shared, so they should be
        the first evicted.
        """
        table = self._block_tables.pop(request.request_id, [])
        self.pool.free(reversed(table))

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table ([] if it holds none)."""
        return list(self._block_tables.get(request_id, ()))

    def num_blocks_held(self, request_id: str) -> int:
        return len(self._block_tables.get(request_id, ()))
