"""Speculative decoding on the real ModelRunner: greedy output identical to plain decoding
(HF's greedy tokens), seeded sampling drawing the same tokens, unseeded sampling from
the model's own distribution (a chi-square test against HF's probabilities), and plans
with drafts that cannot run refused."""

from __future__ import annotations

import math

import pytest
import torch

from llmserve.contract.plan import CachedRequestData, NewRequestData, StepPlan
from llmserve.contract.sampling import SamplingParams
from llmserve.launcher.engine import InProcessEngine
from llmserve.worker.config import RunnerConfig
from llmserve.worker.model_runner import ModelRunner

from .conftest import hf_greedy, hf_model

BLOCK = 4
GEN = 40
# Token loops make drafts: a prompt that repeats itself, and one that does not.
PROMPTS = {"loop": [11, 45, 3, 99] * 4, "plain": [5, 250, 17, 42, 8, 133, 61, 2, 9]}


def _engine(model_dir, k: int, **config) -> InProcessEngine:
    runner = ModelRunner(model_dir, RunnerConfig(block_size=BLOCK, num_kv_blocks=200, max_model_len=128, swap_space=0))
    return InProcessEngine(runner, _config(k, **config))


def _config(k: int, **config):
    from llmserve.scheduler.config import SchedulerConfig

    return SchedulerConfig(num_speculative_tokens=k, speculative_ngram_min=1, **config)


def _run(engine: InProcessEngine, sampling: SamplingParams) -> dict[str, list[int]]:
    done = engine.run([(rid, prompt, sampling) for rid, prompt in PROMPTS.items()])
    return {rid: c.output_token_ids for rid, c in done.items()}


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    return hf_greedy(tiny_llama_dir, PROMPTS, GEN)


def test_greedy_tokens_are_hf_greedy_tokens_with_ngram_drafts(tiny_llama_dir, reference):
    greedy = SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True)
    for k, config in ((4, {}), (2, {"num_scheduler_steps": 4}), (6, {"enable_prefix_caching": False})):
        engine = _engine(tiny_llama_dir, k, **config)
        assert _run(engine, greedy) == reference, (k, config)
        assert engine.scheduler.stats().spec_num_draft_tokens > 0  # (a random model rarely repeats: rejected)
        assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_total_blocks


