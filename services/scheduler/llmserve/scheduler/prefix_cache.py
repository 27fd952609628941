"""Prefix caching: finding a sample's leading blocks already in the cache, and offering
the blocks it fills to the cache.

Block keys: `llmserve.contract.block_hash` (chained SHA-256 over the token ids, the
first block's chained from the request's cache salt if it has one), shared with the
router, which computes the same keys from a prompt to route on the scheduler's KV events
(kv_events.py).
"""

from __future__ import annotations

from llmserve.contract.block_hash import hash_block
from llmserve.scheduler.block_pool import RELEASED, BlockPool
from llmserve.scheduler.request import Sample


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
        computed (the one whose logits are sampled). Nothing is taken yet. None for a
        sample that still needs its prompt logprobs: those need the whole prompt's logits.
        """
        if not self.enabled or (sample.sampling.prompt_logprobs is not None and not sample.output_token_ids):
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
        start = sample.num_offered_blocks
        if not self.enabled or sample.num_computed_tokens // self.block_size <= start:
            return  # NOTE: the common decode step, decided before num_tokens is read
        # NOTE: a pending token's slot is computed before its id is known: a block ending
        # in a placeholder is offered once the real id arrived (a later call).
        num_full = min(sample.num_computed_tokens, sample.num_tokens) // self.block_size
        if num_full <= start:
            return
        table, hashes = sample.block_table, self.block_hashes(sample)
        for index in range(start, num_full):
            if table[index] != RELEASED:  # NOTE: a window may have left a block behind before it was offered
                self.pool.cache(table[index], hashes[index], hashes[index - 1] if index else None)
        sample.num_offered_blocks = num_full

    def block_hashes(self, sample: Sample) -> list[bytes]:
        """Hashes of every full block of the sample's known tokens (memoized on it)."""
        hashes = sample.block_hashes
        num_full = sample.num_tokens // self.block_size
        if len(hashes) < num_full:
            bs = self.block_size
            for index in range(len(hashes), num_full):
                parent = hashes[-1] if hashes else sample.request.salt_key
                hashes.append(hash_block(parent, sample.token_ids_between(index * bs, (index + 1) * bs)))
        return hashes
