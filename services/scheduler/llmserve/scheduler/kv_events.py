"""The KV event stream (SubscribeKvEvents): numbered batches of the prefix cache's block
events, a ring buffer of the latest for resuming subscribers, and one bounded queue per
subscriber.

    engine step ──take_block_events()──▶ publish() ──▶ batch 41 ──▶ ring [.. 39 40 41]
                                                               └──▶ each subscriber's queue

A subscriber resuming after batch k of this instance gets k+1.. replayed from the ring;
any other subscriber (new, from another process start, or after batches the ring has
lost) gets a snapshot first: one `cleared`, then `stored` for every cached block,
numbered with the last published sequence so that the next batch follows it.

Publishing never waits: a subscriber whose queue is full is dropped (its stream ends and
it resubscribes), so a slow router cannot stall the engine loop.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import deque
from collections.abc import Callable, Sequence

from llmserve.internal.v1 import scheduler_pb2
from llmserve.scheduler.block_events import AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored

logger = logging.getLogger(__name__)

HISTORY_BATCHES = 1024  # Batches kept for resuming subscribers.
QUEUE_BATCHES = 256  # Batches a subscriber may fall behind before it is dropped.


def event_to_pb(event: BlockEvent, block_size: int) -> scheduler_pb2.KvEvent:
    if isinstance(event, BlockStored):
        return scheduler_pb2.KvEvent(stored=scheduler_pb2.BlockStored(
            block_hash=event.block_hash, parent_block_hash=event.parent_hash or b"", num_tokens=block_size))
    if isinstance(event, BlockRemoved):
        return scheduler_pb2.KvEvent(removed=scheduler_pb2.BlockRemoved(block_hash=event.block_hash))
    if isinstance(event, AllBlocksCleared):
        return scheduler_pb2.KvEvent(cleared=scheduler_pb2.AllBlocksCleared())
    raise TypeError(f"not a block event: {event!r}")


class KvEventSubscriber:
    """One stream's queue of batches; None in it ends the stream (dropped)."""

    def __init__(self, max_batches: int) -> None:
        self.queue: asyncio.Queue[scheduler_pb2.KvEventBatch | None] = asyncio.Queue(max_batches + 1)
        self.max_batches = max_batches
        self.dropped = False

    def offer(self, batch: scheduler_pb2.KvEventBatch) -> bool:
        """Queues the batch; False (and the stream's end queued instead) when full."""
        if self.queue.qsize() >= self.max_batches:
            self.drop()
            return False
        self.queue.put_nowait(batch)
        return True

    def drop(self) -> None:
        """Ends the stream now: what it has not read yet is discarded."""
        self.dropped = True
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(None)  # The extra slot keeps this from ever raising.


class KvEventLog:
    """Numbers and fans out the block events of one scheduler process."""

    def __init__(self, history: int = HISTORY_BATCHES, queue_batches: int = QUEUE_BATCHES,
                 instance_id: str | None = None) -> None:
        self.instance_id = instance_id or secrets.token_hex(8)  # Sequences restart with the process.
        self.sequence = 0  # Of the last published batch.
        self.history: deque[scheduler_pb2.KvEventBatch] = deque(maxlen=history)
        self.queue_batches = queue_batches
        self.subscribers: set[KvEventSubscriber] = set()
        self.num_dropped = 0  # Subscribers dropped for falling behind, lifetime.

    def publish(self, events: Sequence[BlockEvent], block_size: int) -> scheduler_pb2.KvEventBatch | None:
        """Publishes the events as the next batch (None, and nothing sent, when empty)."""
        if not events:
            return None
        self.sequence += 1
        batch = scheduler_pb2.KvEventBatch(sequence=self.sequence, instance_id=self.instance_id,
                                           block_size=block_size,
                                           events=[event_to_pb(e, block_size) for e in events])
        self.history.append(batch)
        for subscriber in list(self.subscribers):
            if not subscriber.offer(batch):
                self.subscribers.discard(subscriber)
                self.num_dropped += 1
                logger.warning("a KV event subscriber fell %d batches behind: dropped (it resubscribes)",
                               self.queue_batches)
        return batch

    def subscribe(self, after_sequence: int, instance_id: str,
                  snapshot: Callable[[], tuple[list[BlockStored], int]]) -> tuple[list, KvEventSubscriber]:
        """Registers a subscriber; returns the batches to send it first (a replay, or a
        snapshot built from `snapshot()` = (stored events, block size)) and its queue of
        later ones. Nothing can be published in between: no await here."""
        subscriber = KvEventSubscriber(self.queue_batches)
        self.subscribers.add(subscriber)
        replay = self._replay_after(after_sequence, instance_id)
        if replay is not None:
            return replay, subscriber
        stored, block_size = snapshot()
        events = [AllBlocksCleared(), *stored]
        batch = scheduler_pb2.KvEventBatch(sequence=self.sequence, instance_id=self.instance_id, snapshot=True,
                                           block_size=block_size,
                                           events=[event_to_pb(e, block_size) for e in events])
        return [batch], subscriber

    def unsubscribe(self, subscriber: KvEventSubscriber) -> None:
        self.subscribers.discard(subscriber)

    def _replay_after(self, after_sequence: int, instance_id: str) -> list | None:
        """The buffered batches after `after_sequence`, or None when they cannot all be
        replayed (0, another instance, a sequence not published, or some already lost)."""
        if after_sequence == 0 or instance_id != self.instance_id or after_sequence > self.sequence:
            return None
        oldest = self.history[0].sequence if self.history else self.sequence + 1
        if after_sequence < oldest - 1:
            return None  # Batches oldest-1 .. after_sequence+1 are gone.
        return [batch for batch in self.history if batch.sequence > after_sequence]
