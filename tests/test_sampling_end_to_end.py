"""The sampling set end to end (issue #33, item 2): the scheduler core and a model runner
in one process (InProcessEngine) on a tiny random Llama, each request batched with
plain ones whose tokens must not change. logit_bias +100 forces a token; min_tokens
holds off eos (a forced one, even); penalties change greedy output exactly as a loop
over the HF model's logits with the settings' definitions predicts (a random model
seldom repeats itself: a +8 bias on one token makes it, and the penalties break it)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmserve.contract.sampling import SamplingParams

PROMPT = [1, 17, 42, 99, 5, 17, 42]
PLAIN = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    from llmserve.launcher.engine import InProcessEngine

    return InProcessEngine.from_model_dir(tiny_llama_dir, num_kv_blocks=64)


def _run(engine, requests: dict[str, SamplingParams], prompt=PROMPT):
    """Every request in one batch with a plain greedy one; (outputs by id, the plain one's)."""
    out = engine.run([("plain", prompt, PLAIN), *((rid, prompt, s) for rid, s in requests.items())])
    return {rid: out[rid] for rid in requests}, out["plain"].output_token_ids


@pytest.fixture(scope="module")
def plain_tokens(engine):
    return engine.run([("alone", PROMPT, PLAIN)])["alone"].output_token_ids


def test_logit_bias_forces_and_bans_tokens(engine, plain_tokens):
    first = plain_tokens[0]
    out, plain = _run(engine, {
        "forced": SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias=((123, 100.0),)),
        "random_forced": SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True,
                                        logit_bias=((123, 100.0),)),
        "banned": SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logit_bias=((first, -100.0),)),
    })
    assert out["forced"].output_token_ids == out["random_forced"].output_token_ids == [123] * 6
    assert out["banned"].output_token_ids[0] != first
    assert plain == plain_tokens


def test_min_tokens_holds_off_eos(engine, plain_tokens):
    (eos,) = engine.runner.info.eos_token_ids
    eager = ((eos, 100.0),)  # eos wins every step unless masked.
    out, plain = _run(engine, {
        "no_min": SamplingParams(max_tokens=8, temperature=0.0, logit_bias=eager),
        "min4": SamplingParams(max_tokens=8, temperature=0.0, logit_bias=eager, min_tokens=4),
        "min4_stop_id": SamplingParams(max_tokens=8, temperature=0.0, min_tokens=4, stop_token_ids=(77,),
                                       logit_bias=((77, 100.0),), ignore_eos=True),
    })
    assert out["no_min"].output_token_ids == [eos] and out["no_min"].finish_reason == "stop"
    min4 = out["min4"].output_token_ids
    assert len(min4) == 5 and eos not in min4[:4] and min4[4] == eos and out["min4"].finish_reason == "stop"
    stop = out["min4_stop_id"].output_token_ids
    assert len(stop) == 5 and 77 not in stop[:4] and stop[4] == 77
    assert plain == plain_tokens


def _reference_greedy(model_dir, prompt: list[int], sampling: SamplingParams) -> list[int]:
    """Greedy decoding over the HF model's logits with logit_bias, then the penalties,
    applied as defined: repetition over prompt + output, frequency and presence over the
    output."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = list(prompt)
    for _ in range(sampling.max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1].float()
        outputs = tokens[len(prompt):]
        for t, bias in sampling.logit_bias:
            logits[t] += bias
        r = sampling.repetition_penalty
        for t in set(tokens):
            logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r
        for t in set(outputs):
            logits[t] -= sampling.frequency_penalty * outputs.count(t) + sampling.presence_penalty
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("penalties", [
    dict(repetition_penalty=1.8),
    dict(frequency_penalty=1.5),
    dict(presence_penalty=2.0),
    dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=-0.5),
], ids=["repetition", "frequency", "presence", "all"])
def test_penalties_change_greedy_output_as_the_reference_predicts(engine, tiny_llama_dir, penalties):
    biased = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logit_bias=((123, 8.0),))
    sampling = dataclasses.replace(biased, **penalties)
    out, plain = _run(engine, {"biased": biased, "penalized": sampling}, prompt=PROMPT + [123])
    assert out["biased"].output_token_ids == [123] * 10  # It repeats itself...
    got = out["penalized"].output_token_ids
    assert got != out["biased"].output_token_ids  # ...until penalized, exactly as defined.
    assert got == _reference_greedy(tiny_llama_dir, PROMPT + [123], sampling)
    plain_alone = engine.run([("alone", PROMPT + [123], PLAIN)])["alone"].output_token_ids
    assert plain == plain_alone  # The plain request beside them kept its tokens.
