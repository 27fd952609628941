import math

import pytest
from .scheduler_testkit import (
    LABELS,
    NO_EOS,
    FakeWorker,
    Run,
    WorkerRequest,
    build_scheduler,
    hash_token,
    make_scheduler,
    named,
    names,
    params,
    run_until_done,
    sequence_tokens,
    step,
)

from llmserve.contract.outputs import ErrorCode, FinishReason, TokenLogprobs
from llmserve.contract.plan import CachedRequestData, NewRequestData, SampledToken, StepResult
from llmserve.scheduler.config import SchedulerConfig
from llmserve.scheduler.request import RequestStatus

STOP, LENGTH, ABORT, ERROR = (
    FinishReason.STOP,
    FinishReason.LENGTH,
    FinishReason.ABORT,
    FinishReason.ERROR,
)


def scheduled(plan) -> dict[str, int]:
    """request id -> tokens scheduled, new requests and cached ones alike."""
    return {LABELS[r.seq_id]: r.num_scheduled_tokens for r in plan.new_requests + plan.cached_requests}


# ---- continuous batching ----


def test_request_added_midway_joins_next_step():
    sched = make_scheduler()
    worker = FakeWorker(4, logprobs=True)
    run = Run()
    sched.add_request("a", [1, 2, 3, 4, 5], params(max_tokens=3))
    p0 = step(sched, worker, run)
    assert p0.step_id == 0
    assert named(p0.new_requests) == [
        NewRequestData("a", [1, 2, 3, 4, 5], 5, p0.new_requests[0].sampling, [0, 1], 0, 5)
    ]
    assert p0.cached_requests == [] and p0.finished_seq_ids == []
    a0 = run.tokens["a"][0]
    assert run.outputs[0].logprobs == [TokenLogprobs(a0, -0.5)]

    sched.add_request("b", [6, 7, 8], params(max_tokens=2))
    p1 = step(sched, worker, run)
    assert named(p1.cached_requests) == [CachedRequestData("a", [], 5, 1)]
    assert [(LABELS[r.seq_id], r.token_ids, r.block_ids, r.num_scheduled_tokens)
            for r in p1.new_requests] == [("b", [6, 7, 8], [2], 3)]

    p2 = step(sched, worker, run)
    assert p2.new_requests == []
    assert named(p2.cached_requests) == [CachedRequestData("a", [], 6, 1), CachedRequestData("b", [], 3, 1)]
    assert run.finish == {"a": LENGTH, "b": LENGTH}
    assert len(run.tokens["a"]) == 3 and len(run.tokens["b"]) == 2
    assert sched.stats().num_free_blocks == 64  # Freed as soon as they finished.

    assert not sched.has_unfinished_requests()
    p3 = sched.schedule()
    assert p3.is_empty and names(p3.finished_seq_ids) == ["a", "b"]


def test_worker_sampling_params_follow_request():
    sched = make_scheduler()
    sched.add_request("a", [1], params(temperature=0.0, top_p=0.5, top_k=3, seed=7, logprobs=2))
    sampling = sched.schedule().new_requests[0].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed, sampling.logprobs) == (
        0.0, 0.5, 3, 7, 2
    )


def test_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    worker, run = FakeWorker(4), Run()
    for rid in ("r0", "r1", "r2"):
        sched.add_request(rid, [1, 2], params(max_tokens=3))
    p0 = step(sched, worker, run)
    assert names(p0.new_requests) == ["r0", "r1"]
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting) == (2, 1)
    assert scheduled(step(sched, worker, run)) == {"r0": 1, "r1": 1}
    assert scheduled(step(sched, worker, run)) == {"r0": 1, "r1": 1}
    p3 = step(sched, worker, run)  # r0 and r1 finished last step.
    assert names(p3.finished_seq_ids) == ["r0", "r1"]
    assert names(p3.new_requests) == ["r2"]


