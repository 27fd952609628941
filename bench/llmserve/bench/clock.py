"""Wall clocks that time work on any device.

CUDA kernels run asynchronously: a clock read right after a launch times the launch,
not the work. Benchmarks read their clocks through `now(device)`, which first waits for
the work queued on the device (nothing to wait for on the CPU).
"""

from __future__ import annotations

import time

import torch


def synchronize(device: torch.device | str | None) -> None:
    """Wait until every kernel queued on `device` has finished (a no-op off CUDA)."""
    device = torch.device(device or "cpu")
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device | str | None) -> float:
    """perf_counter() once `device` is idle: two of these bracket the work between them."""
    synchronize(device)
    return time.perf_counter()


def best_rate(work, amount: float, device: torch.device | str | None, seconds: float, reps: int = 1) -> float:
    """The best `amount` per second of `work()` over samples of `reps` calls each, for
    `seconds` (after one warm-up call). Several calls per sample amortise the clock's
    synchronisation over short GPU kernels."""
    work()
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = now(device)
        for _ in range(reps):
            work()
        best = max(best, reps * amount / (now(device) - start))
    return best
