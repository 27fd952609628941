"""Every number the public API accepts fits every field it is copied into.

Hypothesis draws each numeric field of a GenerateRequest over its type's whole range
(int32, int64, float32 with NaN and infinities) and sends the request through the same
conversions the services do: the router's validation, the router -> scheduler AddRequest,
the scheduler's per-sample records (seed + i for n > 1), its step plans on the worker
wire, the worker's sampler seeding, and the outputs back. The router may refuse a request
(INVALID_ARGUMENT); nothing after it may raise. Finding 1 of issue 17 was one such
number: seed 2**63 - 1 with n = 2 made sample 1's seed 2**63, which the worker's int64
field refused, and the scheduler's engine loop died.
"""

from __future__ import annotations

import grpc
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmserve.contract import wire
from llmserve.contract.sampling import INT64_MAX, INT64_MIN
from llmserve.internal.v1 import scheduler_pb2, worker_pb2
from llmserve.router.validation import MAX_N, RequestError, ServedModel, check_sampling, resolve_sampling
from llmserve.v1 import generation_pb2
from llmserve.worker.sampler import seeded_generator_seed

from tests.scheduler.scheduler_testkit import FakeWorker, build_scheduler

INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(INT64_MIN, INT64_MAX)
FLOAT32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
SERVED = ServedModel(name="m", max_model_len=32, vocab_size=100, max_prompt_bytes=1 << 20)
PROMPT = [5, 6, 7, 8, 9]


def edge(strategy, *values):
    """The strategy, with the type's edges drawn often."""
    return st.one_of(st.sampled_from(values), strategy)


@st.composite
def public_params(draw) -> tuple[generation_pb2.SamplingParams, int]:
    params = generation_pb2.SamplingParams(
        top_k=draw(edge(INT32, -(2**31), -1, 0, 1, 2**31 - 1)),
        ignore_eos=draw(st.booleans()),
        stop_token_ids=draw(st.lists(edge(INT32, -(2**31), -1, 0, 99, 100, 2**31 - 1), max_size=3)),
    )
    for name, strategy in (("max_tokens", edge(INT32, -(2**31), 0, 1, 2**31 - 1)),
                           ("temperature", edge(FLOAT32, 0.0, 1.0)),
                           ("top_p", edge(FLOAT32, 1.0, 0.5)),
                           ("seed", edge(INT64, INT64_MIN, -1, 0, INT64_MAX - 1, INT64_MAX)),
                           ("n", edge(INT32, -(2**31), 0, 1, 2, 4, 2**31 - 1)),
                           ("logprobs", edge(INT32, -(2**31), 0, 1, 20, 2**31 - 1))):
        if draw(st.booleans()):
            setattr(params, name, draw(strategy))
    priority = draw(edge(INT32, -(2**31), 0, 2**31 - 1))
    return params, priority


def roundtrip(message, cls):
    """What the other process parses (serialization checks every field's range)."""
    return cls.FromString(message.SerializeToString())


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(public_params())
def test_every_accepted_number_fits_from_router_to_worker_and_back(drawn):
    params, priority = drawn
    request = roundtrip(generation_pb2.GenerateRequest(text="hi", params=params, priority=priority),
                        generation_pb2.GenerateRequest)
    # Router: validate, resolve defaults (the prompt is 5 tokens).
    try:
        asked, n = wire.sampling_from_public_pb(request.params)
        check_sampling(asked, n)
        sampling = resolve_sampling(asked, len(PROMPT), SERVED)
    except RequestError as err:
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.message
        return
    # Router -> scheduler.
    add = roundtrip(wire.add_request_to_pb("r", PROMPT, sampling, n=n, priority=request.priority),
                    scheduler_pb2.AddRequest)
    received = wire.sampling_from_pb(add.sampling)
    assert (received.seed, received.max_tokens, received.top_k, received.logprobs) == (
        sampling.seed, sampling.max_tokens, sampling.top_k, sampling.logprobs)
    # Scheduler: its records, its plans on the worker wire, results back, outputs out.
    # Room for the largest n the router accepts: MAX_N samples of the 5-token prompt hold
    # 2 blocks of 4 tokens each (a smaller cache refuses n >= 33 as too big for it).
    sched = build_scheduler(dict(max_model_len=SERVED.max_model_len, block_size=4, max_num_seqs=MAX_N),
                            num_blocks=2 * MAX_N, eos=[0])
    sched.add_request(add.request_id, list(add.prompt_token_ids), received, n=add.n or 1, priority=add.priority)
    worker = FakeWorker(4)
    for _ in range(3):
        plan = sched.schedule()
        if plan.is_empty:
            break
        plan = wire.step_plan_from_pb(roundtrip(wire.step_plan_to_pb(plan), worker_pb2.StepPlan))
        for row in plan.new_requests:  # The worker seeds its generator from each row's seed.
            if row.sampling.seed is not None:
                assert INT64_MIN <= row.sampling.seed <= INT64_MAX
                torch.Generator().manual_seed(seeded_generator_seed(row.sampling.seed, 0))
        result = worker.execute(plan)
        result = wire.step_result_from_pb(roundtrip(wire.step_result_to_pb(result), worker_pb2.StepResult))
        for out in sched.update_from_output(plan, result):
            roundtrip(wire.request_output_to_pb(out), scheduler_pb2.RequestOutput)
    assert sched.audit().ok
