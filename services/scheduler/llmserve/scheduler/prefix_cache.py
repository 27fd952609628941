"""Prefix caching: finding a sample's leading blocks already in the cache, and offering
the blocks it fills to the cache.

Prefix hashes: block i of a token list is identified by
hash_block(hash of block i-1, its block_size token ids), so a hash names the whole prefix
up to the end of its block:

    tokens:   [ 3 1 4 1 | 5 9 2 6 | 5 3 ]     (block_size = 4)
    hashes:     h0 = H(-, 3141)
                          h1 = H(h0, 5926)    the partial last block has no hash yet

The hash is SHA-256: with a 64-bit non-cryptographic hash a client could search for a
prompt whose blocks collide with another user's and be served their cached KV (vLLM's
CVE-2025-25183).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from llmserve.scheduler.block_pool import BlockPool
from llmserve.scheduler.request import Sample


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The prefix-cache key of a full block (a 32-byte SHA-256 digest), chained from its
    parent block's key."""
    digest = hashlib.sha256(parent or b"")
    digest.update(array("q", token_ids).tobytes())  # fixed 8 bytes per id: no ambiguity
    return digest.digest()


class PrefixCache:
    """The prefix-cache half of the KV cache manager: lookups, offers, hit counters."""

    def __init__(self, pool: BlockPool, block_size: int, enabled: bool) -> None:
        """Cache full blocks of `pool` (nothing at all unless `enabled`)."""
        self.pool = pool
        self.block_size = block_size
        self.enabled = enabled
        self.query_tokens = 0  # Tokens looked up at admission.
        self.hit_tokens = 0  # Of those, tokens found.

    def computed_blocks(self, sample: Sample) -> list[int]:
        """The longest run of cached blocks that starts the sample's tokens.

        At most all but its last token to compute are covered, so at least one token is
        computed (the one whose logits are sampled). Nothing is taken yet.
        """
        if not self.enabled:
            return []
        max_blocks = (sample.num_target_tokens - 1) // self.block_size
        hits = []
        for block_hash in self.block_hashes(sample)[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def count_admission(self, sample: Sample, num_cached_tokens: int) -> None:
        """Count an admission's lookup: its target tokens, and the ones found cached."""
        if self.enabled:
            self.query_tokens += sample.num_target_tokens
            self.hit_tokens += num_cached_tokens

    def cache_full_blocks(self, sample: Sample) -> None:
        """Offer the sample's newly filled blocks (up to num_computed_tokens) to the cache."""
        if not self.enabled:
            return
        num_full = sample.num_computed_tokens // self.block_size
        start = sample.num_offered_blocks
        if num_full <= start:
            return
        table, hashes = sample.block_table, self.block_hashes(sample)
        for index in range(start, num_full):
            self.pool.cache(table[index], hashes[index])
        sample.num_offered_blocks = num_full

    def block_hashes(self, sample: Sample) -> list[bytes]:
        """Hashes of every full block of the sample's known tokens (memoized on it)."""
        hashes = sample.block_hashes
        num_full = sample.num_tokens // self.block_size
        if len(hashes) < num_full:
            tokens, bs = sample.all_token_ids, self.block_size
            for index in range(len(hashes), num_full):
                parent = hashes[-1] if hashes else None
                hashes.append(hash_block(parent, tokens[index * bs : (index + 1) * bs]))
        return hashes
