"""How much one engine step may hold, by device: the rule the scheduler (its step budget)
and the worker (its profiling forward and its CUDA-graph ladder) both apply, so both
sides size the same step from the same facts.

The defaults are vLLM's (EngineArgs.get_batch_defaults, offline `LLM` usage, the one its
throughput benchmarks run): a card of at least 70 GiB that is not an A100 (H100, H200,
MI300X) takes 16,384 batched tokens and 1,024 sequences; any other card 8,192 and 256.
vLLM leaves the A100 out because the large budget measured slower there (its PR #17885).
The CPU keeps 512 and 256: a CPU forward is tens of milliseconds at that size already,
and a larger step only lengthens every decode step that shares it with a prefill chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
LARGE_CARD_BYTES = 70 * GIB
CPU_BUDGET = (512, 256)  # (batched tokens, sequences)
CARD_BUDGET = (8192, 256)
LARGE_CARD_BUDGET = (16384, 1024)


def by_device_help(limit: str) -> str:
    """What an unset limit means, for --help: `limit` is "max_num_batched_tokens" or
    "max_num_seqs"."""
    i = ("max_num_batched_tokens", "max_num_seqs").index(limit)
    return (f"by the worker's device: {LARGE_CARD_BUDGET[i]} on CUDA cards of 70 GiB or more (not A100s), "
            f"{CARD_BUDGET[i]} on other cards, {CPU_BUDGET[i]} on the CPU")


@dataclass(frozen=True)
class StepBudget:
    """The resolved per-step limits and why they are what they are."""

    max_num_batched_tokens: int
    max_num_seqs: int
    reason: str  # "by device: cuda (NVIDIA H100 80GB HBM3), 79.6 GiB", "set by --max-num-seqs", ...

    def describe(self) -> str:
        """The registration log line."""
        return (f"step budget: {self.max_num_batched_tokens} batched tokens, {self.max_num_seqs} sequences "
                f"({self.reason})")


def device_defaults(device: str, memory_bytes: int) -> tuple[int, int]:
    """(batched tokens, sequences) for a worker on `device` ("cpu", or "cuda (<GPU name>)")
    whose card has `memory_bytes` in all (0: unknown, which counts as a smaller card)."""
    if not device.startswith("cuda"):
        return CPU_BUDGET
    if memory_bytes >= LARGE_CARD_BYTES and "a100" not in device.lower():
        return LARGE_CARD_BUDGET
    return CARD_BUDGET


def device_label(device: str, memory_bytes: int) -> str:
    """'cuda (NVIDIA H100 80GB HBM3), 79.6 GiB', or 'cpu'."""
    if not device.startswith("cuda"):
        return device
    return f"{device}, {memory_bytes / GIB:.1f} GiB" if memory_bytes else f"{device}, memory unknown"


def resolve_step_budget(max_num_batched_tokens: int | None, max_num_seqs: int | None, device: str,
                        memory_bytes: int) -> StepBudget:
    """The budget a step gets: each limit as set (None: by device), with the reason."""
    tokens, seqs = device_defaults(device, memory_bytes)
    explicit = [f"--{name}" for name, value in (("max-num-batched-tokens", max_num_batched_tokens),
                                                  ("max-num-seqs", max_num_seqs)) if value is not None]
    by_device = f"by device: {device_label(device, memory_bytes)}"
    if not explicit:
        reason = by_device
    elif len(explicit) == 2:
        reason = "set by --max-num-batched-tokens and --max-num-seqs"
    else:
        reason = f"set by {explicit[0]}, the other {by_device}"
    return StepBudget(max_num_batched_tokens=tokens if max_num_batched_tokens is None else max_num_batched_tokens,
                      max_num_seqs=seqs if max_num_seqs is None else max_num_seqs, reason=reason)
