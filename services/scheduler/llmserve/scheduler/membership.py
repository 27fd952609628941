"""Worker membership: a TP x PP group registers rank by rank; once every rank has, the
group is one step executor (worker_link.WorkerGroup).

    rank 1 registers ──▶ pending {1}      (answered at once; nothing starts)
    rank 0 registers ──▶ pending {0, 1} ──▶ complete: WorkerGroup(links 0, 1) ──▶ EngineSession
"""

from __future__ import annotations

import logging

import grpc

from llmserve.contract.worker_info import WorkerInfo
from llmserve.scheduler.config import SchedulerServiceConfig
from llmserve.scheduler.worker_link import WorkerGroup, WorkerLink

logger = logging.getLogger(__name__)


class GroupAssembly:
    """The ranks of a TP x PP group registered so far, until the group is complete."""

    def __init__(self, config: SchedulerServiceConfig):
        self.config = config
        self._ranks: dict[int, tuple[str, WorkerInfo]] = {}  # rank -> (address, info)
        self._topology: tuple[int, int] | None = None  # (tp, pp) of the group being assembled.

    def link(self, address: str, info: WorkerInfo) -> WorkerLink:
        """A link to a single worker (tp = pp = 1)."""
        return WorkerLink(address, info, self.config.security, self.config.server.max_message_bytes)

    async def add_rank(self, request, info: WorkerInfo, tp: int, pp: int, context) -> WorkerGroup | None:
        """One rank of a TP x PP group. Returns the group once all tp*pp ranks have
        registered (plans then go to every rank; tokens come from the last stage's TP
        rank 0), None before. Ranks serving another model are refused."""
        world = tp * pp
        if not 0 <= request.rank < world:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"rank {request.rank} outside 0..{world - 1}")
        if self._topology != (tp, pp):  # a new group (or a re-started one) begins
            self._ranks, self._topology = {}, (tp, pp)
        for rank, (_, other) in self._ranks.items():
            if rank != request.rank and other.model_path != info.model_path:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"rank {request.rank} serves {info.model_path!r} but rank {rank} serves "
                                    f"{other.model_path!r}: every rank of a group must load the same model")
        self._ranks[request.rank] = (request.address, info)
        missing = [r for r in range(world) if r not in self._ranks]
        if missing:
            logger.info("rank %d of a tp=%d x pp=%d group registered (%s); waiting for rank(s) %s",
                        request.rank, tp, pp, request.address, missing)
            return None
        ranks, self._ranks, self._topology = self._ranks, {}, None
        links = [self.link(*ranks[r]) for r in range(world)]
        logger.info("worker group complete: tp=%d x pp=%d, driver rank %d", tp, pp, (pp - 1) * tp)
        return WorkerGroup(links, driver=(pp - 1) * tp, step_timeout_s=self.config.step_timeout_s)
