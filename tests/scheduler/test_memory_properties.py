"""Random workloads with n > 1, shared prefixes, priorities, aborts, tiny GPU and CPU
pools, swap and recompute preemption, prefix caching and sliding windows (blocks left
behind released as sequences grow). After every step: ref counts
equal the number of tables holding each block, no block is both free and held, the CPU
pool is consistent, and the fake worker reads back exactly the tokens each sequence
wrote (so sharing, copy-on-write, swaps and prefix hits moved the right KV). At the end
every block is free and each sample has the tokens a lone run with its seed gives. With a
window, a sequence holds no more blocks than its window and its lookahead span."""

from types import SimpleNamespace

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmserve.contract.outputs import FinishReason
from llmserve.scheduler.block_pool import held_blocks
from llmserve.scheduler.request import RequestStatus
from llmserve.scheduler.scheduler import Scheduler

from .scheduler_testkit import (
    PROPERTY_MAX_MODEL_LEN,
    FakeWorker,
    build_scheduler,
    Run,
    draw_batching_config,
    interrupt_some_runs,
    lone_run_tokens,
    params,
    run_until_done,
    step,
    table_fits,
)


@st.composite
def workloads(draw):
    config = SimpleNamespace(
        **draw_batching_config(draw, max_seqs=6),
        enable_prefix_caching=draw(st.booleans()),
        preemption_mode=draw(st.sampled_from(["auto", "swap", "recompute"])),
        sliding_window=draw(st.sampled_from([0, 0, 1, 3, 6])),
    )
    num_blocks = draw(st.integers(2, 16))
    num_cpu_blocks = draw(st.integers(0, 12))
    eos = draw(st.integers(0, 96))
    interrupts = draw(st.booleans())  # Multi-step runs cut short (as arrivals do).
    # prompt: a shared prefix (one of two) of some length, then a private tail.
    request = st.tuples(st.integers(0, 1), st.integers(0, 12), st.integers(1, 8),
                        st.integers(1, 10), st.integers(1, 3), st.integers(0, 2), st.booleans())
    events = st.tuples(st.lists(request, max_size=3), st.lists(st.integers(0, 20), max_size=2))
    return config, num_blocks, num_cpu_blocks, eos, interrupts, draw(st.lists(events, min_size=1, max_size=12))


def check_invariants(sched: Scheduler) -> None:
    audit = sched.audit()  # The product's own ledger check agrees with the checks below.
    assert audit.ok and audit.num_orphaned_blocks == 0, audit.problems
    assert sched.unbalanced_audit() is None  # The gauge's quick check says the same.
    kv = sched.kv
    tables, cpu_tables = kv.tables(), kv.cpu_tables()
    running = {r.seq_id for r in sched.running}
    swapped = {r.seq_id for unit in sched.swapped for r in unit}
    assert set(tables) == running, "only running sequences hold GPU blocks"
    assert set(cpu_tables) == swapped, "only swapped sequences hold CPU blocks"
    window, bs = sched.cache.sliding_window, sched.cache.block_size
    for request in sched.running:
        assert request.status is RequestStatus.RUNNING
        assert table_fits(len(tables[request.seq_id]), request.num_computed_tokens, bs,
                          sched.config.num_scheduler_steps, sched.config.num_speculative_tokens)
        if window:  # held: the next query's window (W - 1 keys back) to the table's end
            lookahead = len(tables[request.seq_id]) * bs - request.num_computed_tokens
            assert len(held_blocks(tables[request.seq_id])) <= -(-(window - 1 + lookahead) // bs) + 1
    for request in sched.waiting:
        assert request.status is RequestStatus.WAITING and request.num_computed_tokens == 0
    for unit in sched.swapped:
        assert unit and len({r.request.request_id for r in unit}) == 1
        assert all(r.status is RequestStatus.SWAPPED for r in unit)
    for pool, held_tables in ((kv.pool, tables), (kv.cpu_pool, cpu_tables)):
        if pool is None:
            assert not held_tables
            continue
        holders = Counter(b for table in held_tables.values() for b in held_blocks(table))
        for block in range(pool.num_blocks):
            assert pool.ref_count(block) == holders[block], f"block {block}"
        free = pool.free_block_ids()
        assert set(free).isdisjoint(holders)
        assert len(free) + len(holders) == pool.num_blocks
        for block in range(pool.num_blocks):
            block_hash = pool.block_hash(block)
            assert block_hash is None or pool.lookup(block_hash) == block
    assert len(sched.running) <= sched.config.max_num_seqs
    keys = [r.key for r in sched.running]
    assert keys == sorted(keys)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_multi_sample_workloads_keep_memory_consistent(workload):
    config, num_blocks, num_cpu_blocks, eos, interrupts, events = workload
    sched = build_scheduler(vars(config), num_blocks, [eos], num_cpu_blocks=num_cpu_blocks)
    worker = FakeWorker(config.block_size, steps_to_run=interrupt_some_runs if interrupts else None,
                        window=config.sliding_window)
    run = Run(by_sample=True)
    prefixes = ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5])
    added, rejected = {}, []
    for new_requests, aborts in events:
        for which, prefix_len, tail_len, max_tokens, n, priority, seeded in new_requests:
            k = len(added) + len(rejected)
            rid = f"r{k}"
            prompt = prefixes[which][:prefix_len] + [(k * 7 + i) % 50 for i in range(tail_len)]
            prompt = prompt[: PROPERTY_MAX_MODEL_LEN - 1]
            seed = k if seeded else None
            too_big = n * -(-len(prompt) // config.block_size) > num_blocks or n > config.max_num_seqs
            try:
                sched.add_request(rid, prompt, params(max_tokens=max_tokens, seed=seed), n=n,
                                  priority=priority)
                assert not too_big
                added[rid] = (prompt, max_tokens, n, seed)
            except ValueError:
                assert too_big
                rejected.append(rid)
        run.record(sched.abort_requests([f"r{i}" for i in aborts]))
        plan = step(sched, worker, run)
        assert plan.total_scheduled_tokens <= config.max_num_batched_tokens
        check_invariants(sched)
    run_until_done(sched, worker, run, max_steps=3_000, check=check_invariants)

    assert sched.kv.num_free_blocks == num_blocks
    assert sched.kv.num_free_cpu_blocks == num_cpu_blocks
    assert not sched.waiting and not sched.running and not sched.swapped
    for rid, (prompt, max_tokens, n, seed) in added.items():
        for index in range(n):
            key = (rid, index)
            sample_seed = seed + index if seed is not None and n > 1 else seed
            expected = lone_run_tokens(prompt, max_tokens, eos, sample_seed)
            got = run.tokens.get(key, [])
            assert key in run.finish, key
            if run.finish[key] in (FinishReason.STOP, FinishReason.LENGTH):
                assert got == expected, key
            else:
                assert got == expected[: len(got)], key