def _decode_with_drafts(runner: ModelRunner, prompt: list[int], sampling: SamplingParams, oracle: list[int],
                        k: int) -> tuple[list[int], list, int]:
    """One sequence decoded to len(oracle) tokens, each step verifying up to k drafts
    taken from `oracle` (every third step with one of them made wrong). Returns the
    tokens, their logprobs and how many drafts were accepted."""
    table = list(range(runner.max_model_len // BLOCK))
    first = runner.execute(StepPlan(0, new_requests=[NewRequestData(1, list(prompt), len(prompt), sampling, table,
                                                                     0, len(prompt))])).sampled
    outputs, logprobs, computed, accepted = [first[0].token_id], [first[0].logprobs], len(prompt), 0
    step = 1
    while len(outputs) < len(oracle):
        n = len(outputs)
        drafts = oracle[n:min(n + k, len(oracle) - 1)]
        if step % 3 == 0 and drafts:
            drafts[len(drafts) // 2] = (drafts[len(drafts) // 2] + 1) % 300
        result = runner.execute(StepPlan(step, cached_requests=[
            CachedRequestData(1, [], computed, 1 + len(drafts), draft_token_ids=drafts)]))
        got = result.sampled
        assert 1 <= len(got) <= 1 + len(drafts)
        assert [t.token_id for t in got[:-1]] == drafts[:len(got) - 1]  # kept drafts are a prefix
        accepted += len(got) - 1
        outputs += [t.token_id for t in got]
        logprobs += [t.logprobs for t in got]
        computed += len(got)
        step += 1
    return outputs, logprobs, accepted


def test_verified_drafts_keep_hf_greedy_tokens(tiny_llama_dir, reference):
    """Drafts from an oracle (HF's own continuation, some made wrong): every kept draft
    and every correction is HF's greedy token."""
    greedy = SamplingParams(temperature=0.0)
    for k in (1, 3, 5):
        runner = ModelRunner(tiny_llama_dir, RunnerConfig(block_size=BLOCK, num_kv_blocks=40, max_model_len=128,
                                                          swap_space=0))
        for rid, prompt in PROMPTS.items():
            runner.reset_requests()
            outputs, _, accepted = _decode_with_drafts(runner, prompt, greedy, reference[rid], k)
            assert outputs == reference[rid], (k, rid)
            assert accepted >= GEN // 3, (k, rid, accepted)


def test_seeded_sampling_draws_the_tokens_plain_decoding_draws(tiny_llama_dir):
    seeded = SamplingParams(temperature=0.8, top_k=50, seed=3, logprobs=2)
    runner = ModelRunner(tiny_llama_dir, RunnerConfig(block_size=BLOCK, num_kv_blocks=40, max_model_len=128,
                                                      swap_space=0))
    prompt = PROMPTS["plain"]
    plain, plain_logprobs, _ = _decode_with_drafts(runner, prompt, seeded, [0] * GEN, 0)
    assert len(set(plain)) > GEN // 4  # really sampled, not a loop
    runner.reset_requests()
    outputs, logprobs, accepted = _decode_with_drafts(runner, prompt, seeded, plain, 4)
    assert outputs == plain and accepted >= GEN // 3
    assert [lp.top_token_ids for lp in logprobs] == [lp.top_token_ids for lp in plain_logprobs]
    assert [lp.logprob for lp in logprobs] == pytest.approx([lp.logprob for lp in plain_logprobs], abs=1e-4)


def _chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square value exceeded with probability ~0.001 (z = 3.09) for df degrees
    of freedom (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _fits(counts: dict[int, int], probs: torch.Tensor) -> tuple[float, float]:
    """Pearson's chi-square of observed token counts against probabilities [V], tokens
    expected fewer than 5 times pooled into one cell; and the critical value."""
    n = sum(counts.values())
    big = [t for t in range(probs.numel()) if probs[t] * n >= 5]
    cells = [(counts.get(t, 0), float(probs[t]) * n) for t in big]
    rest_expected = n - sum(e for _, e in cells)
    if rest_expected >= 5:
        cells.append((n - sum(o for o, _ in cells), rest_expected))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return stat, _chi_square_critical(len(cells) - 1)


def test_unseeded_tokens_follow_the_models_distribution_before_and_after_an_accepted_draft(tiny_llama_dir):
    """N copies of one sequence verify the draft d = the likeliest next token: each
    row's first token must follow p(. | prompt), and the second, present exactly when
    the first equals d, p(. | prompt, d)."""
    n, temperature = 3000, 0.7
    prompt, last = [11, 45, 3, 99, 120, 7], 8
    hf = hf_model(tiny_llama_dir)
    with torch.inference_mode():
        p0 = torch.softmax(hf(torch.tensor([prompt + [last]])).logits[0, -1].float() / temperature, -1)
        draft = int(p0.argmax())
        p1 = torch.softmax(hf(torch.tensor([prompt + [last, draft]])).logits[0, -1].float() / temperature, -1)
    assert 0.1 < p0[draft] < 0.9, "the test needs drafts both accepted and rejected"
    blocks_each = -(-(len(prompt) + 2) // BLOCK)
    runner = ModelRunner(tiny_llama_dir, RunnerConfig(block_size=BLOCK, num_kv_blocks=n * blocks_each,
                                                      max_model_len=64, swap_space=0, max_num_batched_tokens=4096))
    sampling = SamplingParams(temperature=temperature)
    tables = {i: list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(n)}
    # The prompt and `last` known, the prompt computed: then `last` and the draft, verified.
    prefill = StepPlan(0, new_requests=[NewRequestData(i + 1, prompt + [last], len(prompt), sampling, tables[i], 0,
                                                       len(prompt)) for i in range(n)])
    assert runner.execute(prefill).sampled == []
    verify = StepPlan(1, cached_requests=[CachedRequestData(i + 1, [], len(prompt), 2, draft_token_ids=[draft])
                                          for i in range(n)])
    per_row: dict[int, list[int]] = {}
    for token in runner.execute(verify).sampled:
        per_row.setdefault(token.seq_id, []).append(token.token_id)
    assert len(per_row) == n
    first, second = {}, {}
    for tokens in per_row.values():
        first[tokens[0]] = first.get(tokens[0], 0) + 1
        assert len(tokens) == (2 if tokens[0] == draft else 1)
        if len(tokens) == 2:
            second[tokens[1]] = second.get(tokens[1], 0) + 1
    stat, critical = _fits(first, p0)
    assert stat < critical, (stat, critical)
    stat, critical = _fits(second, p1)
    assert stat < critical, (stat, critical)
    # The rule's own power check: had it always accepted, the first tokens would be all d.
    assert _fits({draft: n}, p0)[0] > _fits({draft: n}, p0)[1]


def test_plans_with_drafts_that_cannot_run_are_refused(tiny_llama_dir):
    runner = ModelRunner(tiny_llama_dir, RunnerConfig(block_size=BLOCK, num_kv_blocks=16, max_model_len=16,
                                                      swap_space=0))
    g = SamplingParams(temperature=0.0)
    runner.execute(StepPlan(0, new_requests=[NewRequestData(1, [1, 2, 3], 3, g, [0, 1], 0, 3)]))  # samples a 4th
    bad = [
        StepPlan(1, cached_requests=[CachedRequestData(1, [], 3, 3, draft_token_ids=[5])]),  # count != 1 + drafts
        StepPlan(1, cached_requests=[CachedRequestData(1, [], 2, 3, draft_token_ids=[5, 6])]),  # not the last token
        StepPlan(1, cached_requests=[CachedRequestData(1, [], 3, 2, draft_token_ids=[5])], num_steps=2),  # a run
        StepPlan(1, cached_requests=[CachedRequestData(1, [], 3, 6, draft_token_ids=[5] * 5)]),  # beyond the table
    ]
    for plan in bad:
        with pytest.raises(ValueError):
            runner.execute(plan)
    # Nothing above changed the request: a good plan still runs, and its drafts verify.
    result = runner.execute(StepPlan(1, cached_requests=[CachedRequestData(1, [], 3, 3, draft_token_ids=[5, 6])]))
    assert 1 <= len(result.sampled) <= 3
