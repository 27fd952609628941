"""Multi-step scheduling: one plan asks the worker for several decode steps back to back.

The random-workload property tests draw num_scheduler_steps too (with and without
interrupted runs); these pin the rules one at a time."""

from llmserve.contract.outputs import FinishReason, TokenLogprobs
from llmserve.contract.plan import SampledToken, StepResult

from .scheduler_testkit import (LABELS, FakeWorker, Run, lone_run_tokens, make_scheduler, names, params, run_until_done,
                               step)


def decode_ready(num_scheduler_steps: int = 4, **config):
    """A scheduler with requests a (5-token prompt) and b (3-token prompt) prefilled."""
    sched = make_scheduler(num_scheduler_steps=num_scheduler_steps, **config)
    worker, run = FakeWorker(4, logprobs=True), Run()
    sched.add_request("a", [1, 2, 3, 4, 5], params(max_tokens=12))
    sched.add_request("b", [6, 7, 8], params(max_tokens=12))
    prefill = step(sched, worker, run)
    assert prefill.num_steps == 1  # prompts are never part of a run
    return sched, worker, run


def test_a_decode_only_step_becomes_a_run_with_its_slots_allocated_up_front():
    sched, worker, run = decode_ready(4)
    plan = step(sched, worker, run)
    assert plan.num_steps == 4
    assert [(LABELS[c.seq_id], c.num_computed_tokens, c.num_scheduled_tokens) for c in plan.cached_requests] == [
        ("a", 5, 1), ("b", 3, 1)]
    # a: positions 5..8 need 9 slots (3 blocks of 4; it held 2); b: 3..6 need 7 (2; it held 1).
    assert [len(c.new_block_ids) for c in plan.cached_requests] == [1, 1]
    assert [len(sched.kv.get_block_ids(sched.sample(r))) for r in ("a", "b")] == [3, 2]
    # One output per sequence for the whole run, its tokens in order, with their logprobs.
    outs = run.outputs[-2:]
    assert [len(o.new_token_ids) for o in outs] == [4, 4]
    assert [lp.token_id for lp in outs[0].logprobs] == outs[0].new_token_ids
    a = sched.sample("a")
    assert a.num_computed_tokens == 9 and a.num_tokens == 10  # positions 0..8; its newest token is next


