"""A service a launcher started (LocalCluster: `llmserve up`, the benches, the tests)
stops when that launcher is gone, as after SIGTERM (it drains, frees its KV blocks and
exits), instead of running on unowned: a bench killed by a timeout left its cluster's
three processes running, holding their ports, memory and the kernel build lock.

The launcher names itself in LLMSERVE_EXIT_WITH_PARENT (its pid); the service polls its
parent pid once a second, since PR_SET_PDEATHSIG follows the thread that forked, not the
process. A service started by hand, by docker-compose or Kubernetes has no such
variable and is not watched.
"""

from __future__ import annotations

import asyncio
import logging
import os

EXIT_WITH_PARENT_ENV = "LLMSERVE_EXIT_WITH_PARENT"
logger = logging.getLogger(__name__)


def parent_to_follow() -> int | None:
    """The launcher's pid this process was told to exit with, or None. The variable is
    removed here, so processes this one starts do not inherit it."""
    value = os.environ.pop(EXIT_WITH_PARENT_ENV, "")
    return int(value) if value.isdigit() else None


async def stop_when_orphaned(parent: int, stop: asyncio.Event, every_s: float = 1.0) -> None:
    """Sets `stop` once this process's parent is no longer `parent` (it exited: the
    process was handed to init or a subreaper); returns when `stop` is set."""
    while not stop.is_set():
        if os.getppid() != parent:
            logger.warning("the process that started this one (pid %d) is gone: stopping", parent)
            stop.set()
            return
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except TimeoutError:
            pass