def test_chunked_prefill_splits_long_prompt_after_decodes():
    sched = make_scheduler(max_num_batched_tokens=8)
    worker, run = FakeWorker(4), Run()
    sched.add_request("a", [1, 2, 3], params(max_tokens=10))
    step(sched, worker, run)
    sched.add_request("b", list(range(20)), params(max_tokens=2))
    p1 = step(sched, worker, run)
    assert named(p1.cached_requests) == [CachedRequestData("a", [], 3, 1)]
    b = p1.new_requests[0]
    assert (LABELS[b.seq_id], b.block_ids, b.num_computed_tokens, b.num_scheduled_tokens) == ("b", [1, 2], 0, 7)
    assert "b" not in run.tokens  # Mid-prompt: nothing sampled.
    p2 = step(sched, worker, run)
    assert named(p2.cached_requests) == [CachedRequestData("a", [3], 4, 1), CachedRequestData("b", [4, 5], 7, 7)]
    p3 = step(sched, worker, run)
    assert named(p3.cached_requests) == [CachedRequestData("a", [], 5, 1), CachedRequestData("b", [6], 14, 6)]
    assert len(run.tokens["b"]) == 1  # Prompt done: first token.
    assert all(p.total_scheduled_tokens <= 8 for p in run.plans)
    run_until_done(sched, worker, run)
    assert run.finish == {"a": LENGTH, "b": LENGTH}


def test_without_chunking_a_prompt_waits_for_the_whole_budget():
    sched = make_scheduler(max_model_len=20, max_num_batched_tokens=20, enable_chunked_prefill=False)
    worker, run = FakeWorker(4), Run()
    sched.add_request("a", [1, 2, 3], params(max_tokens=2))
    step(sched, worker, run)
    sched.add_request("b", list(range(20)), params(max_tokens=5))
    assert scheduled(step(sched, worker, run)) == {"a": 1}  # b needs 20, 19 left.
    assert scheduled(step(sched, worker, run)) == {"b": 20}
    assert run.finish == {"a": LENGTH, "b": LENGTH}  # b hit max_model_len at once.
    assert run.tokens["b"] == [hash_token(worker_req(list(range(20))), 0)]


def worker_req(tokens):
    return WorkerRequest("x", tokens, len(tokens), [], len(tokens))


def test_config_validation():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        build_scheduler(dict(max_model_len=100, max_num_batched_tokens=50, enable_chunked_prefill=False), 8, NO_EOS)
    with pytest.raises(ValueError, match="block_size"):
        build_scheduler(dict(max_model_len=100, block_size=0), 8, NO_EOS)
    with pytest.raises(TypeError):
        SchedulerConfig(64)  # Keyword-only.


# ---- stop conditions ----


@pytest.mark.parametrize(
    "sampling, sequence, tokens, reason, stop_token_id",
    [
        (params(max_tokens=5), [5, 2, 7], [5, 2], STOP, 2),
        (params(max_tokens=3, ignore_eos=True), [5, 2, 7], [5, 2, 7], LENGTH, -1),
        (params(max_tokens=5, stop_token_ids=(7,)), [5, 7, 2], [5, 7], STOP, 7),
        (params(max_tokens=1, stop_token_ids=(2,)), [2], [2], STOP, 2),  # eos first.
        (params(max_tokens=2), [5, 6, 7], [5, 6], LENGTH, -1),
        (params(max_tokens=9), [5, 6, 7, 8], [5, 6, 7], LENGTH, -1),  # max_model_len=8.
    ],
)
def test_stop_conditions(sampling, sequence, tokens, reason, stop_token_id):
    sched = make_scheduler(eos=(2, 3), max_model_len=8)
    worker = FakeWorker(4, sequence_tokens({"r": sequence}))
    sched.add_request("r", [1, 1, 1, 1, 1], sampling)
    run = run_until_done(sched, worker)
    assert run.tokens["r"] == tokens
    assert run.finish["r"] == reason
    assert run.outputs[-1].stop_token_id == stop_token_id
    assert all(not out.finished for out in run.outputs[:-1])
    assert sched.stats().num_free_blocks == 64


# ---- preemption ----


