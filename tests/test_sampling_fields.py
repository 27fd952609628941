"""Every sampling setting reaches the sampler through every conversion it takes.

A request's settings have one type per layer: a front door's (the gRPC API's
SamplingParams message, an OpenAI body) -> the router's SamplingParams dataclass -> the
internal SamplingParams message (router -> scheduler, scheduler -> worker) -> the same
dataclass -> the worker's per-row SamplingRows. Each conversion names every field, so a
field added to the dataclass without its line in one of them comes back as its default:
these tests walk `dataclasses.fields(SamplingParams)` with a non-default value for each
and fail there. A new field needs a value in SET below (the first test says so).
"""

from __future__ import annotations

import dataclasses

import pytest

from llmserve.contract import wire
from llmserve.contract.plan import NewRequestData, StepPlan
from llmserve.contract.sampling import ROUTER_ONLY_FIELDS, ROUTER_RESOLVED_FIELDS, SamplingParams, StructuredOutput
from llmserve.internal.v1 import scheduler_pb2, worker_pb2
from llmserve.router.openai.protocol import ChatCompletionRequest, CompletionRequest
from llmserve.router.validation import ServedModel, check_sampling, resolve_sampling
from llmserve.v1 import generation_pb2
from llmserve.worker.input_batch import InputBatch
from llmserve.worker.sampler import SamplingRows

# A valid value, unlike the default, for every field (floats exact in float32, as the
# wire carries them).
SET = dict(max_tokens=7, temperature=0.5, top_p=0.25, top_k=3, seed=-(2**40), ignore_eos=True, logprobs=2,
           prompt_logprobs=3,
           stop_token_ids=(5, 9), stop=("END", "\n\n"), repetition_penalty=1.25, frequency_penalty=0.5,
           presence_penalty=-0.75, min_p=0.125, logit_bias=((3, 1.5), (7, -2.0)), min_tokens=2,
           structured_output=StructuredOutput("regex", "[a-z]+"), bad_words=("foo", "bar baz"),
           bad_words_token_ids=((4,), (6, 8)))
FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]
SERVED = ServedModel(name="m", max_model_len=64, vocab_size=100, max_prompt_bytes=1 << 20)
PROMPT_LEN = 3


def _public_pb(**extra) -> generation_pb2.SamplingParams:
    """SET as a gRPC client sends it (a map field takes a dict, a message its fields;
    the router-resolved fields are not on the public API)."""
    structured = generation_pb2.StructuredOutput(kind=generation_pb2.STRUCTURED_OUTPUT_KIND_REGEX,
                                                 spec=SET["structured_output"].spec)
    public = {name: value for name, value in SET.items() if name not in ROUTER_RESOLVED_FIELDS}
    return generation_pb2.SamplingParams(**{**public, "logit_bias": dict(SET["logit_bias"]),
                                            "structured_output": structured}, **extra)


def _changed(sampling: SamplingParams) -> set[str]:
    """The fields that carry their SET value."""
    return {name for name in FIELDS if getattr(sampling, name) == SET[name]}


def test_every_field_has_a_test_value_unlike_its_default():
    assert sorted(SET) == sorted(FIELDS), "give each SamplingParams field a value in SET"
    default = SamplingParams()
    assert not _changed(default), "a SET value equals its field's default: it would prove nothing"