def test_runs_give_the_tokens_single_steps_give():
    for k in (1, 2, 3, 7):
        sched, worker, run = decode_ready(k)
        run_until_done(sched, worker, run)
        assert run.tokens["a"] == lone_run_tokens([1, 2, 3, 4, 5], 12, 10_000)
        assert run.tokens["b"] == lone_run_tokens([6, 7, 8], 12, 10_000)
        assert run.finish == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}
        assert sched.kv.num_free_blocks == sched.kv.num_total_blocks
        # 1 prefill + ceil(11 / k) plans for the 11 decode tokens of each
        assert len(run.plans) == 1 + -(-11 // k)


def test_a_run_stops_where_the_first_sequence_reaches_max_tokens_or_max_model_len():
    sched = make_scheduler(num_scheduler_steps=8, max_model_len=10)
    worker, run = FakeWorker(4), Run()
    sched.add_request("short", [1, 2], params(max_tokens=3))  # 2 tokens left after the prefill
    sched.add_request("long", [3, 4, 5, 6, 7], params(max_tokens=50))  # 4 left before max_model_len
    step(sched, worker, run)
    assert step(sched, worker, run).num_steps == 2
    assert run.finish == {"short": FinishReason.LENGTH}
    assert step(sched, worker, run).num_steps == 2  # long: 8 tokens, 2 more to max_model_len 10
    assert run.finish["long"] == FinishReason.LENGTH and len(run.tokens["long"]) == 5


def test_a_waiting_request_gets_a_single_step_so_its_prompt_runs_now():
    sched, worker, run = decode_ready(4)
    sched.add_request("c", [9, 9, 9], params(max_tokens=2))
    plan = step(sched, worker, run)
    assert plan.num_steps == 1
    assert names(plan.new_requests) == ["c"]


def test_tokens_after_a_stop_are_dropped_and_the_blocks_freed():
    sched, worker, run = decode_ready(4)
    # b's second token of the run is its eos (b sampled one token in the prefill).
    lone = lone_run_tokens([6, 7, 8], 3, 10_000)
    assert lone[2] not in lone[:2]
    sched.get_request("b").eos_token_ids = frozenset({lone[2]})
    before = sched.stats().generation_tokens_total
    plan = step(sched, worker, run)
    assert plan.num_steps == 4
    assert run.finish == {"b": FinishReason.STOP}
    assert run.tokens["b"] == lone  # the worker computed 2 more, which are dropped
    assert sched.stats().generation_tokens_total - before == 4 + 2
    assert sched.get_request("b") is None and "b" not in sched.kv.tables()
    # b's slots are free again; the next plan tells the worker to drop b.
    assert names(step(sched, worker, run).finished_seq_ids) == ["b"]


def test_an_interrupted_run_applies_the_steps_it_ran_and_keeps_its_slots():
    sched, worker, run = decode_ready(4)
    worker.steps_to_run = lambda plan: 1
    plan = step(sched, worker, run)
    assert plan.num_steps == 4
    a = sched.sample("a")
    assert len(run.tokens["a"]) == 2 and a.num_computed_tokens == 6 and a.num_uncomputed_tokens == 1
    held = sched.kv.get_block_ids(a)
    assert len(held) == 3  # the lookahead for positions 6..8 stays
    worker.steps_to_run = None
    nxt = step(sched, worker, run)
    assert nxt.num_steps == 4 and nxt.cached_requests[0].new_block_ids == []  # 6..9 fit in 3 blocks
    run_until_done(sched, worker, run)
    assert run.tokens["a"] == lone_run_tokens([1, 2, 3, 4, 5], 12, 10_000)
    assert sched.kv.num_free_blocks == sched.kv.num_total_blocks


def test_a_run_shrinks_to_the_free_blocks():
    # 4 blocks of 4: a (6 tokens) holds 2, b (4 tokens) 1; one is free. 8 steps would need
    # 2 more for each; 4 steps 1 each; 3 steps only 1, for b (positions 3..5).
    sched, worker, run = decode_ready(8, num_blocks=4)
    plan = step(sched, worker, run)
    assert plan.num_steps == 3 and sched.kv.num_free_blocks == 0
    run_until_done(sched, worker, run)
    assert sched.kv.num_free_blocks == 4


def test_blocks_a_run_filled_are_offered_to_the_prefix_cache():
    sched = make_scheduler(num_scheduler_steps=8, enable_prefix_caching=True)
    worker, run = FakeWorker(4), Run()
    sched.add_request("a", [1, 2, 3], params(max_tokens=9))
    run_until_done(sched, worker, run)
    assert [len(p.cached_requests) and p.num_steps for p in run.plans] == [0, 8]
    full = [1, 2, 3] + run.tokens["a"][:5]  # 8 tokens: 2 full blocks, the second filled by the run
    sched.add_request("again", full + [7], params(max_tokens=1))
    step(sched, worker, run)
    assert sched.stats().prefix_cache_hits == 8


def test_a_result_with_an_error_fails_the_run_like_a_step():
    sched, worker, run = decode_ready(4)
    plan = sched.schedule()
    assert plan.num_steps == 4
    outs = sched.update_from_output(plan, StepResult(plan.step_id, error="boom"))
    assert {o.request_id: o.finish_reason for o in outs} == {"a": FinishReason.ERROR, "b": FinishReason.ERROR}
    assert sched.kv.num_free_blocks == sched.kv.num_total_blocks


def test_extra_tokens_beyond_the_plans_steps_are_ignored():
    sched, worker, run = decode_ready(2)
    plan = sched.schedule()
    assert plan.num_steps == 2
    toks = [SampledToken(sched.sample(rid).seq_id, 40 + i, TokenLogprobs(40 + i, -1.0)) for i in range(3) for rid in ("a", "b")]
    outs = sched.update_from_output(plan, StepResult(plan.step_id, sampled=toks, num_steps=2))
    assert [o.new_token_ids for o in outs] == [[40, 41], [40, 41]]
