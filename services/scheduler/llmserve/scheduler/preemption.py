"""Preempting a running request: all its samples at once, by swap or by recompute.

    swap:       blocks copied to the CPU pool; the samples come back as they were
    recompute:  blocks freed; the samples wait again and recompute prompt + outputs

In AUTO mode a request with several live samples is swapped (recomputing would lose
the blocks they share), the others are recomputed; either mode recomputes when the CPU
pool cannot take the blocks.
"""

from __future__ import annotations

import enum
import logging

from llmserve.scheduler.kv_cache_manager import KVCacheManager
from llmserve.scheduler.queues import Queues
from llmserve.scheduler.request import Request, Sample
from llmserve.scheduler.stats import Counters
from llmserve.scheduler.worker_view import WorkerView

logger = logging.getLogger(__name__)


class PreemptionMode(str, enum.Enum):
    AUTO = "auto"  # Swap requests with several live sequences, recompute the others.
    SWAP = "swap"  # Swap whenever the CPU pool has room.
    RECOMPUTE = "recompute"  # Always drop the KV and recompute it later.

    def __str__(self) -> str:
        return self.value


class Preemptor:
    """Takes a request's running samples off the GPU and counts it."""

    def __init__(self, mode: PreemptionMode, kv: KVCacheManager, queues: Queues, worker: WorkerView,
                 counters: Counters) -> None:
        """Preempt in `mode`, moving samples between `queues` and blocks in `kv`."""
        self.mode = mode
        self.kv = kv
        self.queues = queues
        self.worker = worker
        self.counters = counters

    def preempt(self, request: Request) -> None:
        """Preempt every running sample of the request, by swap or by recompute."""
        if any(self.worker.in_flight(s) for s in request.samples):
            # Its in-flight token would be lost: a pipelined loop plans a step that may
            # preempt only once nothing is in flight (Scheduler.can_schedule_ahead).
            raise RuntimeError(f"preempting {request.request_id} while a step samples for it")
        live = self.queues.take_running(request)
        for sample in live:
            self.worker.drop(sample)  # Its state on the worker is stale either way.
        if self._wants_swap(live) and self.kv.can_swap_out(live):
            self._swap_out(request, live)
        else:
            self._recompute(request, live)

    def _wants_swap(self, live: list[Sample]) -> bool:
        return self.mode is PreemptionMode.SWAP or (self.mode is PreemptionMode.AUTO and len(live) > 1)

    def _swap_out(self, request: Request, live: list[Sample]) -> None:
        logger.debug("preempting %s by swap", request.request_id)
        self.kv.swap_out(live)
        self.queues.swap(live)
        self.counters.preemptions_swap += 1

    def _recompute(self, request: Request, live: list[Sample]) -> None:
        logger.debug("preempting %s by recompute", request.request_id)
        for sample in live:
            self.kv.free(sample)
            sample.num_computed_tokens = 0
            self.queues.wait(sample)
        self.counters.preemptions_recompute += 1