def test_preemption_victim_is_latest_arrival_and_comes_back_in_full():
    sched = make_scheduler(num_blocks=3)
    worker, run = FakeWorker(4), Run()
    for rid in ("a", "b", "c"):
        sched.add_request(rid, [1, 2, 3, 4], params(max_tokens=3))
    p0 = step(sched, worker, run)
    assert [r.block_ids for r in p0.new_requests] == [[0], [1], [2]]
    p1 = step(sched, worker, run)
    # a needs a 2nd block: c (latest) goes; b needs one too and is now the latest itself.
    assert named(p1.cached_requests) == [CachedRequestData("a", [2], 4, 1)]
    assert p1.new_requests == []
    assert names(p1.finished_seq_ids) == ["c", "b"]
    assert [r.label for r in sched.waiting] == ["b", "c"]
    stats = sched.stats()
    assert (stats.num_preemptions, stats.num_running, stats.num_waiting) == (2, 1, 2)
    assert sched.sample("b").num_computed_tokens == 0
    p2 = step(sched, worker, run)
    assert scheduled(p2) == {"a": 1}  # b needs 2 blocks, 1 free.
    assert run.finish == {"a": LENGTH}
    b_tokens = list(run.tokens["b"])
    assert len(b_tokens) == 1
    p3 = step(sched, worker, run)
    assert names(p3.finished_seq_ids) == ["a"]
    assert [(LABELS[r.seq_id], r.token_ids, r.num_prompt_tokens, r.block_ids, r.num_computed_tokens,
             r.num_scheduled_tokens) for r in p3.new_requests] == [
        ("b", [1, 2, 3, 4, b_tokens[0]], 4, [1, 2], 0, 5)
    ]
    run_until_done(sched, worker, run)
    assert run.finish == {"a": LENGTH, "b": LENGTH, "c": LENGTH}
    assert sched.stats().num_free_blocks == 3


def _workload(sched):
    prompts = {"r0": [3, 1, 4, 1, 5], "r1": [9, 2, 6, 5, 3, 5], "r2": [8, 9, 7, 9, 3, 2, 3], "r3": [8, 4]}
    for rid, prompt in prompts.items():
        sched.add_request(rid, prompt, params(max_tokens=8, ignore_eos=True))
    return prompts


def test_tiny_pool_preempts_and_matches_big_pool():
    big = make_scheduler(num_blocks=64)
    _workload(big)
    reference = run_until_done(big, FakeWorker(4))
    assert big.stats().num_preemptions == 0

    tiny = make_scheduler(num_blocks=6)
    prompts = _workload(tiny)
    run = run_until_done(tiny, FakeWorker(4))
    stats = tiny.stats()
    assert stats.num_preemptions > 0
    assert run.tokens == reference.tokens
    assert run.finish == reference.finish == dict.fromkeys(prompts, LENGTH)
    assert stats.num_free_blocks == 6 and stats.num_finished == 4
    assert stats.generation_tokens_total == 32
    assert stats.prompt_tokens_total == sum(map(len, prompts.values()))

    # Re-sent requests carry prompt + the outputs made before their preemption.
    resent = [r for p in run.plans for r in p.new_requests if len(r.token_ids) > r.num_prompt_tokens]
    assert resent
    for r in resent:
        prompt = prompts[LABELS[r.seq_id]]
        assert r.num_prompt_tokens == len(prompt)
        assert r.token_ids == prompt + reference.tokens[LABELS[r.seq_id]][: len(r.token_ids) - len(prompt)]
        assert r.num_computed_tokens == 0


# ---- abort and errors ----


def test_abort_mid_generation_frees_blocks_and_is_reported():
    sched = make_scheduler(num_blocks=10)
    worker, run = FakeWorker(4), Run()
    sched.add_request("a", list(range(6)), params(max_tokens=10))
    sched.add_request("b", [1, 2], params(max_tokens=10))
    step(sched, worker, run)
    step(sched, worker, run)
    assert sched.stats().num_free_blocks == 7
    [out] = sched.abort_requests(["a", "nope"])
    assert (out.request_id, out.finish_reason, out.new_token_ids) == ("a", ABORT, [])
    assert sched.stats().num_free_blocks == 9
    assert sched.abort_requests(["a"]) == []
    p = step(sched, worker, run)
    assert names(p.finished_seq_ids) == ["a"]
    assert scheduled(p) == {"b": 1}
    assert sched.stats().num_aborted == 1


def test_token_for_request_aborted_during_step_is_ignored():
    sched = make_scheduler()
    worker = FakeWorker(4)
    sched.add_request("a", [1, 2], params())
    sched.add_request("b", [3, 4], params())
    plan = sched.schedule()
    result = worker.execute(plan)
    assert names(result.sampled) == ["a", "b"]
    sched.abort_requests(["a"])
    outputs = sched.update_from_output(plan, result)
    assert [o.request_id for o in outputs] == ["b"]
    assert sched.get_request("a") is None
    assert sched.stats().generation_tokens_total == 1


