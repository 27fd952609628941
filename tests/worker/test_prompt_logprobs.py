"""Prompt logprobs computed by the ModelRunner vs HF transformers' (float32 log_softmax of
its logits at each prompt position), a prompt split across two prefill chunks included."""

from __future__ import annotations

import pytest
import torch

from llmserve.contract.sampling import SamplingParams
from llmserve.worker.config import RunnerConfig
from llmserve.worker.model_runner import ModelRunner

from .conftest import PlanDriver, hf_greedy, hf_model

BLOCK = 4
PROMPTS = {
    "plain": [11, 45, 3, 99, 120, 7, 8, 250],
    "chunked": list(range(20, 43)),  # 23 tokens: prefilled as 10 + 13
    "whole": [5, 17, 230, 4, 60, 61],
}
TOP = {"chunked": 3, "whole": 0}


def _hf_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    """[len - 1, V]: row i is the distribution of prompt token i + 1 given tokens 0..i."""
    with torch.inference_mode():
        logits = hf_model(model_dir)(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


@pytest.fixture(scope="module")
def run(tiny_llama_dir):
    runner = ModelRunner(tiny_llama_dir, RunnerConfig(block_size=BLOCK, num_kv_blocks=64, max_model_len=128,
                                                      swap_space=0))
    d = PlanDriver(runner, BLOCK, 64)
    d.add("plain", PROMPTS["plain"])
    for rid, k in TOP.items():
        d.add(rid, PROMPTS[rid], SamplingParams(temperature=0.0, prompt_logprobs=k))
    results = [d.step({"plain": None, "chunked": 10, "whole": None}), d.step({"plain": 1, "chunked": None, "whole": 1})]
    results += [d.step({rid: 1 for rid in PROMPTS}) for _ in range(3)]
    return d, results


def test_prompt_logprobs_equal_hf_chunk_by_chunk(tiny_llama_dir, run):
    d, results = run
    chunks = {rid: [(c.start, c.logprobs) for r in results for c in r.prompt_logprobs if c.seq_id == d.seq_id(rid)]
              for rid in PROMPTS}
    assert chunks["plain"] == []  # Asked by nobody: computed for nobody.
    assert [(start, len(lps)) for start, lps in chunks["chunked"]] == [(1, 10), (11, 12)]  # Position 9's next token too.
    assert [(start, len(lps)) for start, lps in chunks["whole"]] == [(1, 5)]
    for rid, k in TOP.items():
        prompt, got = PROMPTS[rid], [lp for _, lps in chunks[rid] for lp in lps]
        ref = _hf_logprobs(tiny_llama_dir, prompt)
        targets = torch.tensor(prompt[1:])
        assert [lp.token_id for lp in got] == prompt[1:]
        want = ref.gather(1, targets[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in got]), want, rtol=0, atol=1e-4)
        assert [lp.rank for lp in got] == ((ref > want[:, None]).sum(-1) + 1).tolist()
        top_vals, top_ids = ref.topk(k, dim=-1)
        assert [list(lp.top_token_ids) for lp in got] == top_ids.tolist()
        torch.testing.assert_close(torch.tensor([list(lp.top_logprobs) for lp in got]).reshape(top_vals.shape),
                                   top_vals, rtol=0, atol=1e-4)


def test_rows_asking_for_them_sample_as_any_other(tiny_llama_dir, run):
    d, _ = run
    reference = hf_greedy(tiny_llama_dir, PROMPTS, 3)
    assert {rid: d.outputs(rid)[:3] for rid in PROMPTS} == reference


def test_through_the_scheduler_a_request_asking_takes_no_prefix_hit(tiny_llama_dir):
    from tests.scheduler.scheduler_testkit import make_scheduler

    runner = ModelRunner(tiny_llama_dir, RunnerConfig(block_size=BLOCK, num_kv_blocks=64, max_model_len=128,
                                                      swap_space=0))
    scheduler = make_scheduler(num_blocks=64, block_size=BLOCK, max_model_len=128, enable_prefix_caching=True,
                               max_num_batched_tokens=8)  # A 23-token prompt takes three chunks.
    prompt = PROMPTS["chunked"]
    firsts, computed = {}, {}

    def serve(rid: str, sampling: SamplingParams) -> None:
        scheduler.add_request(rid, prompt, sampling)
        while scheduler.has_unfinished_requests():
            plan = scheduler.schedule()
            computed.update({r.seq_id: (rid, r.num_computed_tokens) for r in plan.new_requests})
            for out in scheduler.update_from_output(plan, runner.execute(plan)):
                firsts.setdefault(out.request_id, out)

    serve("warm", SamplingParams(max_tokens=2, temperature=0.0))
    serve("asks", SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2))
    serve("hit", SamplingParams(max_tokens=2, temperature=0.0))
    first_computed = {rid: n for rid, n in reversed(computed.values())}  # Each request's first plan.
    assert first_computed == {"warm": 0, "asks": 0, "hit": 20}  # The cache holds the prompt's 5 full blocks.
    assert firsts["warm"].prompt_logprobs == [] == firsts["hit"].prompt_logprobs
    got = firsts["asks"].prompt_logprobs
    ref = _hf_logprobs(tiny_llama_dir, prompt)
    assert [lp.token_id for lp in got] == prompt[1:]
    want = ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in got]), want, rtol=0, atol=1e-4)
    assert [list(lp.top_token_ids) for lp in got] == ref.topk(2, dim=-1).indices.tolist()
