"""The services' event loop: uvloop's where it is installed (each service's distribution
depends on it, as vLLM's API server runs on it), else asyncio's own.

Why: the router, the scheduler and the worker spend most of their host time in event-loop
and gRPC machinery around messages (a streamed token is a handful of callbacks in each
hop; a batch-1 step costs the scheduler ~0.5 ms of CPU, ~0.1 ms of it its own phases).
With a simulated 2 ms device step (`bench overhead`'s cluster), one stream of 1,500
tokens, seven rounds taking turns, CPU per token (medians, asyncio -> uvloop): router
360 -> 307 us, scheduler 520 -> 480, worker 887 -> 793, while the unchanged client's own
moved 179 -> 169 (the host's drift) on a 2-core AMD EPYC (Zen 5). With 64-256 streams
and on the reference workload through gRPC the difference stayed inside the runs' spread.

`LLMSERVE_EVENT_LOOP=asyncio` keeps asyncio's loop (comparisons, debugging with asyncio's
debug mode); a host without uvloop (a bare base install) gets it too.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

ENV = "LLMSERVE_EVENT_LOOP"
CHOICES = ("uvloop", "asyncio")


def loop_factory() -> tuple[str, Callable[[], asyncio.AbstractEventLoop] | None]:
    """(the loop's name, its factory for asyncio.Runner; None: asyncio's default).
    ValueError for an `LLMSERVE_EVENT_LOOP` that names neither."""
    choice = os.environ.get(ENV, "uvloop")
    if choice not in CHOICES:
        raise ValueError(f"{ENV}={choice!r}: expected one of {', '.join(CHOICES)}")
    if choice == "uvloop":
        try:
            import uvloop
        except ImportError:
            return "asyncio (uvloop is not installed)", None
        return f"uvloop {uvloop.__version__}", uvloop.new_event_loop
    return "asyncio", None
