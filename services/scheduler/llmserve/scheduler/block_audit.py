"""The KV block ledger: which live request holds each block, and whether any block is
held by no one that still exists (a leak) or counted wrongly.

The ledger is rebuilt from the live samples' tables, not from the pools' bookkeeping,
so it checks that bookkeeping: a block whose ref count exceeds the number of live
tables holding it is *orphaned* (held for a request that has ended; it would never be
freed). `Scheduler.audit()` runs it; the GetBlockAudit RPC and the
`llmserve_scheduler_orphaned_kv_blocks` gauge report it, and the property tests assert
a clean audit after every step. The periodic gauge first asks `ledger_balances`, which
decides the same "nothing wrong" in C-level loops over the held blocks only, and runs
the audit (to say what is wrong) when it does not.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain

from llmserve.scheduler.block_pool import RELEASED, BlockPool, held_blocks
from llmserve.scheduler.request import Sample


@dataclass(frozen=True)
class BlockHolder:
    """One live sample holding a block."""

    request_id: str  # The public id.
    index: int  # Which of the request's samples (0 for a root).
    is_root: bool  # The root prefilling a multi-sample prompt.


@dataclass(frozen=True)
class BlockAudit:
    gpu_owners: dict[int, tuple[BlockHolder, ...]]  # Every held GPU block -> its holders.
    cpu_owners: dict[int, tuple[BlockHolder, ...]]  # The same for the CPU swap pool.
    orphaned_gpu_blocks: tuple[int, ...]  # Held, but by fewer live tables than its ref count.
    orphaned_cpu_blocks: tuple[int, ...]
    problems: tuple[str, ...]  # Every inconsistency found, in words (orphans included).

    @property
    def num_orphaned_blocks(self) -> int:
        return len(self.orphaned_gpu_blocks) + len(self.orphaned_cpu_blocks)

    @property
    def ok(self) -> bool:
        return not self.problems


def holders_by_block(samples: Iterable[Sample]) -> tuple[dict[int, list[Sample]], dict[int, list[Sample]]]:
    """(GPU block -> samples whose table holds it, CPU block -> samples), from the tables."""
    gpu: dict[int, list[Sample]] = {}
    cpu: dict[int, list[Sample]] = {}
    for sample in samples:
        for block in held_blocks(sample.block_table):
            gpu.setdefault(block, []).append(sample)
        for block in held_blocks(sample.cpu_table):
            cpu.setdefault(block, []).append(sample)
    return gpu, cpu


def audit_blocks(live_samples: list[Sample], gpu_pool: BlockPool, cpu_pool: BlockPool | None) -> BlockAudit:
    """Checks both pools against the tables of `live_samples` (the scheduler's registry)."""
    problems: list[str] = []
    for sample in live_samples:
        if sample.is_finished:
            problems.append(f"{sample.label} is finished ({sample.status.name}) but still registered")
    gpu, cpu = holders_by_block(live_samples)
    orphaned_gpu = _check_pool("GPU", gpu_pool, gpu, problems)
    orphaned_cpu = _check_pool("CPU", cpu_pool, cpu, problems) if cpu_pool is not None else ()
    if cpu_pool is None and cpu:
        problems.append(f"{len(cpu)} CPU blocks held, but there is no CPU pool")
    return BlockAudit(_owners(gpu), _owners(cpu), orphaned_gpu, orphaned_cpu, tuple(problems))


def ledger_balances(live_samples: list[Sample], gpu_pool: BlockPool, cpu_pool: BlockPool | None) -> bool:
    """Whether audit_blocks would find nothing wrong (no finished sample registered,
    every block's ref count equal to its live holders, no held block free or outside
    its pool), in O(held blocks) with C-level loops rather than a Python walk over every
    block of both pools."""
    if any(s.is_finished for s in live_samples):
        return False
    gpu = Counter(chain.from_iterable(s.block_table for s in live_samples))
    cpu = Counter(chain.from_iterable(s.cpu_table for s in live_samples))
    gpu.pop(RELEASED, None)
    cpu.pop(RELEASED, None)
    if cpu_pool is None:
        return not cpu and gpu_pool.accounts_for(gpu)
    return gpu_pool.accounts_for(gpu) and cpu_pool.accounts_for(cpu)


def _check_pool(name: str, pool: BlockPool, holders: dict[int, list[Sample]], problems: list[str]) -> tuple[int, ...]:
    orphaned = []
    for block in sorted(b for b in holders if not 0 <= b < pool.num_blocks):
        problems.append(f"{name} block {block} is held but outside the pool (ids 0..{pool.num_blocks - 1})")
    free = set(pool.free_block_ids())
    for block in range(pool.num_blocks):
        refs, held = pool.ref_count(block), len(holders.get(block, ()))
        if refs > held:
            orphaned.append(block)
            problems.append(f"{name} block {block}: ref count {refs} but {held} live holder(s): orphaned")
        elif refs < held:
            problems.append(f"{name} block {block}: ref count {refs} but {held} live holder(s)")
        if held and block in free:
            problems.append(f"{name} block {block} is both free and held")
    return tuple(orphaned)


def _owners(holders: dict[int, list[Sample]]) -> dict[int, tuple[BlockHolder, ...]]:
    return {block: tuple(BlockHolder(s.request.request_id, s.index, s.is_root) for s in samples)
            for block, samples in sorted(holders.items())}