def test_abort_waiting_request():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request("a", [1], params())
    sched.add_request("b", [1], params())
    sched.schedule()
    [out] = sched.abort_requests(["b"])
    assert out.finish_reason == ABORT
    assert sched.stats().num_waiting == 0


def test_tokens_for_unplanned_or_mid_prompt_requests_are_ignored():
    sched = make_scheduler(max_num_batched_tokens=4)
    sched.add_request("a", list(range(10)), params())
    plan = sched.schedule()
    result = StepResult(plan.step_id, [SampledToken(sched.sample("a").seq_id, 5), SampledToken(2**63, 5)])
    assert sched.update_from_output(plan, result) == []
    with pytest.raises(ValueError, match="step"):
        sched.update_from_output(plan, StepResult(plan.step_id + 1))


def test_fail_requests_and_step_error():
    sched = make_scheduler()
    for rid in ("a", "b", "c"):
        sched.add_request(rid, [1, 2], params())
    [out] = sched.fail_requests(["c"], "boom")
    assert (out.finish_reason, out.error) == (ERROR, "boom")
    plan = sched.schedule()
    assert plan.finished_seq_ids == []  # The worker never saw c: nothing to drop.
    outputs = sched.update_from_output(plan, StepResult(plan.step_id, error="worker died"))
    assert [(o.request_id, o.finish_reason, o.error) for o in outputs] == [
        ("a", ERROR, "worker died"), ("b", ERROR, "worker died")
    ]
    assert {o.error_code for o in outputs} == {ErrorCode.INTERNAL}
    assert not sched.has_unfinished_requests()
    assert sched.stats().num_free_blocks == 64 and sched.stats().num_failed == 3


def test_prompt_bigger_than_cache_is_rejected():
    sched = make_scheduler(num_blocks=2)
    with pytest.raises(ValueError) as err:
        sched.add_request("big", list(range(9)), params())
    assert str(err.value) == (
        "request 'big': 9 tokens need 3 KV cache blocks but the cache has only 2 blocks of 4 tokens"
    )
    sched.add_request("ok", list(range(8)), params(max_tokens=1))
    assert sched.stats().num_waiting == 1


def test_request_outgrowing_cache_fails_instead_of_looping():
    sched = make_scheduler(num_blocks=2)
    worker = FakeWorker(4)
    sched.add_request("r", list(range(7)), params(max_tokens=5))
    run = run_until_done(sched, worker, max_steps=10)
    assert len(run.tokens["r"]) == 2  # 9 tokens would need a 3rd block.
    last = run.outputs[-1]
    assert (last.new_token_ids, last.finish_reason) == (run.tokens["r"][1:], ERROR)
    assert last.error == "9 tokens need 3 KV cache blocks but the cache has only 2 blocks of 4 tokens"
    assert sched.stats().num_free_blocks == 2
    assert sched.stats().num_failed == 1


def test_empty_plan_keeps_finished_ids_for_the_next_plan():
    sched = make_scheduler()
    sched.add_request("a", [1], params())
    step(sched, FakeWorker(4), Run())  # The worker now holds a.
    sched.abort_requests(["a"])
    assert names(sched.schedule().finished_seq_ids) == ["a"]  # Empty: the worker may not see it.
    sched.add_request("b", [1], params())
    plan = sched.schedule()
    assert names(plan.finished_seq_ids) == ["a"] and names(plan.new_requests) == ["b"]
    assert sched.schedule().finished_seq_ids == []


def test_add_request_validation():
    sched = make_scheduler(max_model_len=8)
    sched.add_request("a", [1], params())
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request("a", [1], params())
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add_request("b", [], params())
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request("b", list(range(9)), params())
    with pytest.raises(ValueError, match="max_tokens"):
        sched.add_request("b", [1], params(max_tokens=0))


def test_id_reused_after_finish():
    sched = make_scheduler()
    worker = FakeWorker(4)
    sched.add_request("a", [1, 2], params(max_tokens=1))
    run_until_done(sched, worker)
    sched.add_request("a", [1, 2], params(max_tokens=1))
    plan = step(sched, worker, Run())
    assert names(plan.finished_seq_ids) == ["a"] and names(plan.new_requests) == ["a"]


