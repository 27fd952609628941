"""What one replica's prefix cache holds, as its scheduler's KV events tell it.

The scheduler publishes `stored` / `removed` / `cleared` block events (SubscribeKvEvents)
keyed by the prefix cache's chained block hashes (llmserve.contract.block_hash), so the
router hashes a prompt the same way and counts how many of its leading blocks a replica
holds, without asking it.

Events arrive after the step that cached the blocks. A burst of requests sharing a new
prefix would all see "nothing cached anywhere" and spread over every replica; so a
placement records the prompt's blocks as *expected* on its replica for a short while,
until the events confirm them (or they expire: a request refused, prefix caching off).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

EXPECTED_TTL_S = 30.0


class KvIndex:
    """One replica's prefix cache as the router sees it: the block hashes its KV events
    say are cached, plus the prefixes the router just sent there (expected for a while,
    until the events catch up)."""

    def __init__(self, clock=time.monotonic) -> None:
        self.blocks: set[bytes] = set()  # Hashes the replica's prefix cache holds.
        self.instance_id = ""  # The scheduler process the events come from.
        self.sequence = 0  # Last batch applied (resubscriptions resume after it).
        self.block_size = 0
        self._expected: dict[bytes, float] = {}  # Hash -> when the expectation lapses.
        self._clock = clock

    def apply(self, batch) -> None:
        """Applies one KvEventBatch (llmserve.internal.v1)."""
        if batch.snapshot or batch.instance_id != self.instance_id:
            self.blocks.clear()
        self.instance_id, self.sequence, self.block_size = batch.instance_id, batch.sequence, batch.block_size
        for event in batch.events:
            kind = event.WhichOneof("event")
            if kind == "stored":
                self.blocks.add(event.stored.block_hash)
                self._expected.pop(event.stored.block_hash, None)
            elif kind == "removed":
                self.blocks.discard(event.removed.block_hash)
            elif kind == "cleared":
                self.blocks.clear()
                self._expected.clear()

    def clear(self) -> None:
        """The replica is gone (or its cache with its worker): it holds nothing we know of."""
        self.blocks.clear()
        self._expected.clear()
        self.instance_id, self.sequence = "", 0

    def matched_blocks(self, prompt_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt (its chained hashes) the replica holds or is
        expected to hold."""
        now = self._clock()
        matched = 0
        for block_hash in prompt_hashes:
            if block_hash not in self.blocks and self._expected.get(block_hash, 0.0) <= now:
                break
            matched += 1
        return matched

    def expect(self, prompt_hashes: Sequence[bytes]) -> None:
        """A request with these blocks was just placed here: they will be cached soon."""
        now = self._clock()
        if len(self._expected) > 4 * len(prompt_hashes) + 10_000:  # Drop lapsed ones now and then.
            self._expected = {h: t for h, t in self._expected.items() if t > now}
        until = now + EXPECTED_TTL_S
        for block_hash in prompt_hashes:
            if block_hash not in self.blocks:
                self._expected[block_hash] = until
