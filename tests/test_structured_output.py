"""Structured output (issue #33, item 3): constrained decoding with xgrammar.

End to end on the embedded SmolLM2 (a real tokenizer; float32) in one process
(InProcessEngine, n-gram drafting on: constrained samples must get no drafts, which the
worker refuses), each constrained request batched with a plain one whose tokens must not
change: a JSON schema's output validates (jsonschema), a choice's is one of the choices,
a regex's matches in full, for greedy, seeded random and n > 1 samples. The worker's
matcher resumes where a preempted sample was. The HTTP front door answers a schema,
regex or grammar that cannot be compiled with a 400 naming the problem, before anything
is queued.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from types import SimpleNamespace

import jsonschema
import pytest
from opentelemetry.metrics import NoOpMeter

from llmserve.contract.plan import NewRequestData, StepPlan
from llmserve.contract.sampling import SamplingParams, StructuredOutput
from llmserve.model_store import default_model_dir
from llmserve.router.generation import Generation
from llmserve.router.placements import Placements
from llmserve.router.validation import ServedModel
from llmserve.telemetry import RouterMetrics

from .router.test_openai_http import CHAT, http

SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
     "required": ["ok", "color"], "additionalProperties": False},
]
PLAIN = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir()))


@pytest.fixture(scope="module")
def engine():
    from llmserve.launcher.engine import InProcessEngine

    return InProcessEngine.from_model_dir(default_model_dir(), dtype="float32", num_kv_blocks=256,
                                          num_speculative_tokens=3)


@pytest.fixture(scope="module")
def prompt(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Reply with a short JSON answer."}],
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text)


def _run(engine, prompt, requests: dict[str, tuple[SamplingParams, int]]) -> dict[str, list]:
    """Every request (settings, n) batched with a plain one: request id -> each sample's
    (token ids, finish reason), and the plain one's tokens under "plain"."""
    engine.add_request("plain", prompt, PLAIN)
    for rid, (sampling, n) in requests.items():
        engine.add_request(rid, prompt, sampling, n=n)
    tokens, reasons = defaultdict(lambda: defaultdict(list)), {}
    while engine.scheduler.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id][out.index] += out.new_token_ids
            if out.finished:
                reasons[(out.request_id, out.index)] = out.finish_reason.name.lower()
    return {rid: [(tokens[rid][i], reasons[(rid, i)]) for i in sorted(tokens[rid])] for rid in tokens}


def _text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def plain_tokens(engine, prompt):
    return _run(engine, prompt, {})["plain"][0][0]


def test_json_output_validates_against_its_schema(engine, prompt, tokenizer, plain_tokens):
    requests = {}
    for i, schema in enumerate(SCHEMAS):
        so = StructuredOutput("json_schema", json.dumps(schema))
        requests[f"greedy{i}"] = (SamplingParams(max_tokens=48, temperature=0.0, structured_output=so), 1)
        requests[f"random{i}"] = (SamplingParams(max_tokens=48, temperature=1.0, seed=i, structured_output=so), 2)
    out = _run(engine, prompt, requests)
    # Any JSON object (the small model, asked for a short one, writes one that ends).
    ask = tokenizer.apply_chat_template([{"role": "user", "content": 'Reply with the JSON object {"ok": true}.'}],
                                        add_generation_prompt=True, tokenize=False)
    requests["object"] = (SamplingParams(max_tokens=48, temperature=0.0,
                                         structured_output=StructuredOutput("json_object")), 1)
    out["object"] = _run(engine, tokenizer.encode(ask), {"object": requests["object"]})["object"]
    assert out["plain"][0][0] == plain_tokens  # Unconstrained rows are untouched.
    for rid, samples in out.items():
        if rid == "plain":
            continue
        assert len(samples) == requests[rid][1]
        for ids, reason in samples:
            assert reason == "stop", (rid, _text(tokenizer, ids))  # Ended by the grammar (eos), not by length.
            value = json.loads(_text(tokenizer, ids))
            if rid == "object":
                assert isinstance(value, dict)
            else:
                jsonschema.validate(value, SCHEMAS[int(rid[-1])])


def test_choice_and_regex_outputs(engine, prompt, tokenizer, plain_tokens):
    choices = ["yes", "no", "maybe later"]
    regex = r"[a-z]{3}-[0-9]{2}"
    out = _run(engine, prompt, {
        "choice": (SamplingParams(max_tokens=16, temperature=1.0, seed=5,
                                  structured_output=StructuredOutput("choice", json.dumps(choices))), 3),
        "regex": (SamplingParams(max_tokens=16, temperature=1.0, seed=6,
                                 structured_output=StructuredOutput("regex", regex)), 2),
        "grammar": (SamplingParams(max_tokens=16, temperature=0.0,
                                   structured_output=StructuredOutput("grammar", 'root ::= "x" [0-9] [0-9]?')), 1),
    })
    assert out["plain"][0][0] == plain_tokens
    assert all(_text(tokenizer, ids) in choices for ids, _ in out["choice"])
    assert all(re.fullmatch(regex, _text(tokenizer, ids)) for ids, _ in out["regex"])
    assert re.fullmatch(r"x[0-9][0-9]?", _text(tokenizer, out["grammar"][0][0]))
    assert all(reason == "stop" for samples in out.values() for _, reason in samples if samples is not out["plain"])


# --- the worker's matchers -------------------------------------------------------


@pytest.fixture(scope="module")
def grammars(engine):
    return engine.runner.batch.grammars


