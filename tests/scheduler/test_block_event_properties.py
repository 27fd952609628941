"""The prefix cache's block events are exactly consistent with the pool: under random
workloads (shared prefixes, n > 1, tiny pools so blocks are evicted, swap and recompute
preemption, aborts, failed steps that reset the cache), a subscriber replaying every
event since the start, or a snapshot then every event after it, holds exactly the hashes
the pool caches, after every step. Without prefix caching there are no events."""

from types import SimpleNamespace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmserve.contract.block_hash import prompt_block_hashes
from llmserve.contract.plan import StepResult
from llmserve.scheduler.block_events import AllBlocksCleared, BlockRemoved, BlockStored, replay

from .scheduler_testkit import (
    PROPERTY_MAX_MODEL_LEN,
    FakeWorker,
    Run,
    build_scheduler,
    draw_batching_config,
    interrupt_some_runs,
    make_scheduler,
    params,
)

PREFIXES = ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5])


@st.composite
def workloads(draw):
    config = SimpleNamespace(
        **draw_batching_config(draw, max_seqs=6),
        enable_prefix_caching=True,
        preemption_mode=draw(st.sampled_from(["auto", "swap", "recompute"])),
    )
    num_blocks = draw(st.integers(2, 16))
    num_cpu_blocks = draw(st.integers(0, 12))
    interrupts = draw(st.booleans())
    request = st.tuples(st.integers(0, 1), st.integers(0, 12), st.integers(1, 8), st.integers(1, 10),
                        st.integers(1, 3))
    # Per round: new requests, aborts, whether the step's result comes back as a failure.
    rounds = st.tuples(st.lists(request, max_size=3), st.lists(st.integers(0, 20), max_size=2),
                       st.integers(0, 9).map(lambda x: x == 0))
    return config, num_blocks, num_cpu_blocks, interrupts, draw(st.lists(rounds, min_size=1, max_size=14))


def cached_hashes(sched) -> set:
    return set(sched.kv.pool._cached)


def check_snapshot(sched) -> None:
    """A snapshot rebuilds the pool's hashes, and lists a cached parent before its child."""
    snapshot = sched.cached_block_events()
    assert replay([AllBlocksCleared(), *snapshot]) == cached_hashes(sched)
    seen = set()
    for event in snapshot:
        assert event.parent_hash is None or event.parent_hash in seen or event.parent_hash not in cached_hashes(sched)
        seen.add(event.block_hash)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_replaying_block_events_gives_exactly_the_cached_hashes(workload):
    config, num_blocks, num_cpu_blocks, interrupts, rounds = workload
    sched = build_scheduler(vars(config), num_blocks, [10_000], num_cpu_blocks=num_cpu_blocks)
    worker = FakeWorker(config.block_size, steps_to_run=interrupt_some_runs if interrupts else None)
    run = Run(by_sample=True)
    from_start: set = set()  # A subscriber since the scheduler started.
    late: set | None = None  # One that joined with a snapshot midway.
    num_added = 0

    def step(fail: bool) -> None:
        nonlocal late
        plan = sched.schedule()
        if not plan.is_empty:
            result = worker.execute(plan)
            if fail:  # The worker ran it, but its result is lost: the cache is reset.
                result = StepResult(plan.step_id, error="injected failure")
            run.record(sched.update_from_output(plan, result))
        events = sched.take_block_events()
        replay(events, from_start)
        if late is not None:
            replay(events, late)
        assert from_start == cached_hashes(sched)
        assert late is None or late == cached_hashes(sched)
        for event in events:
            if isinstance(event, BlockStored):
                assert len(event.block_hash) == 32 and (event.parent_hash is None or len(event.parent_hash) == 32)
        if late is None and sched.kv.pool.num_cached_blocks:
            check_snapshot(sched)
            late = replay([AllBlocksCleared(), *sched.cached_block_events()])

    for new_requests, aborts, fail in rounds:
        for which, prefix_len, tail_len, max_tokens, n in new_requests:
            prompt = (PREFIXES[which][:prefix_len] + [(num_added * 7 + i) % 50 for i in range(tail_len)])
            prompt = prompt[: PROPERTY_MAX_MODEL_LEN - 1]
            try:
                sched.add_request(f"r{num_added}", prompt, params(max_tokens=max_tokens), n=n)
            except ValueError:
                pass  # Too big for this pool: nothing queued, nothing cached.
            num_added += 1
        run.record(sched.abort_requests([f"r{i}" for i in aborts]))
        step(fail)
    for _ in range(3_000):
        if not sched.has_unfinished_requests():
            break
        step(False)
    assert not sched.has_unfinished_requests()
    check_snapshot(sched)
    sched.reset_prefix_cache()
    events = sched.take_block_events()
    assert events == [AllBlocksCleared()]
    assert replay(events, from_start) == set() == cached_hashes(sched)


def test_a_stored_event_names_the_prompt_block_and_its_parent():
    sched = make_scheduler(num_blocks=16, block_size=4, enable_prefix_caching=True)
    prompt = list(range(100, 110))
    sched.add_request("a", prompt, params(max_tokens=1))
    worker, run = FakeWorker(4), Run()
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        run.record(sched.update_from_output(plan, worker.execute(plan)))
    h0, h1 = prompt_block_hashes(prompt, 4)
    assert sched.take_block_events() == [BlockStored(h0, None), BlockStored(h1, h0)]


def test_an_evicted_block_is_removed():
    sched = make_scheduler(num_blocks=3, block_size=4, enable_prefix_caching=True)
    worker, run = FakeWorker(4), Run()
    for rid, prompt in (("a", [1, 2, 3, 4, 5]), ("b", [6, 7, 8, 9, 10, 11, 12, 13, 14])):
        sched.add_request(rid, prompt, params(max_tokens=1))
        while sched.has_unfinished_requests():
            plan = sched.schedule()
            run.record(sched.update_from_output(plan, worker.execute(plan)))
    (a0,) = prompt_block_hashes([1, 2, 3, 4, 5], 4)
    b0, b1 = prompt_block_hashes([6, 7, 8, 9, 10, 11, 12, 13, 14], 4)
    events = sched.take_block_events()
    assert events[0] == BlockStored(a0, None)
    assert events.count(BlockStored(b0, None)) == 1 and BlockStored(b1, b0) in events
    # b needs all 3 blocks: a's cached block is reallocated, so its hash goes first.
    assert events.index(BlockRemoved(a0)) < events.index(BlockStored(b0, None))
    assert replay(events) == cached_hashes(sched) == {b0, b1}


def test_no_events_without_prefix_caching():
    sched = make_scheduler(num_blocks=4, block_size=2, enable_prefix_caching=False)
    worker, run = FakeWorker(2), Run()
    for rid in "abc":
        sched.add_request(rid, [1, 2, 3, 4, 5], params(max_tokens=2))
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        run.record(sched.update_from_output(plan, worker.execute(plan)))
    sched.reset_prefix_cache()
    assert sched.take_block_events() == []
    assert sched.cached_block_events() == []
