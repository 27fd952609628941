"""The prefix cache's block key, shared by the scheduler (which caches blocks under it)
and by whoever routes on the scheduler's KV events (which must compute the same keys
from a prompt's token ids).

Definition, for a subscriber in any language:

    hash_block(parent, ids) = SHA-256( parent || int64_le(ids[0]) || int64_le(ids[1]) || ... )

`parent` is the 32-byte key of the previous block of the same token list, or nothing at
all (zero bytes) for the first block; each token id is 8 bytes, two's-complement,
little-endian. Block i of a token list is keyed by hash_block(key of block i-1, its
block_size ids), so a key names the whole prefix up to the end of its block. Nothing
else enters the key (no model name, no salt): one scheduler serves one model.

    tokens:   [ 3 1 4 1 | 5 9 2 6 | 5 3 ]     (block_size = 4)
    keys:       h0 = H(-, 3141)
                          h1 = H(h0, 5926)    the partial last block has no key

SHA-256, not a fast 64-bit hash: with a weak hash a client could search for a prompt
whose blocks collide with another user's and be served their cached KV (vLLM's
CVE-2025-25183).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

BLOCK_HASH_BYTES = 32


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The key of a full block (a 32-byte SHA-256 digest), chained from its parent
    block's key (None or b"" for a token list's first block)."""
    ids = array("q", token_ids)  # Fixed 8 bytes per id: no ambiguity between blocks.
    if sys.byteorder == "big":
        ids.byteswap()  # The encoding is little-endian on every host.
    digest = hashlib.sha256(parent or b"")
    digest.update(ids.tobytes())
    return digest.digest()


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The keys of every full block of `token_ids`, first block first (a partial last
    block has none)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[start : start + block_size]))
    return hashes