def test_a_resent_sample_resumes_its_grammar(grammars, tokenizer):
    """Preemption resends a sample in full (prompt + outputs): its new matcher has
    accepted the outputs, and allows what the matcher that ran all along allows."""
    from llmserve.worker.input_batch import InputBatch

    so = StructuredOutput("json_schema", json.dumps(SCHEMAS[0]))
    outputs = tokenizer.encode('{"a": 4')
    running = grammars.matcher_for(so, [])
    for token_id in outputs:
        running.advance(token_id)
    batch = InputBatch(block_size=16, num_blocks=8, max_model_len=128, grammars=grammars)
    prompt = [1, 2, 3]
    sampling = SamplingParams(max_tokens=20, structured_output=so)
    rows = batch.apply_plan(StepPlan(step_id=0, new_requests=[
        NewRequestData(7, prompt + outputs, len(prompt), sampling, [0, 1], 0, len(prompt) + len(outputs))]))
    resumed = batch.states[7].grammar
    assert not resumed.ended
    inputs = batch.build_inputs(rows)
    mask = inputs.sampling.token_bitmask
    assert mask.rows.tolist() == [0] and mask.bits.tolist() == grammars.fill_bitmask([running]).bits.tolist()
    allowed = _allowed(mask.bits[0])
    assert tokenizer.encode("}")[0] in allowed and tokenizer.encode('"')[0] not in allowed


def test_a_complete_grammar_allows_only_eos_then_forces_it(grammars, tokenizer):
    (eos,) = grammars.eos_token_ids
    row = grammars.matcher_for(StructuredOutput("choice", '["yes"]'), tokenizer.encode("yes"))
    assert _allowed(grammars.fill_bitmask([row]).bits[0]) == [eos]  # Complete: only eos may follow.
    row.advance(eos)
    assert row.ended and _allowed(grammars.fill_bitmask([row]).bits[0]) == [eos]  # ignore_eos or not: eos.


def test_the_bitmask_holds_the_constrained_rows_only(grammars, tokenizer):
    """Unconstrained rows are left out of the mask: [C, W] bits and the C rows' indices."""
    choice = grammars.matcher_for(StructuredOutput("choice", '["yes"]'), [])
    ended = grammars.matcher_for(StructuredOutput("choice", '["yes"]'), tokenizer.encode("yes"))
    ended.advance(grammars.eos_token_ids[0])
    mask = grammars.fill_bitmask([None, choice, None, None, ended])
    assert mask.rows.tolist() == [1, 4] and mask.bits.shape == (2, (grammars.vocab_size + 31) // 32)
    assert tokenizer.encode("yes")[0] in _allowed(mask.bits[0])
    assert _allowed(mask.bits[1]) == list(grammars.eos_token_ids[:1])


def _allowed(bitmask_row) -> list[int]:
    """The token ids whose bit is set in one bitmask row ([W] int32)."""
    return [w * 32 + b for w, word in enumerate(bitmask_row.tolist()) for b in range(32) if word >> b & 1]


# --- the HTTP front door ---------------------------------------------------------


class _Ready(Generation):
    """A router with a tokenizer and no scheduler: every check before queueing runs."""

    @property
    def ready(self) -> bool:
        return True


@pytest.fixture
def router():
    from llmserve.router.tokenizer import PromptTokenizer

    generation = _Ready(tokenizer=PromptTokenizer.from_model_dir(default_model_dir()),
                        replicas=SimpleNamespace(placements=Placements()), metrics=RouterMetrics(NoOpMeter("test")))
    generation.served = ServedModel(name="m", max_model_len=2048, vocab_size=49152, max_prompt_bytes=1 << 20)
    return generation


@pytest.mark.parametrize("fields,problem", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     'json_schema: Unsupported type "bogus"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}},
     "json_schema: "),
    ({"guided_regex": "(ab"}, "regex: Regex parsing error at position 4: The parenthesis is not closed"),
    ({"guided_grammar": "root ::= foo"}, 'grammar: EBNF parser error at line 1, column 10: Rule "foo" is not defined'),
    ({"guided_choice": []}, "choice: the spec must be a non-empty JSON array"),
])
async def test_a_grammar_that_cannot_be_compiled_is_a_400_naming_the_problem(router, fields, problem):
    async with http(router) as client:
        reply = await client.post("/v1/chat/completions", json={**CHAT, **fields})
    assert reply.status_code == 400, reply.json()
    message = reply.json()["error"]["message"]
    assert "cannot be compiled" in message and problem in message, message
    assert len(router.placements) == 0  # Nothing claimed, nothing queued.


async def test_two_structured_outputs_at_once_are_refused(router):
    async with http(router) as client:
        reply = await client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "guided_regex": "a",
                                                           "guided_choice": ["a"]})
    assert reply.status_code == 400 and "ask for one structured output only" in reply.json()["error"]["message"]


def test_grpc_kinds_convert_and_an_unset_kind_is_refused():
    from llmserve.contract import wire
    from llmserve.router.validation import RequestError, check_sampling
    from llmserve.v1 import generation_pb2 as pb

    for number, kind in ((pb.STRUCTURED_OUTPUT_KIND_CHOICE, "choice"), (pb.STRUCTURED_OUTPUT_KIND_UNSPECIFIED, "")):
        params = pb.SamplingParams(structured_output=pb.StructuredOutput(kind=number, spec='["a"]'))
        sampling, _ = wire.sampling_from_public_pb(params)
        assert sampling.structured_output == StructuredOutput(kind, '["a"]')
    with pytest.raises(RequestError, match="structured_output.kind must be one of json_schema"):
        check_sampling(sampling, 1)
    assert wire.sampling_from_public_pb(pb.SamplingParams())[0].structured_output is None
