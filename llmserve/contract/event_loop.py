"""The services' event loop: uvloop's where it is installed (each service's distribution
depends on it, as vLLM's API server runs on it), else asyncio's own.

Why: the router, the scheduler and the worker spend most of their host time in event-loop
machinery around gRPC messages (a streamed token is a handful of callbacks in each hop).
With a simulated 2 ms device step (`bench overhead`'s cluster), 64 streams x 400 tokens,
uvloop took 9-12% less router CPU per token, ~15% less scheduler CPU and 10-25% less
worker CPU than asyncio's loop, and the run 9-19% less wall time (2-core AMD EPYC, Zen 5).

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