def test_stats_counts():
    sched = make_scheduler()
    for rid in ("a", "b"):
        sched.add_request(rid, [1, 2, 3], params(max_tokens=4))
    run_until_done(sched, FakeWorker(4))
    s = sched.stats()
    assert (s.num_steps, s.num_finished, s.prompt_tokens_total, s.generation_tokens_total) == (4, 2, 6, 8)
    assert (s.num_waiting, s.num_running, s.num_total_blocks, s.kv_cache_usage) == (0, 0, 64, 0.0)
    assert math.isclose(s.kv_cache_usage, 0.0)


# ---- the KV block audit ----


def _holding_blocks(max_tokens: int):
    """A scheduler 3 steps into "a" (one sample) and "g" (two samples sharing their prompt
    blocks), with the worker and run that stepped it."""
    sched = make_scheduler(num_blocks=16)
    worker, run = FakeWorker(4), Run(by_sample=True)
    sched.add_request("a", [1, 2, 3, 4, 5], params(max_tokens=max_tokens))
    sched.add_request("g", [1, 2, 3, 4, 5, 6], params(max_tokens=max_tokens), n=2)
    for _ in range(3):
        step(sched, worker, run)
    return sched, worker, run


def test_block_audit_names_each_blocks_holders_and_finds_orphans():
    sched, worker, run = _holding_blocks(max_tokens=4)
    audit = sched.audit()
    assert audit.ok and audit.num_orphaned_blocks == 0
    holders = {(h.request_id, h.index) for owners in audit.gpu_owners.values() for h in owners}
    assert holders == {("a", 0), ("g", 0), ("g", 1)}
    shared = [b for b, owners in audit.gpu_owners.items() if {h.request_id for h in owners} == {"g"} and len(owners) == 2]
    assert shared, "the two samples of g share their prompt blocks"
    assert set(audit.gpu_owners) == set(range(16)) - set(sched.kv.pool.free_block_ids())

    # A leak: a block taken from the pool for no request, and a finished request's table
    # whose blocks were never given back.
    [leaked] = sched.kv.pool.allocate(1)
    a = sched.sample("a")
    run_until_done(sched, worker, run)
    audit = sched.audit()
    assert audit.orphaned_gpu_blocks == (leaked,) and not audit.ok
    assert any(f"block {leaked}" in p and "orphaned" in p for p in audit.problems)
    assert a.is_finished and not a.block_table  # a's own blocks were freed.


def _unbalance(sched, fault: str) -> None:
    """Breaks the block ledger of a scheduler whose samples hold blocks, one way."""
    a, g0 = sched.sample("a"), sched.sample("g#0")
    shared = next(b for b in g0.block_table if sched.kv.pool.ref_count(b) == 2)
    if fault == "orphan":  # a block taken for no one
        sched.kv.pool.allocate(1)
    elif fault == "too_few_refs":  # held by g's two samples, counted once
        sched.kv.pool.free([shared])
    elif fault == "held_and_free":  # a's last block given back while a's table holds it
        sched.kv.pool.free([a.block_table[-1]])
    elif fault == "outside_pool":
        a.block_table.append(sched.kv.pool.num_blocks + 3)
    elif fault == "swapped_without_pool":
        a.cpu_table.append(0)
    elif fault == "finished_registered":
        a.status = RequestStatus.FINISHED_ABORTED


@pytest.mark.parametrize("fault", ["orphan", "too_few_refs", "held_and_free", "outside_pool", "swapped_without_pool",
                                   "finished_registered"])
def test_quick_ledger_check_agrees_with_the_audit(fault):
    # The periodic gauge asks the O(held blocks) check first and audits only when it
    # fails: it must fail exactly when the audit finds a problem.
    sched = _holding_blocks(max_tokens=8)[0]
    assert sched.audit().ok and sched.unbalanced_audit() is None and sched.num_orphaned_blocks() == 0
    _unbalance(sched, fault)
    audit = sched.unbalanced_audit()
    assert audit is not None and not audit.ok, fault
    assert audit.problems == sched.audit().problems
    assert sched.num_orphaned_blocks() == (1 if fault == "orphan" else 0)
    if fault == "outside_pool":
        assert any("outside the pool" in p for p in audit.problems)
