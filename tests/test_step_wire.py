"""The Execute stream's packed columns (wire revision 2): cached rows and sampled tokens
cross as one array per field, round-trip exactly, refuse columns that disagree, and a
worker speaking another revision cannot register."""

from __future__ import annotations

import grpc
import pytest

from llmserve.contract import wire
from llmserve.contract.outputs import TokenLogprobs
from llmserve.contract.plan import CachedRequestData, SampledToken, StepPlan, StepResult
from llmserve.contract.security import SecurityOptions, channel_credentials
from llmserve.contract.worker_info import WorkerInfo
from llmserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2


def _roundtrip_plan(plan: StepPlan) -> StepPlan:
    return wire.step_plan_from_pb(worker_pb2.StepPlan.FromString(wire.step_plan_to_pb(plan).SerializeToString()))


def _roundtrip_result(result: StepResult) -> StepResult:
    msg = worker_pb2.StepResult.FromString(wire.step_result_to_pb(result).SerializeToString())
    return wire.step_result_from_pb(msg)


def test_cached_rows_and_sampled_tokens_are_scalar_columns():
    # NOTE: a message per row costs an allocation and a Python object per row at both ends.
    for message in (worker_pb2.CachedRows, worker_pb2.SampledTokens):
        for f in message.DESCRIPTOR.fields:
            if f.name != "logprobs":  # only rows that asked for logprobs carry a message
                assert f.message_type is None and f.is_repeated, (message.__name__, f.name)


def test_ragged_rows_round_trip_exactly():
    rows = [
        CachedRequestData(10, [], 300, 1),
        CachedRequestData(2**63 + 5, [7, 8], 31, 4, [101, 102, 103]),
        CachedRequestData(12, [9], 16, 1),
        CachedRequestData(13, [], 0, 64, []),
    ]
    plan = StepPlan(3, cached_requests=rows, finished_seq_ids=[4], num_steps=1)
    assert _roundtrip_plan(plan) == plan
    no_drafts = StepPlan(4, cached_requests=[CachedRequestData(1, [], 5, 1), CachedRequestData(2, [3], 7, 1)])
    msg = wire.step_plan_to_pb(no_drafts)
    assert list(msg.cached.num_drafts) == [] and list(msg.cached.new_block_ids) == [3]
    assert _roundtrip_plan(no_drafts) == no_drafts


def test_a_decode_plan_costs_a_few_bytes_per_row():
    rows = [CachedRequestData(1000 + i, [i] if i % 16 == 0 else [], 300 + i, 1) for i in range(256)]
    size = wire.step_plan_to_pb(StepPlan(9, cached_requests=rows)).ByteSize()
    assert size < 8 * 256, size  # seq id varint (2), computed (2), scheduled (1), block count (1)


def test_sampled_tokens_keep_order_and_logprobs_of_the_rows_that_asked():
    lp = TokenLogprobs(5, -0.25, (5, 6), (-0.25, -1.5))
    result = StepResult(7, [SampledToken(1, 5, lp), SampledToken(2, 9), SampledToken(1, 6, None),
                            SampledToken(3, 0, TokenLogprobs(0, -3.0))], num_steps=2)
    back = _roundtrip_result(result)
    assert back == result
    assert _roundtrip_result(StepResult(8, [], error="boom")) == StepResult(8, [], error="boom")


@pytest.mark.parametrize("damage, named", [
    (lambda m: m.plan.cached.num_computed_tokens.append(1), "2 seq ids"),
    (lambda m: m.plan.cached.new_block_ids.append(3), "new_block_ids"),
    (lambda m: m.plan.cached.num_drafts.extend([1]), "draft counts"),
])
def test_columns_that_disagree_are_refused_by_name(damage, named):
    plan = StepPlan(1, cached_requests=[CachedRequestData(1, [2], 3, 1), CachedRequestData(4, [], 5, 1)])
    msg = wire.plan_command_to_pb(plan)
    damage(msg)
    with pytest.raises(ValueError, match=named):
        wire.step_plan_from_pb(msg.plan)


def test_a_result_with_a_stray_logprobs_entry_is_refused():
    msg = wire.step_result_to_pb(StepResult(1, [SampledToken(1, 2)]))
    msg.sampled_tokens.logprobs_entry.append(5)
    msg.sampled_tokens.logprobs.add(token_id=2)
    with pytest.raises(ValueError, match="logprobs for entry 5 of 1"):
        wire.step_result_from_pb(msg)


async def test_a_worker_speaking_another_wire_revision_is_refused(credentials):
    from llmserve.contract.grpc_server import ServiceServer
    from llmserve.scheduler.config import SchedulerServiceConfig
    from llmserve.scheduler.service import SchedulerServicer

    security = SecurityOptions(tls_cert=credentials.cert("scheduler"), tls_key=credentials.key("scheduler"),
                               tls_ca=credentials.ca)
    config = SchedulerServiceConfig(security=security)
    server = ServiceServer("llmserve.internal.v1.Scheduler", "127.0.0.1", 0, config.security)
    servicer = SchedulerServicer(config, server)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server.server)
    await server.start()
    info = wire.worker_info_to_pb(WorkerInfo("m", "/m", 8, 16, "float32", 128, 100))
    assert info.wire_revision == wire.WIRE_REVISION
    info.wire_revision = wire.WIRE_REVISION - 1
    try:
        creds = channel_credentials(credentials.ca, credentials.cert("worker"), credentials.key("worker"))
        async with grpc.aio.secure_channel(f"localhost:{server.port}", creds) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await scheduler_pb2_grpc.SchedulerStub(ch).RegisterWorker(
                    scheduler_pb2.RegisterWorkerRequest(address="localhost:1", info=info), timeout=5)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert (f"speaks step wire revision {wire.WIRE_REVISION - 1} but this scheduler speaks "
                f"{wire.WIRE_REVISION}") in err.value.details()
        assert servicer.engine is None  # nothing started for it
    finally:
        await server.stop(None)


def test_request_outputs_cross_to_the_router_exactly():
    """Scheduler -> router outputs: every field round-trips (the router reads only what a
    message holds); an unknown error code reads INTERNAL, an unknown finish reason is refused."""
    from llmserve.contract.outputs import ErrorCode, FinishReason, RequestOutput

    lp = TokenLogprobs(7, -0.25, (7, 9), (-0.25, -1.5), 1)
    outputs = [
        RequestOutput("plain", new_token_ids=[5]),
        RequestOutput("first", index=2, new_token_ids=[5, 6], num_cached_tokens=32, logprobs=[lp, lp],
                      prompt_logprobs=[lp]),
        RequestOutput("stopped", new_token_ids=[2], finish_reason=FinishReason.STOP, stop_token_id=2),
        RequestOutput("refused", finish_reason=FinishReason.ERROR, error="too busy",
                      error_code=ErrorCode.RESOURCE_EXHAUSTED, retry_after_ms=250),
    ]
    for out in outputs:
        msg = scheduler_pb2.RequestOutput.FromString(wire.request_output_to_pb(out).SerializeToString())
        back = wire.request_output_from_pb(msg)
        assert back == out and type(back.finish_reason) is FinishReason and type(back.error_code) is ErrorCode
    newer = scheduler_pb2.RequestOutput(request_id="x", finish_reason=4, error_code=99)
    assert wire.request_output_from_pb(newer).error_code is ErrorCode.INTERNAL
    with pytest.raises(ValueError):
        wire.request_output_from_pb(scheduler_pb2.RequestOutput(request_id="x", finish_reason=42))
