"""Random workloads on small pools: the block accounting holds after every step, every
request ends exactly once with the tokens a lone run would give, and all blocks return."""

from types import SimpleNamespace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llmserve.contract.outputs import FinishReason
from llmserve.scheduler.request import RequestStatus
from llmserve.scheduler.scheduler import Scheduler

from .scheduler_testkit import (FakeWorker, Run, build_scheduler, draw_batching_config, interrupt_some_runs,
                               lone_run_tokens, params, run_until_done, step, table_fits)


@st.composite
def workloads(draw):
    config = SimpleNamespace(**draw_batching_config(draw, max_seqs=4))
    num_blocks = draw(st.integers(1, 16))
    eos = draw(st.integers(0, 96))
    request = st.tuples(st.integers(1, 20), st.integers(1, 12))  # prompt length, max_tokens
    events = st.tuples(st.lists(request, max_size=3), st.lists(st.integers(0, 20), max_size=2))
    interrupts = draw(st.booleans())  # Multi-step runs cut short (as arrivals do).
    return config, num_blocks, eos, interrupts, draw(st.lists(events, min_size=1, max_size=12))


def check_invariants(sched: Scheduler) -> None:
    kv, config = sched.kv, sched.config
    held = set()
    for request in sched.running:
        assert request.status is RequestStatus.RUNNING
        table = kv.get_block_ids(request)
        assert table_fits(len(table), request.num_computed_tokens, sched.cache.block_size, config.num_scheduler_steps,
                          config.num_speculative_tokens)
        assert held.isdisjoint(table)
        held.update(table)
        assert all(kv.pool.ref_count(b) == 1 for b in table)
    for request in sched.waiting:
        assert request.status is RequestStatus.WAITING
        assert kv.get_block_ids(request) == [] and request.num_computed_tokens == 0
    assert len(held) + kv.num_free_blocks == kv.num_total_blocks
    assert held.isdisjoint(kv.pool.free_block_ids())
    assert len(sched.running) <= config.max_num_seqs
    orders = [r.arrival_order for r in sched.running]
    assert orders == sorted(orders)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_blocks_consistent(workload):
    config, num_blocks, eos, interrupts, events = workload
    sched = build_scheduler(vars(config), num_blocks, [eos])
    worker, run = FakeWorker(config.block_size, steps_to_run=interrupt_some_runs if interrupts else None), Run()
    added, rejected = {}, []
    for new_requests, aborts in events:
        for prompt_len, max_tokens in new_requests:
            n = len(added) + len(rejected)
            rid = f"r{n}"
            prompt = [(n * 7 + i) % 50 for i in range(prompt_len)]
            too_big = -(-prompt_len // config.block_size) > num_blocks
            try:
                sched.add_request(rid, prompt, params(max_tokens=max_tokens))
                assert not too_big
                added[rid] = (prompt, max_tokens)
            except ValueError:
                assert too_big
                rejected.append(rid)
        run.record(sched.abort_requests([f"r{i}" for i in aborts]))
        plan = step(sched, worker, run)
        assert plan.total_scheduled_tokens <= config.max_num_batched_tokens
        check_invariants(sched)
    run_until_done(sched, worker, run, max_steps=2_000, check=check_invariants)

    assert sched.kv.num_free_blocks == num_blocks
    assert set(run.finish) == set(added)
    for rid, (prompt, max_tokens) in added.items():
        expected = lone_run_tokens(prompt, max_tokens, eos)
        got = run.tokens.get(rid, [])
        if run.finish[rid] in (FinishReason.STOP, FinishReason.LENGTH):
            assert got == expected
        else:
            assert got == expected[: len(got)]
    stats = sched.stats()
    assert stats.num_finished + stats.num_aborted + stats.num_failed == len(added)
    for plan in run.plans:
        assert plan.total_scheduled_tokens <= config.max_num_batched_tokens
