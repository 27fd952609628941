"""The prefix cache's block key, shared by the scheduler (which caches blocks under it)
and by whoever routes on the scheduler's KV events (which must compute the same keys
from a prompt's token ids).

Definition, for a subscriber in any language:

    hash_block(parent, ids) = SHA-256( parent || int64_le(ids[0]) || int64_le(ids[1]) || ... )

`parent` is the 32-byte key of the previous block of the same token list; for the first
block it is nothing at all (zero bytes), or, for a request with a cache salt, the salt's
key; each token id is 8 bytes, two's-complement, little-endian. Block i of a token list
is keyed by hash_block(key of block i-1, its block_size ids), so a key names the whole
prefix up to the end of its block. No model name enters the key: one scheduler serves
one model.

    salt_key(salt) = SHA-256( "llmserve cache salt" || 0x00 || utf8(salt) )

A cache salt (vLLM's `cache_salt`) keeps a tenant's blocks apart: a request shares cached
blocks only with requests of the same salt (or, unsalted, only with unsalted ones), so a
client cannot time another tenant's prompts through the cache. The empty salt is none.

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
# NOTE: read as little-endian int64 ids, the salt's input starts with 0x65767265736d6c6c
# ("llmserve"), far above any vocabulary's ids: no token list's first key is a salt's key.
_SALT_DOMAIN = b"llmserve cache salt\x00"


def salt_key(salt: str) -> bytes | None:
    """The parent key of a salted token list's first block (None for no salt: "")."""
    return hashlib.sha256(_SALT_DOMAIN + salt.encode()).digest() if salt else None


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The key of a full block (a 32-byte SHA-256 digest), chained from its parent
    block's key (None or b"" for a token list's first block)."""
    ids = array("q", token_ids)  # Fixed 8 bytes per id: no ambiguity between blocks.
    if sys.byteorder == "big":
        ids.byteswap()  # The encoding is little-endian on every host.
    digest = hashlib.sha256(parent or b"")
    digest.update(ids.tobytes())
    return digest.digest()


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str = "") -> list[bytes]:
    """The keys of every full block of `token_ids`, first block first (a partial last
    block has none), for a request with this cache salt."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[bytes] = []
    root = salt_key(cache_salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block(hashes[-1] if hashes else root, token_ids[start : start + block_size]))
    return hashes
