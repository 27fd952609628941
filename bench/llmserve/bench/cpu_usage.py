"""CPU time used by each process of a launched cluster (and by the benchmark's own
client) during a run: what the control plane costs per step, on cores it shares with
the worker's compute threads."""

from __future__ import annotations

import os
import time
from pathlib import Path


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process, all threads; None where /proc is absent."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # NOTE: the command name (field 2) may hold spaces; fields after its ")" start at
    # field 3, so utime and stime (fields 14 and 15) are at 11 and 12.
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def snapshot(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds per named process, plus "client": this process."""
    seconds = {name: s for name, pid in pids.items() if (s := process_cpu_seconds(pid)) is not None}
    seconds["client"] = time.process_time()
    return seconds


def cpu_per_step(before: dict[str, float], after: dict[str, float], num_steps: int) -> dict:
    """CPU milliseconds per engine step of each process between two snapshots."""
    used = {name: after[name] - before[name] for name in before if name in after}
    return {"seconds": used, "ms_per_step": {n: 1000 * s / num_steps for n, s in used.items()} if num_steps else {}}
