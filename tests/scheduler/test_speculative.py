"""Speculative decoding in the scheduler: n-gram drafts, their slots and budget, and
applying what the worker accepted. The fake worker verifies drafts as the real one does
(tests/worker/test_speculative_runner.py checks the real one against plain decoding)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from llmserve.contract.outputs import FinishReason
from llmserve.scheduler.ngram_drafter import MAX_PAUSE_STEPS, NgramDrafter
from llmserve.scheduler.request import Request, Sample
from llmserve.contract.sampling import SamplingParams

from .scheduler_testkit import FakeWorker, Run, make_scheduler, names, params, run_until_done, sequence_tokens, step


def sample_of(tokens: list[int], num_prompt: int | None = None) -> Sample:
    """A sample whose prompt is tokens[:num_prompt] and outputs the rest."""
    num_prompt = len(tokens) if num_prompt is None else num_prompt
    request = Request("r", tokens[:num_prompt], SamplingParams(max_tokens=100), frozenset())
    sample = request.new_samples()[0]
    sample.output_token_ids = tokens[num_prompt:]
    return sample


def scan_proposal(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The drafter's rule by brute force: the longest suffix n-gram (max_n..min_n) found
    earlier, at its latest occurrence followed by a token, continued periodically."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        for position in range(length - 1, n - 1, -1):
            if tokens[position - n:position] == suffix:
                run = tokens[position:]
                return [run[i % len(run)] for i in range(k)]
    return []


# ---- the drafter ----

def test_the_longest_suffix_match_drafts_what_followed_it():
    drafter = NgramDrafter(4, 1, 3)
    # "5 6" also follows "9 5 6"... but the 3-gram "1 5 6" occurs only once before.
    tokens = [1, 5, 6, 7, 8, 9, 9, 5, 6, 2, 3, 4, 1, 5, 6]
    assert drafter.propose(sample_of(tokens, 4), 10) == [7, 8, 9, 9]
    assert drafter.propose(sample_of([1, 2, 3], 3), 10) == []  # nothing repeats
    assert NgramDrafter(4, 3, 3).propose(sample_of([7, 1, 2, 9, 1, 2]), 10) == []  # 2-grams are too short


def test_a_repeat_reaching_the_end_continues_with_its_period_and_the_limit_caps_it():
    drafter = NgramDrafter(5, 2, 4)
    assert drafter.propose(sample_of([3, 1, 2, 1, 2, 1, 2]), 10) == [1, 2, 1, 2, 1]
    assert drafter.propose(sample_of([4, 4, 4, 4]), 2) == [4, 4]
    assert drafter.propose(sample_of([3, 1, 2, 1, 2]), 0) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=60), st.lists(st.integers(1, 7), max_size=12),
       st.integers(1, 3), st.integers(0, 2))
def test_the_incremental_index_proposes_what_a_scan_finds(tokens, growth, min_n, extra):
    """Grown a few tokens at a time (prompt, then outputs), as samples are."""
    max_n = min_n + extra
    drafter = NgramDrafter(6, min_n, max_n)
    sample = sample_of(tokens)
    seen = list(tokens)
    for i, more in enumerate(growth):
        assert drafter.propose(sample, 6) == scan_proposal(seen, 6, min_n, max_n)
        new = [(i * 3 + j) % 4 for j in range(more)]
        sample.output_token_ids += new
        seen += new


def test_a_sample_whose_drafts_all_fail_pauses_longer_each_time_until_one_is_kept():
    drafter = NgramDrafter(3, 1, 2)
    sample = sample_of([1, 2, 1, 2])
    pauses = []
    for _ in range(6):
        assert drafter.propose(sample, 3)
        drafter.observe(sample, 3, 0)
        pause = 0
        while not drafter.propose(sample, 3):
            pause += 1
        pauses.append(pause)
    assert pauses == [1, 2, 4, 8, MAX_PAUSE_STEPS, MAX_PAUSE_STEPS]
    drafter.observe(sample, 3, 1)  # one kept: drafting resumes at once
    assert drafter.propose(sample, 3) and drafter.propose(sample, 3)


# ---- the scheduler ----

REPEATING = sequence_tokens({"a": [7, 8, 9] * 10 + [1], "b": [5, 6] * 12})


def speculating(k: int = 4, **config):
    sched = make_scheduler(num_speculative_tokens=k, speculative_ngram_min=1, **config)
    return sched, FakeWorker(4, REPEATING), Run()


def test_drafts_ride_with_the_decode_and_accepted_ones_arrive_in_one_output():
    sched, worker, run = speculating()
    assert sched.stats().spec_accepted_per_position == (0, 0, 0, 0)  # every position, from the start
    sched.add_request("a", [7, 8, 9, 7, 8, 9], params(max_tokens=20))
    step(sched, worker, run)  # the prompt: samples 7
    plan = step(sched, worker, run)
    [row] = plan.cached_requests
    # Tokens 7 8 9 7 8 9 | 7: the suffix "8 9 7" occurred at 1..3, then came "8 9 7 8".
    assert (row.num_computed_tokens, row.num_scheduled_tokens, row.draft_token_ids) == (6, 5, [8, 9, 7, 8])
    assert run.outputs[-1].new_token_ids == [8, 9, 7, 8, 9]  # 4 drafts kept + the token after them
    a = sched.sample("a")
    assert (a.num_tokens, a.num_computed_tokens) == (12, 11)
    stats = sched.stats()
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == (1, 4, 4)
    assert stats.spec_accepted_per_position == (1, 1, 1, 1) and stats.spec_mean_accepted_length == 5.0


def test_no_drafts_in_a_step_that_schedules_more_sequences_than_disable_by_batch_size():
    sched, worker, run = speculating(speculative_disable_by_batch_size=1)
    sched.add_request("a", [7, 8, 9, 7, 8, 9], params(max_tokens=20))
    sched.add_request("b", [5, 6, 5, 6], params(max_tokens=3))
    step(sched, worker, run)  # both prompts
    plan = step(sched, worker, run)  # 2 decoding: above 1, no drafts though both repeat
    assert len(plan.cached_requests) == 2 and not any(r.draft_token_ids for r in plan.cached_requests)
    while "b" not in run.finish:
        step(sched, worker, run)
    plan = step(sched, worker, run)  # a alone: it drafts again
    [row] = plan.cached_requests
    assert row.draft_token_ids
    run_until_done(sched, worker, run)
    assert sched.kv.num_free_blocks == sched.kv.num_total_blocks


def test_speculation_changes_no_token_and_frees_every_block():
    expected = {}
    for k in (0, 1, 3, 6):
        sched, worker, run = speculating(k, max_model_len=48)
        sched.add_request("a", [7, 8, 9, 7, 8], params(max_tokens=31))
        sched.add_request("b", [5, 6, 5], params(max_tokens=24))
        run_until_done(sched, worker, run)
        expected.setdefault("tokens", run.tokens)
        assert run.tokens == expected["tokens"] and run.tokens["a"][-1] == 1  # a's last token breaks its loop
        assert run.finish == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}
        assert sched.kv.num_free_blocks == sched.kv.num_total_blocks and sched.audit().ok
        expected.setdefault("plans", {})[k] = len(run.plans)
        stats = sched.stats()
        assert stats.generation_tokens_total == 31 + 24
        if k:
            assert stats.spec_num_accepted_tokens + stats.num_steps - 1 >= 31  # a: prefill + 1 per plan + accepted
            assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # a's final 1 is no repeat
    plans = expected["plans"]
    assert plans[6] < plans[3] < plans[1] < plans[0]


def test_drafts_stop_short_of_max_tokens_and_max_model_len():
    sched, worker, run = speculating(8, max_model_len=20)
    sched.add_request("a", [7, 8, 9, 7, 8, 9], params(max_tokens=5))
    sched.add_request("b", [5, 6, 5, 6, 5, 6, 5, 6, 5, 6, 5, 6], params(max_tokens=50))
    step(sched, worker, run)
    plan = step(sched, worker, run)
    drafts = {name: len(r.draft_token_ids) for name, r in zip(names(plan.cached_requests), plan.cached_requests)}
    # a: 1 output, 5 allowed: 3 drafts + the bonus; b: 13 tokens of 20: 20 - 13 - 1 drafts.
    assert drafts == {"a": 3, "b": 6}
    assert run.finish["a"] == FinishReason.LENGTH and len(run.tokens["a"]) == 5
    run_until_done(sched, worker, run)
    assert run.finish["b"] == FinishReason.LENGTH and len(run.tokens["b"]) == 20 - 12


def test_tokens_after_a_stop_among_accepted_drafts_are_dropped():
    sched, worker, run = speculating()
    sched.add_request("a", [7, 8, 9, 7, 8, 9], params(max_tokens=20, stop_token_ids=[9]))
    step(sched, worker, run)
    step(sched, worker, run)  # drafts 8 9 7 8 are all accepted; 9 stops the sample
    assert run.tokens["a"] == [7, 8, 9] and run.finish["a"] == FinishReason.STOP
    assert sched.kv.num_free_blocks == sched.kv.num_total_blocks


def test_drafts_take_only_the_token_budget_no_sample_needed():
    sched, worker, run = speculating(4, max_num_batched_tokens=4)
    sched.add_request("a", [7, 8, 9, 7], params(max_tokens=30))
    step(sched, worker, run)
    sched.add_request("b", [5, 6, 5], params(max_tokens=30))
    plan = step(sched, worker, run)  # a decodes, b's prompt takes the other 3 tokens
    assert plan.cached_requests[0].draft_token_ids == [] and names(plan.new_requests) == ["b"]
    plan = step(sched, worker, run)  # two decodes leave 2 tokens: a, the first, drafts 2
    rows = dict(zip(names(plan.cached_requests), plan.cached_requests))
    assert plan.total_scheduled_tokens == 4
    assert len(rows["a"].draft_token_ids) == 2 and rows["b"].draft_token_ids == []


def test_drafts_take_only_free_blocks_and_never_preempt():
    sched = make_scheduler(num_blocks=5, num_speculative_tokens=8, speculative_ngram_min=1)
    worker, run = FakeWorker(4, REPEATING), Run()
    sched.add_request("a", [7, 8, 9, 7, 8, 9], params(max_tokens=30))  # 2 blocks
    sched.add_request("b", [5, 6, 5], params(max_tokens=30))  # 1 block
    step(sched, worker, run)
    plan = step(sched, worker, run)
    rows = dict(zip(names(plan.cached_requests), plan.cached_requests))
    # a: positions 6..14 take the 2 free blocks; b's drafts would need 2 more.
    assert len(rows["a"].draft_token_ids) == 8 and rows["b"].draft_token_ids == []
    assert sched.kv.num_free_blocks == 0 and sched.stats().num_preemptions == 0
    run_until_done(sched, worker, run)
    assert sched.kv.num_free_blocks == sched.kv.num_total_blocks


def test_a_plan_with_drafts_is_one_step_and_runs_resume_without_them():
    tokens = {"a": [7, 8, 9] * 10 + [1], "b": list(range(20, 50))}
    worker = FakeWorker(4, sequence_tokens(tokens))
    sched, run = make_scheduler(num_speculative_tokens=3, speculative_ngram_min=1, num_scheduler_steps=4), Run()
    sched.add_request("a", [7, 8, 9, 7, 8, 9], params(max_tokens=12))
    step(sched, worker, run)
    plan = step(sched, worker, run)
    assert plan.num_steps == 1 and plan.cached_requests[0].draft_token_ids
    run_until_done(sched, worker, run)
    sched.add_request("b", [1, 2, 3], params(max_tokens=12))  # never repeats: no drafts, runs of 4
    step(sched, worker, run)
    assert step(sched, worker, run).num_steps == 4
    run_until_done(sched, worker, run)
    assert run.tokens == {"a": tokens["a"][:12], "b": tokens["b"][:12]}


def test_with_prefix_caching_only_computed_tokens_reach_the_cache():
    """A rejected draft's slot holds a wrong token until it is computed; a later request
    reusing the blocks reads them (the fake worker checks every token it reads)."""
    sched = make_scheduler(num_speculative_tokens=4, speculative_ngram_min=1, enable_prefix_caching=True)
    worker, run = FakeWorker(4, REPEATING), Run()
    sched.add_request("a", [7, 8, 9, 1, 7, 8, 9, 2], params(max_tokens=15))
    run_until_done(sched, worker, run)
    assert sched.stats().spec_num_draft_tokens > sched.stats().spec_num_accepted_tokens  # some were rejected
    sched.add_request("b", [7, 8, 9, 1, 7, 8, 9, 2] + run.tokens["a"], params(max_tokens=2))
    run_until_done(sched, worker, run)
    assert sched.get_request("b") is None and sched.stats().prefix_cache_hits >= 20
