"""The garbage collector's view of a service's start-up heap.

A full (generation 2) collection walks every tracked object: in a worker with torch
loaded that is ~200k objects, tens of ms on a CPU core, and it lands in the middle of
whichever step allocated past the threshold (a 2 ms step loop stalls for many steps).
Modules, the model and the gRPC server live as long as the process, so once a service
has started they are frozen out of the collector's reach (gc.freeze, as vLLM's engine
does after start-up); the per-step records come and go in the young generations.
"""

from __future__ import annotations

import atexit
import gc


def freeze_startup_heap() -> None:
    """Collect once, then move every surviving object to the permanent generation, until
    the process exits. NOTE: unfrozen at exit: the interpreter's last collections skip
    frozen objects, and extensions that check for leaks at their teardown (Triton's
    nanobind bindings) then print hundreds of lines of "leaked instances" after the
    service's own last words."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
