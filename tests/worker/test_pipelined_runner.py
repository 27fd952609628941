"""ModelRunner.launch / finish (the worker's half of the pipelined loop): plans run as
launch(N), launch(N+1), finish(N), ... give exactly execute()'s tokens, N's sampled ids
reaching N+1's inputs as placeholders filled on the device."""

from __future__ import annotations

import random

import pytest

from llmserve.contract.plan import CachedRequestData, NewRequestData, StepPlan
from llmserve.contract.sampling import SamplingParams, StructuredOutput
from llmserve.worker.config import RunnerConfig
from llmserve.worker.input_batch import PLACEHOLDER, RequestState
from llmserve.worker.launched_step import LaunchedStep, must_finish_first
from llmserve.worker.model_runner import ModelRunner

from .conftest import hf_greedy

BLOCK = 4
NUM_BLOCKS = 96
GREEDY = SamplingParams(temperature=0.0)


class AheadPlanner:
    """Plans as the pipelined scheduler does: each plan is built before the previous
    one's result, the tokens it samples counted (placeholders) but not known. Plans carry
    counts and prompts only, so the same list drives a serial and a pipelined runner."""

    def __init__(self, seed: int = 0):
        self.free = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free)
        self.reqs: dict[str, dict] = {}
        self.plans: list[StepPlan] = []

    def add(self, rid: str, prompt: list[int], sampling: SamplingParams = GREEDY) -> None:
        self.reqs[rid] = {"prompt": prompt, "sampling": sampling, "blocks": [], "computed": 0,
                          "num_tokens": len(prompt), "on_worker": False, "seq_id": len(self.reqs) + 1}

    def plan(self, schedule: dict[str, int | None], finished: tuple[str, ...] = ()) -> None:
        """schedule: rid -> tokens to compute (None: all it has left)."""
        plan = StepPlan(len(self.plans), finished_seq_ids=[self.reqs[rid]["seq_id"] for rid in finished])
        for rid, n in schedule.items():
            r = self.reqs[rid]
            n = n or r["num_tokens"] - r["computed"]
            need = -(-(r["computed"] + n) // BLOCK) - len(r["blocks"])
            new_blocks = [self.free.pop() for _ in range(need)]
            r["blocks"] += new_blocks
            if r["on_worker"]:
                plan.cached_requests.append(CachedRequestData(r["seq_id"], new_blocks, r["computed"], n))
            else:
                plan.new_requests.append(NewRequestData(r["seq_id"], list(r["prompt"]), len(r["prompt"]),
                                                        r["sampling"], list(r["blocks"]), r["computed"], n))
                r["on_worker"] = True
            r["computed"] += n
            if r["computed"] == r["num_tokens"]:
                r["num_tokens"] += 1  # The step samples a token: a placeholder for the next plan.
        self.plans.append(plan)


@pytest.fixture(scope="module")
def runners(tiny_llama_dir):
    """Two runners sharing the weights, with equal sampler seeds: serial and pipelined."""
    settings = RunnerConfig(block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, max_model_len=128, swap_space=0)
    serial = ModelRunner(tiny_llama_dir, settings, sampler_seed=3)
    return lambda: (ModelRunner(tiny_llama_dir, settings, sampler_seed=3, model=serial.model),
                    ModelRunner(tiny_llama_dir, settings, sampler_seed=3, model=serial.model))


def run_pipelined(runner: ModelRunner, plans: list[StepPlan]) -> tuple[list, list[bool]]:
    """launch(0), launch(1), finish(0), launch(2), finish(1), ...; the results in plan
    order, and for each plan after the first whether it went ahead (launched while the
    plan before was still in flight, not read back first)."""
    results, launched, ahead = [], [], []
    for plan in plans:
        launched.append(runner.launch(plan))
        if len(launched) > 1:
            ahead.append(launched[-2].result is None)
            results.append(runner.finish(launched[-2]))
    results.append(runner.finish(launched[-1]))
    return results, ahead


def tokens(result) -> list[tuple[int, int]]:
    return [(t.seq_id, t.token_id) for t in result.sampled]


PROMPTS = {"a": [11, 45, 3, 99, 120, 7, 8, 250], "b": list(range(20, 43)), "c": [5, 17, 230, 4, 60]}


def mixed_workload() -> AheadPlanner:
    """Greedy, seeded and unseeded random rows, n = 2 (two samples of one prompt), a
    prefill chunk beside decodes, and a request ending at a step whose next row is
    discarded (its end known only from the result, as an eos)."""
    p = AheadPlanner()
    p.add("a", PROMPTS["a"])
    p.add("b", PROMPTS["b"], SamplingParams(temperature=1.0, top_p=0.9, seed=11))
    p.add("b2", PROMPTS["b"], SamplingParams(temperature=1.0, top_p=0.9, seed=12))
    p.add("c", PROMPTS["c"], SamplingParams(temperature=0.8))  # unseeded: the sampler's own generator
    p.add("d", PROMPTS["c"])
    p.plan({"a": None, "b": 16, "b2": 16, "d": None})
    p.plan({"a": 1, "b": None, "b2": None, "d": 1})
    for _ in range(3):
        p.plan({"a": 1, "b": 1, "b2": 1, "d": 1})
    p.plan({"a": 1, "b": 1, "b2": 1, "c": 3, "d": 1})  # c's prefill in two chunks beside the decodes
    # d's token at the step before ends it (an eos, say): this row, planned before that was known, is
    # discarded by the scheduler, and the next plan drops d while this one is in flight.
    p.plan({"a": 1, "b": 1, "b2": 1, "c": None, "d": 1})
    for _ in range(8):
        p.plan({"a": 1, "b": 1, "b2": 1, "c": 1}, finished=("d",) if _ == 0 else ())
    return p


def test_launched_ahead_equals_execute_one_by_one(runners, tiny_llama_dir):
    serial, pipelined = runners()
    plans = mixed_workload().plans
    expected = [serial.execute(plan) for plan in plans]
    results, ahead = run_pipelined(pipelined, plans)
    assert [tokens(r) for r in results] == [tokens(r) for r in expected]
    assert [r.step_id for r in results] == list(range(len(plans)))
    assert all(ahead)  # Nothing here forces a read back before the next launch.
    dropped_at = next(i for i, plan in enumerate(plans) if plan.finished_seq_ids)
    assert 5 not in pipelined.batch.states and 5 in dict(tokens(results[dropped_at - 1]))
    final = {sid: st.token_ids for sid, st in pipelined.batch.states.items()}
    assert final == {sid: st.token_ids for sid, st in serial.batch.states.items()}
    assert not any(PLACEHOLDER in ids for ids in final.values())
    # Greedy rows against a reference we did not write: HF transformers.
    a_out = [tok for r in results for sid, tok in tokens(r) if sid == 1]
    assert a_out == hf_greedy(tiny_llama_dir, {"a": PROMPTS["a"]}, len(a_out))["a"]
    b, b2 = ([tok for r in results for s, tok in tokens(r) if s == sid] for sid in (2, 3))
    assert b != b2 and len(set(b)) > 3  # two samples of one prompt, really sampled


def test_the_next_step_reads_the_placeholder_on_the_device(runners):
    serial, pipelined = runners()
    p = AheadPlanner()
    p.add("a", PROMPTS["a"])
    p.plan({"a": None})
    p.plan({"a": 1})
    first = pipelined.launch(p.plans[0])
    state = pipelined.batch.states[1]
    assert state.token_ids[-1] == PLACEHOLDER and first.result is None
    second = pipelined.launch(p.plans[1])  # Its input token is still a placeholder on the host.
    assert first.result is None and state.token_ids[-2:] == [PLACEHOLDER, PLACEHOLDER]
    got = [tokens(pipelined.finish(first)), tokens(pipelined.finish(second))]
    assert got == [tokens(serial.execute(plan)) for plan in p.plans]
    assert state.token_ids == PROMPTS["a"] + [got[0][0][1], got[1][0][1]]


def test_logprobs_are_read_with_the_ids_not_in_the_launch(runners, monkeypatch):
    from llmserve.worker.launched_step import PendingPromptLogprobs
    from llmserve.worker.sampler import PendingLogprobs

    serial, pipelined = runners()
    p = AheadPlanner()
    p.add("l", PROMPTS["a"], SamplingParams(temperature=0.0, logprobs=3))
    p.add("p", PROMPTS["c"], SamplingParams(temperature=0.0, prompt_logprobs=2))
    p.plan({"l": None, "p": 3})  # a chunk of p's prompt: its prompt logprobs, nothing sampled
    p.plan({"l": 1, "p": None})
    expected = [serial.execute(plan) for plan in p.plans]
    reads = []
    for pending in (PendingLogprobs, PendingPromptLogprobs):
        monkeypatch.setattr(pending, "read", lambda self, read=pending.read: reads.append(type(self)) or read(self))
    first = pipelined.launch(p.plans[0])
    second = pipelined.launch(p.plans[1])  # ahead of the first: nothing read back yet
    assert reads == [] and first.result is None
    got = [pipelined.finish(step) for step in (first, second)]
    assert reads == [PendingLogprobs, PendingPromptLogprobs, PendingLogprobs, PendingPromptLogprobs]
    assert [[(t.seq_id, t.token_id, t.logprobs) for t in r.sampled] for r in got] == \
        [[(t.seq_id, t.token_id, t.logprobs) for t in r.sampled] for r in expected]
    assert [r.prompt_logprobs for r in got] == [r.prompt_logprobs for r in expected]
    assert got[0].sampled[0].logprobs.top_token_ids and len(got[0].sampled[0].logprobs.top_token_ids) == 3
    (chunk,) = got[0].prompt_logprobs
    assert (chunk.start, len(chunk.logprobs), len(chunk.logprobs[0].top_token_ids)) == (1, 3, 2)


def test_a_penalized_row_goes_ahead_its_id_in_flight_penalized_on_the_device(runners):
    serial, pipelined = runners()
    p = AheadPlanner()
    p.add("a", PROMPTS["a"])
    # A +20 bias makes greedy take id 5 at every step; presence 50 forbids it once it is
    # an output: the step after it has 5 only in flight (a penalty that skipped that id
    # would take 5 again at once). Repetition and frequency beside it.
    p.add("r", PROMPTS["b"], SamplingParams(temperature=0.0, logit_bias=((5, 20.0),), repetition_penalty=1.8,
                                            frequency_penalty=0.5, presence_penalty=50.0))
    p.plan({"a": None})
    p.plan({"a": 1, "r": None})
    for _ in range(10):
        p.plan({"a": 1, "r": 1})
    expected = [tokens(serial.execute(plan)) for plan in p.plans]
    results, ahead = run_pipelined(pipelined, p.plans)
    assert [tokens(r) for r in results] == expected
    assert ahead == [True] * (len(p.plans) - 1)  # Never read back first for the penalties.
    outputs = [tok for r in results for sid, tok in tokens(r) if sid == 2]
    assert len(outputs) == 11 and outputs[0] == 5 and len(set(outputs)) == len(outputs)


def test_a_row_with_a_multi_token_bad_word_goes_ahead_its_ban_read_on_the_device(runners):
    serial, pipelined = runners()
    p = AheadPlanner()
    p.add("a", PROMPTS["a"])
    # Biases make greedy take 6, else 5; the bad words (6, 6) and (5, 5) forbid either
    # twice in a row, so the output alternates 6, 5, 6, ...: each step's ban hangs on the
    # id the step in flight sampled (a ban that missed it would repeat an id at once).
    p.add("w", PROMPTS["b"], SamplingParams(temperature=0.0, logit_bias=((6, 30.0), (5, 20.0)),
                                            bad_words_token_ids=((6, 6), (5, 5), (11,))))
    p.plan({"a": None, "w": None})
    for _ in range(7):
        p.plan({"a": 1, "w": 1})
    expected = [tokens(serial.execute(plan)) for plan in p.plans]
    results, ahead = run_pipelined(pipelined, p.plans)
    assert [tokens(r) for r in results] == expected
    assert ahead == [True] * (len(p.plans) - 1)  # Never read back first for the bad words.
    assert [tok for r in results for sid, tok in tokens(r) if sid == 2] == [6, 5] * 4


def test_must_finish_first_names_each_reason():
    plain = RequestState(1, [1, 2, 3], 3, GREEDY, [0], 3)
    penalized = RequestState(2, [1, 2, 3], 3, SamplingParams(presence_penalty=1.0), [1], 3)
    in_flight = LaunchedStep(StepPlan(0), [(plain, 1)])
    states = {1: plain, 2: penalized}
    decode = StepPlan(1, cached_requests=[CachedRequestData(1, [], 3, 1)])
    assert not must_finish_first(in_flight, decode, states)
    # A penalized row reads its id in flight on the device (sampler.InFlightIds).
    assert not must_finish_first(in_flight, StepPlan(1, cached_requests=[CachedRequestData(2, [], 3, 1)]), states)
    assert must_finish_first(in_flight, StepPlan(1, cached_requests=[CachedRequestData(1, [], 3, 1)],
                                                 num_steps=4), states)
    assert must_finish_first(in_flight, StepPlan(1, cached_requests=[CachedRequestData(1, [], 3, 3, [7, 8])]),
                             states)
    constrained = SamplingParams(structured_output=StructuredOutput("regex", "a+"))
    assert must_finish_first(in_flight, StepPlan(1, new_requests=[NewRequestData(5, [1], 1, constrained, [2], 0, 1)]),
                             states)
    logprobs = SamplingParams(logprobs=2)
    assert not must_finish_first(in_flight, StepPlan(1, new_requests=[NewRequestData(5, [1], 1, logprobs, [2], 0, 1)]),
                                 states)
    one_token_words = SamplingParams(bad_words_token_ids=((7,), (9,)))  # Banned always: no history read.
    assert not must_finish_first(in_flight, StepPlan(1, new_requests=[
        NewRequestData(5, [1], 1, one_token_words, [2], 0, 1)]), states)
    # Matches the output's last token: read on the device where it is in flight.
    two_token_word = SamplingParams(bad_words_token_ids=((7,), (8, 9)))
    assert not must_finish_first(in_flight, StepPlan(1, new_requests=[
        NewRequestData(5, [1], 1, two_token_word, [2], 0, 1)]), states)
    plain.draft_token_ids = [4]  # The step in flight verifies drafts: its accepted count moves the next inputs.
    assert must_finish_first(in_flight, decode, states)
    in_flight.result = object()  # Read back already: nothing to wait for.
    assert not must_finish_first(in_flight, decode, states)
