"""Host time per engine-step phase, summed per process, for `llmserve bench overhead`.

Off unless LLMSERVE_STEP_PHASES_DIR names a directory: then `add(phase, seconds)`
accumulates, and a daemon thread rewrites `<dir>/<service>.json` (cumulative totals
in seconds, and counters) every WRITE_INTERVAL_S and at exit. A reader takes two
snapshots around a workload and subtracts them, so no call is needed to reset or to
flush, and nothing is sent over the wire: the step path pays one dict update per phase
(and nothing at all when off).
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from pathlib import Path

ENV = "LLMSERVE_STEP_PHASES_DIR"
WRITE_INTERVAL_S = 0.1

_totals: dict[str, float] | None = None
_path: Path | None = None


def enabled() -> bool:
    return _totals is not None


def add(phase: str, amount: float) -> None:
    """Adds `amount` (seconds, or a count) to `phase`'s total. Called from the event loop
    and from the compute thread: each phase has one writer, and a dict update on
    distinct keys is atomic under the GIL."""
    if _totals is not None:
        _totals[phase] = _totals.get(phase, 0.0) + amount


class _Timer:
    """Adds the seconds its `with` block took to `phase`."""

    __slots__ = ("phase", "start")

    def __init__(self, phase: str):
        self.phase = phase

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        add(self.phase, time.perf_counter() - self.start)


class _Off:
    """What `timed` returns while recording is off: a `with` that costs two calls."""

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc) -> None:
        pass


_OFF = _Off()


def timed(phase: str) -> _Timer | _Off:
    """`with timed("schedule"): ...` adds the block's seconds to the phase when on."""
    return _Timer(phase) if _totals is not None else _OFF


def start(service: str) -> bool:
    """Starts recording in this process when the environment asks for it; True if on.
    Idempotent: a second call (another servicer in the same process) changes nothing."""
    global _totals, _path
    directory = os.environ.get(ENV)
    if not directory or _totals is not None:
        return _totals is not None
    _path = Path(directory) / f"{service}.json"
    _path.parent.mkdir(parents=True, exist_ok=True)
    _totals = {}
    threading.Thread(target=_write_forever, name="step-phases", daemon=True).start()
    atexit.register(write)
    return True


def write() -> None:
    """Replaces the file atomically: a reader never sees half a snapshot."""
    if _totals is None or _path is None:
        return
    tmp = _path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(dict(_totals)))
        os.replace(tmp, _path)
    except OSError:  # The reader removed the directory (its run is over): nothing left to tell.
        pass


def _write_forever() -> None:
    stop = threading.Event()
    while not stop.wait(WRITE_INTERVAL_S):
        write()


def read(directory: str | Path, service: str) -> dict[str, float]:
    """The last snapshot `service` wrote in `directory` ({} before its first)."""
    path = Path(directory) / f"{service}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
