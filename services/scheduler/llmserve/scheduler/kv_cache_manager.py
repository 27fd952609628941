"""Per-sequence block tables on top of the block pools: prefix caching, copy-on-write
sharing between the samples of one request, and swapping to a CPU pool.

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

Prefix hashes: block i of a token list is identified by
hash_block(hash of block i-1, its block_size token ids), so a hash names the whole
prefix up to the end of its block. The hash is SHA-256: with a 64-bit
non-cryptographic hash a client could search for a prompt whose blocks collide with
another user's and be served their cached KV (vLLM's CVE-2025-25183).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from llmserve.scheduler.block_pool import BlockPool
from llmserve.scheduler.request import Request


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints."""
    return -(-a // b)


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The prefix-cache key of a full block (a 32-byte SHA-256 digest), chained from its
    parent block's key."""
    digest = hashlib.sha256(parent or b"")
    digest.update(array("q", token_ids).tobytes())  # fixed 8 bytes per id: no ambiguity
    return digest.digest()


@dataclass
class BlockOps:
    """Block moves a worker performs before a step's forward, in this order."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, gpu block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src gpu block, dst gpu block)


class KVCacheManager:
    """Owns every sequence's block table; the only caller of the block pools."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = False,
    ) -> None:
        """A cache of `num_blocks` blocks of `block_size` tokens, plus an optional CPU pool."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.cpu_pool = BlockPool(num_cpu_blocks) if num_cpu_blocks > 0 else None
        self._block_tables: dict[str, list[int]] = {}
        self._cpu_tables: dict[str, list[int]] = {}  # Swapped-out sequences.
        self._hashes: dict[str, list[bytes]] = {}  # Hashes of a sequence's full blocks so far.
        self._num_cached: dict[str, int] = {}  # Leading table blocks offered to the cache.
        self._ops = BlockOps()
        self._replaced: set[str] = set()  # Sequences whose table changed by copy-on-write.
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_swapped_out_blocks = 0  # Lifetime count of blocks copied to the CPU.
        self.num_cow_copies = 0

    # ---- sizes ----

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
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 to 1.0."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold the KV of `num_tokens` tokens."""
        return cdiv(num_tokens, self.block_size)

    # ---- admission and growth ----

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The longest run of cached blocks that starts the request's tokens.

        At most all but its last token to compute are covered, so at least one token is
        computed (the one whose logits are sampled). Nothing is taken yet.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_target_tokens - 1) // self.block_size
        hits = []
        for block_hash in self._block_hashes(request)[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def admit(self, request: Request, cached_blocks: list[int], num_new: int) -> list[int] | None:
        """Give a sequence holding nothing the cached blocks plus room for `num_new` tokens
        after them. Sets num_computed_tokens to the cached tokens.

        Returns the new block ids, or None (nothing taken) when the pool is short.
        """
        if self._block_tables.get(request.request_id):
            raise RuntimeError(f"admit of {request.request_id}, which holds blocks")
        num_cached_tokens = len(cached_blocks) * self.block_size
        num_new_blocks = self.num_blocks_for(num_cached_tokens + num_new) - len(cached_blocks)
        num_free_hits = sum(1 for b in cached_blocks if self.pool.ref_count(b) == 0)
        if num_new_blocks + num_free_hits > self.pool.num_free_blocks:
            return None
        self.pool.touch(cached_blocks)
        new_block_ids = self.pool.allocate(num_new_blocks)
        self._block_tables[request.request_id] = list(cached_blocks) + new_block_ids
        self._num_cached[request.request_id] = len(cached_blocks)
        request.num_computed_tokens = num_cached_tokens
        if self.enable_prefix_caching:
            self.prefix_query_tokens += request.num_target_tokens
            self.prefix_hit_tokens += num_cached_tokens
        return new_block_ids

    def blocks_needed(self, items: Sequence[tuple[Request, int]], swapped: bool = False) -> int:
        """Blocks that allocate_slots would take for every (sequence, new tokens) pair,
        copy-on-write included (the last writer of a shared block writes in place).
        With `swapped`, for sequences still on the CPU, as if they were swapped in."""
        tables, pool = (self._cpu_tables, self.cpu_pool) if swapped else (self._block_tables, self.pool)
        needed = 0
        writers: Counter[int] = Counter()
        for request, num_new in items:
            table = tables.get(request.request_id, [])
            start = request.num_computed_tokens
            needed += max(0, self.num_blocks_for(start + num_new) - len(table))
            if start % self.block_size and pool.ref_count(table[start // self.block_size]) > 1:
                writers[table[start // self.block_size]] += 1
        for block_id, num_writers in writers.items():
            needed += num_writers if pool.ref_count(block_id) > num_writers else num_writers - 1
        return needed

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Grow the table so that num_computed_tokens + num_new_tokens fit; copy the block
        written first if it is shared (copy-on-write: recorded in the step's ops, and
        `take_replaced` then answers True for this sequence).

        Returns the appended block ids (often empty: the last block has room), or None
        when the pool cannot supply them, in which case nothing changes.
        """
        if self.blocks_needed([(request, num_new_tokens)]) > self.pool.num_free_blocks:
            return None
        table = self._block_tables.setdefault(request.request_id, [])
        self._copy_on_write(request.request_id, table, request.num_computed_tokens)
        needed = self.num_blocks_for(request.num_computed_tokens + num_new_tokens)
        new_block_ids = self.pool.allocate(max(0, needed - len(table)))
        table.extend(new_block_ids)
        return new_block_ids

    def _copy_on_write(self, request_id: str, table: list[int], first_position: int) -> None:
        index = first_position // self.block_size
        if first_position % self.block_size == 0 or self.pool.ref_count(table[index]) == 1:
            return
        (new_block,) = self.pool.allocate(1)
        self._ops.copies.append((table[index], new_block))
        self.pool.free([table[index]])
        table[index] = new_block
        self._replaced.add(request_id)
        self.num_cow_copies += 1

    def take_replaced(self, request_id: str) -> bool:
        """True (once) if a copy-on-write replaced an entry of the sequence's table."""
        if request_id in self._replaced:
            self._replaced.discard(request_id)
            return True
        return False

    def fork(self, parent: Request, children: Iterable[Request]) -> None:
        """Give each child the parent's table (shared: one more holder per child), then
        release the parent's hold."""
        table = self._block_tables.get(parent.request_id, [])
        for child in children:
            self.pool.incref(table)
            self._block_tables[child.request_id] = list(table)
            self._hashes[child.request_id] = list(self._hashes.get(parent.request_id, []))
            self._num_cached[child.request_id] = self._num_cached.get(parent.request_id, 0)
        self.free(parent)

    def cache_full_blocks(self, request: Request) -> None:
        """Offer the sequence's newly filled blocks (up to num_computed_tokens) to the cache."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        num_full = request.num_computed_tokens // self.block_size
        start = self._num_cached.get(rid, 0)
        if num_full <= start:
            return
        table, hashes = self._block_tables[rid], self._block_hashes(request)
        for index in range(start, num_full):
            self.pool.cache(table[index], hashes[index])
        self._num_cached[rid] = num_full

    def _block_hashes(self, request: Request) -> list[bytes]:
        """Hashes of every full block of the sequence's known tokens (memoized)."""
        hashes = self._hashes.setdefault(request.request_id, [])
        num_full = request.num_tokens // self.block_size
        if len(hashes) < num_full:
            tokens, bs = request.all_token_ids, self.block_size
            for index in range(len(hashes), num_full):
                parent = hashes[-1] if hashes else None
                hashes.append(hash_block(parent, tokens[index * bs : (index + 1) * bs]))
        return hashes

    def blocks_to_hold(self, requests: Sequence[Request]) -> int:
        """Blocks the sequences need to hold all their tokens' KV, counting the blocks they
        share now once (and a copy-on-write for each shared block still to be written)."""
        held: set[int] = set()
        needed = 0
        for request in requests:
            table = self._block_tables.get(request.request_id) or self._cpu_tables.get(request.request_id, [])
            pool = self.pool if request.request_id in self._block_tables else self.cpu_pool
            held.update(table)
            needed += max(0, self.num_blocks_for(request.num_tokens) - len(table))
            start = request.num_computed_tokens
            if start % self.block_size and pool.ref_count(table[start // self.block_size]) > 1:
                needed += 1
        return len(held) + needed

    # ---- swapping ----

    def can_swap_out(self, requests: Sequence[Request]) -> bool:
        """True if the CPU pool can take every block the sequences hold."""
        needed = len({b for r in requests for b in self._block_tables.get(r.request_id, [])})
        return self.cpu_pool is not None and needed <= self.cpu_pool.num_free_blocks

    def swap_out(self, requests: Sequence[Request]) -> None:
        """Move the sequences' blocks to the CPU pool (shared blocks stay shared)."""
        mapping = self._move(requests, self._block_tables, self._cpu_tables, self.pool, self.cpu_pool)
        self._ops.swap_out.extend(mapping.items())
        self.num_swapped_out_blocks += len(mapping)

    def num_swap_in_blocks(self, requests: Sequence[Request]) -> int:
        return len({b for r in requests for b in self._cpu_tables.get(r.request_id, [])})

    def swap_in(self, requests: Sequence[Request]) -> None:
        """Move the sequences' blocks back from the CPU pool to fresh GPU blocks."""
        mapping = self._move(requests, self._cpu_tables, self._block_tables, self.cpu_pool, self.pool)
        self._ops.swap_in.extend(mapping.items())
        for request in requests:
            self._num_cached[request.request_id] = 0  # Offer the fresh blocks to the cache.

    @staticmethod
    def _move(requests, src_tables, dst_tables, src_pool: BlockPool, dst_pool: BlockPool) -> dict[int, int]:
        tables = [src_tables.pop(r.request_id, []) for r in requests]
        unique = list(dict.fromkeys(b for table in tables for b in table))
        mapping = dict(zip(unique, dst_pool.allocate(len(unique))))
        for request, table in zip(requests, tables):
            dst_tables[request.request_id] = [mapping[b] for b in table]
        holders = Counter(b for table in tables for b in table)
        dst_pool.incref(mapping[b] for b, times in holders.items() for _ in range(times - 1))
        for table in tables:
            src_pool.free(reversed(table))
        return mapping

    @property
    def has_block_ops(self) -> bool:
        """Swaps or copies are recorded for the plan being built."""
        return bool(self._ops.swap_out or self._ops.swap_in or self._ops.copies)

    def take_block_ops(self) -> BlockOps:
        """The swaps and copies recorded since the last call (for this step's plan)."""
        ops, self._ops = self._ops, BlockOps()
        return ops

    # ---- release ----

    def free(self, request: Request) -> None:
        """Return all of the sequence's blocks (GPU or CPU) to their pools.

        NOTE: the tail is freed first: the free queue is LRU, so a sequence's last
        blocks, the least likely to be shared, are evicted before its first ones.
        """
        rid = request.request_id
        self.pool.free(reversed(self._block_tables.pop(rid, [])))
        cpu_table = self._cpu_tables.pop(rid, [])
        if cpu_table:
            self.cpu_pool.free(reversed(cpu_table))
        self._hashes.pop(rid, None)
        self._num_cached.pop(rid, None)
        self._replaced.discard(rid)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (the KV content of some blocks is unknown)."""
        self.pool.reset_cache()
        self._num_cached = {rid: len(t) for rid, t in self._block_tables.items()}

    # ---- introspection ----

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the sequence's GPU block table ([] if it holds none)."""
        return list(self._block_tables.get(request_id, ()))

    def tables(self) -> dict[str, list[int]]:
        """Every GPU block table, by sequence id (copies). For checks and tests."""
        return {rid: list(t) for rid, t in self._block_tables.items()}

    def cpu_tables(self) -> dict[str, list[int]]:
        """Every CPU block table, by sequence id (copies). For checks and tests."""
        return {rid: list(t) for rid, t in self._cpu_tables.items()}
