"""What the prefix cache tells the outside about its blocks: a key stored, a key
removed, or every key gone. A router replaying them knows exactly which prefixes this
scheduler holds (kv_events.py publishes them; the keys are llmserve.contract.block_hash).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    """A full block was cached under `block_hash`; `parent_hash` keys the block before it
    in its token list (None for a first block)."""

    block_hash: Hashable
    parent_hash: Hashable | None


@dataclass(frozen=True)
class BlockRemoved:
    """The block cached under `block_hash` lost its key (evicted or forgotten)."""

    block_hash: Hashable


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every key is gone (the KV content can no longer be trusted, or is lost)."""


BlockEvent = BlockStored | BlockRemoved | AllBlocksCleared


def replay(events: Iterable[BlockEvent], hashes: set | None = None) -> set:
    """The set of cached keys after applying `events` to `hashes` (a new set when None):
    what a subscriber computes."""
    hashes = set() if hashes is None else hashes
    for event in events:
        if isinstance(event, BlockStored):
            hashes.add(event.block_hash)
        elif isinstance(event, BlockRemoved):
            hashes.discard(event.block_hash)
        else:
            hashes.clear()
    return hashes