def test_grpc_params_convert_field_for_field():
    # NOTE: the public message names its fields as the dataclass does.
    pb = _public_pb(n=2)
    pb = generation_pb2.SamplingParams.FromString(pb.SerializeToString())
    sampling, n = wire.sampling_from_public_pb(pb)
    assert n == 2
    assert _changed(sampling) == set(FIELDS) - ROUTER_RESOLVED_FIELDS


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_openai_body_converts_field_for_field(endpoint):
    public = {name: value for name, value in SET.items() if name not in ROUTER_RESOLVED_FIELDS}
    body = {**public, "stop": list(SET["stop"]), "stop_token_ids": list(SET["stop_token_ids"]), "n": 2,
            "bad_words": list(SET["bad_words"]),
            "logit_bias": {str(t): b for t, b in SET["logit_bias"]},  # JSON's keys are strings.
            "structured_output": None, "guided_regex": SET["structured_output"].spec}
    if endpoint == "chat":  # Chat asks for logprobs as a flag and a count.
        body.update(logprobs=True, top_logprobs=SET["logprobs"])
        sampling, n = ChatCompletionRequest(model="m", messages=[], **body).sampling()
    else:
        sampling, n = CompletionRequest(model="m", prompt="hi", **body).sampling()
    assert n == 2
    assert _changed(sampling) == set(FIELDS) - ROUTER_RESOLVED_FIELDS


def test_the_router_keeps_every_field_through_validation_and_defaults():
    sampling, n = wire.sampling_from_public_pb(_public_pb())
    check_sampling(sampling, n)
    # (bad_words_token_ids: the router's tokenizer, router/generation.py; tests/router/test_router_tokenizer.py)
    assert resolve_sampling(sampling, PROMPT_LEN, SERVED) == dataclasses.replace(SamplingParams(**SET),
                                                                                bad_words_token_ids=())


def _through_the_scheduler(sampling: SamplingParams) -> SamplingParams:
    """Router -> scheduler: the AddRequest as the scheduler parses it."""
    add = wire.add_request_to_pb("r", [1, 2, 3], sampling)
    return wire.sampling_from_pb(scheduler_pb2.AddRequest.FromString(add.SerializeToString()).sampling)


def test_internal_wire_carries_every_field_but_the_router_only_ones():
    received = _through_the_scheduler(SamplingParams(**SET))
    assert _changed(received) == set(FIELDS) - ROUTER_ONLY_FIELDS
    assert all(getattr(received, name) == getattr(SamplingParams(), name) for name in ROUTER_ONLY_FIELDS)


def test_a_missing_conversion_line_fails(monkeypatch):
    forgetful = wire.sampling_from_pb

    def without_seed(msg):  # A from_pb that lost its `seed=` line.
        return dataclasses.replace(forgetful(msg), seed=None)

    monkeypatch.setattr(wire, "sampling_from_pb", without_seed)
    assert _changed(_through_the_scheduler(SamplingParams(**SET))) == set(FIELDS) - ROUTER_ONLY_FIELDS - {"seed"}


class _NoGrammars:
    """Grammars without a tokenizer: the sample's matcher is test_structured_output.py's."""

    def matcher_for(self, so, output_token_ids):
        return None


def test_the_worker_receives_the_same_type_and_samples_with_every_column():
    sent = dataclasses.replace(SamplingParams(**SET), stop=(), bad_words=())
    plan = StepPlan(step_id=0, new_requests=[NewRequestData(1, [1, 2, 3], PROMPT_LEN, sent, [0], 0, PROMPT_LEN)])
    plan = wire.step_plan_from_pb(worker_pb2.StepPlan.FromString(wire.step_plan_to_pb(plan).SerializeToString()))
    batch = InputBatch(block_size=4, num_blocks=8, max_model_len=64, grammars=_NoGrammars())
    rows = batch.apply_plan(plan)
    assert batch.states[1].sampling == sent
    inputs = batch.build_inputs(rows)
    # SamplingRows: one column per setting the sampler reads, named as the field; [S] = [1].
    columns = [f.name for f in dataclasses.fields(SamplingRows) if f.name not in SamplingRows.ROW_STATE]
    assert columns and set(columns) <= set(FIELDS)
    for name in columns:
        column = getattr(inputs.sampling, name)
        value = column.tolist() if hasattr(column, "tolist") else column
        assert value == [SET[name]], name
    assert inputs.sampling.output_index == [0]
    assert [list(h) for h in inputs.sampling.token_ids] == [[1, 2, 3]]  # (an int64 array: penalized)
    assert inputs.sampling.num_prompt_tokens == [PROMPT_LEN]
