"""The KV event stream and GetLoad: the event log's numbering, snapshots, resume and
dropping of slow subscribers (kv_events.py), and the scheduler service publishing the
core's block events over gRPC to a caller holding the router's certificate."""

import asyncio

import grpc
import pytest

from llmserve.contract.block_hash import prompt_block_hashes
from llmserve.contract.security import SecurityOptions, channel_credentials
from llmserve.contract.grpc_server import ServiceServer
from llmserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from llmserve.scheduler.block_events import AllBlocksCleared, BlockRemoved, BlockStored
from llmserve.scheduler.engine_session import EngineState
from llmserve.scheduler.kv_events import KvEventLog

from .scheduler_testkit import FakeWorker, make_scheduler, params

H = [bytes([i]) * 32 for i in range(8)]  # Stand-in block hashes.


def kinds(batch) -> list[str]:
    return [event.WhichOneof("event") for event in batch.events]


def no_snapshot():
    raise AssertionError("a snapshot was built where a replay was expected")


# --- the event log ---------------------------------------------------------------------


def test_batches_are_numbered_from_1_and_empty_steps_publish_nothing():
    log = KvEventLog(instance_id="abc")
    assert log.publish([], 4) is None
    first = log.publish([BlockStored(H[0], None), BlockStored(H[1], H[0])], 4)
    second = log.publish([BlockRemoved(H[1])], 4)
    assert (first.sequence, second.sequence, first.instance_id) == (1, 2, "abc")
    assert kinds(first) == ["stored", "stored"] and kinds(second) == ["removed"]
    assert first.events[1].stored.parent_block_hash == H[0] and first.events[0].stored.parent_block_hash == b""
    assert first.events[0].stored.num_tokens == 4 and not first.snapshot


def test_each_process_start_has_its_own_instance_id():
    assert KvEventLog().instance_id != KvEventLog().instance_id


async def test_a_new_subscriber_gets_a_snapshot_numbered_with_the_last_batch_then_what_follows():
    log = KvEventLog()
    log.publish([BlockStored(H[0], None)], 4)
    first, subscriber = log.subscribe(0, "", lambda: ([BlockStored(H[0], None)], 4))
    (snapshot,) = first
    assert snapshot.snapshot and snapshot.sequence == 1 and snapshot.block_size == 4
    assert kinds(snapshot) == ["cleared", "stored"] and snapshot.events[1].stored.block_hash == H[0]
    log.publish([BlockRemoved(H[0])], 4)
    assert subscriber.queue.get_nowait().sequence == 2


async def test_resuming_replays_exactly_the_batches_after_the_last_one_seen():
    log = KvEventLog()
    for i in range(5):
        log.publish([BlockStored(H[i], None)], 4)
    first, _ = log.subscribe(3, log.instance_id, no_snapshot)
    assert [b.sequence for b in first] == [4, 5]
    first, _ = log.subscribe(5, log.instance_id, no_snapshot)
    assert first == []


@pytest.mark.parametrize("after, instance", [(0, "same"), (2, "another"), (1, "same"), (9, "same")])
async def test_resume_gets_a_snapshot_when_the_batches_cannot_be_replayed(after, instance):
    log = KvEventLog(history=3)
    for i in range(5):  # The ring keeps 3, 4, 5: resuming after 1 would miss batch 2.
        log.publish([BlockStored(H[i], None)], 4)
    first, _ = log.subscribe(after, log.instance_id if instance == "same" else "feed", lambda: ([], 4))
    assert [(b.snapshot, b.sequence) for b in first] == [(True, 5)]
    first, _ = log.subscribe(2, log.instance_id, no_snapshot)  # Oldest kept - 1: still a replay.
    assert [b.sequence for b in first] == [3, 4, 5]


async def test_a_subscriber_that_falls_behind_is_dropped_and_publishing_never_waits():
    log = KvEventLog(queue_batches=2)
    _, slow = log.subscribe(0, "", lambda: ([], 4))
    _, fast = log.subscribe(0, "", lambda: ([], 4))
    for i in range(3):
        log.publish([BlockStored(H[i], None)], 4)
        fast.queue.get_nowait()
    assert slow.dropped and slow.queue.get_nowait() is None and slow.queue.empty()  # Its stream ends.
    assert log.subscribers == {fast} and log.num_dropped == 1
    log.publish([AllBlocksCleared()], 4)  # Dropped: nothing more is queued for it.
    assert slow.queue.empty() and fast.queue.get_nowait().sequence == 4


# --- the service -----------------------------------------------------------------------


@pytest.fixture
async def service(credentials):
    """A SchedulerServicer on a real TLS port, with a prefix-caching core but no worker
    (steps are driven here with the fake worker), and a stub holding the router's
    certificate."""
    from llmserve.scheduler.config import SchedulerServiceConfig
    from llmserve.scheduler.service import SchedulerServicer

    security = SecurityOptions(tls_cert=credentials.cert("scheduler"), tls_key=credentials.key("scheduler"),
                               tls_ca=credentials.ca)
    config = SchedulerServiceConfig(security=security)
    server = ServiceServer("llmserve.internal.v1.Scheduler", "127.0.0.1", 0, security)
    servicer = SchedulerServicer(config, server)
    # An engine session whose loop never starts: the tests step its core themselves.
    servicer.new_engine(make_scheduler(num_blocks=8, block_size=4, enable_prefix_caching=True), worker=None)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server.server)
    await server.start()
    creds = channel_credentials(credentials.ca, credentials.cert("router"), credentials.key("router"))
    channel = grpc.aio.secure_channel(f"localhost:{server.port}", creds)
    try:
        yield servicer, scheduler_pb2_grpc.SchedulerStub(channel)
    finally:
        await channel.close()
        await server.stop(None)


def run_steps(servicer, worker: FakeWorker) -> None:
    """The engine loop's part: steps, each ending in a dispatch (which publishes)."""
    core = servicer.core
    while core.has_unfinished_requests():
        plan = core.schedule()
        servicer.engine.deliver(core.update_from_output(plan, worker.execute(plan)))


async def test_the_service_streams_a_snapshot_then_each_steps_events_to_the_router(service):
    servicer, stub = service
    stream = stub.SubscribeKvEvents(scheduler_pb2.SubscribeKvEventsRequest(), timeout=10)
    snapshot = await stream.read()
    assert snapshot.snapshot and kinds(snapshot) == ["cleared"] and snapshot.block_size == 4
    prompt = list(range(50, 60))
    servicer.core.add_request("a", prompt, params(max_tokens=2))
    run_steps(servicer, FakeWorker(4))
    batch = await stream.read()
    assert batch.sequence == snapshot.sequence + 1 and batch.instance_id == snapshot.instance_id
    h0, h1 = prompt_block_hashes(prompt, 4)
    assert [(e.stored.block_hash, e.stored.parent_block_hash) for e in batch.events] == [(h0, b""), (h1, h0)]

    # Resuming after that batch replays nothing; a later change comes next.
    resumed = stub.SubscribeKvEvents(scheduler_pb2.SubscribeKvEventsRequest(
        after_sequence=batch.sequence, instance_id=batch.instance_id), timeout=10)
    servicer.engine.forget_cached_blocks()  # What a lost worker does.
    for s in (stream, resumed):
        cleared = await s.read()
        assert cleared.sequence == batch.sequence + 1 and kinds(cleared) == ["cleared"]
    stream.cancel()
    resumed.cancel()


async def test_a_snapshot_lists_every_cached_block_parents_first(service):
    servicer, stub = service
    prompt = list(range(70, 83))
    servicer.core.add_request("a", prompt, params(max_tokens=1))
    run_steps(servicer, FakeWorker(4))
    stream = stub.SubscribeKvEvents(scheduler_pb2.SubscribeKvEventsRequest(after_sequence=1, instance_id="other"),
                                    timeout=10)
    snapshot = await stream.read()
    assert snapshot.snapshot and snapshot.sequence == servicer.kv_events.sequence
    assert kinds(snapshot)[0] == "cleared"
    assert [e.stored.block_hash for e in snapshot.events[1:]] == prompt_block_hashes(prompt, 4)
    stream.cancel()


async def test_get_load_reports_the_queues_and_serving_only_with_a_ready_worker(service):
    servicer, stub = service
    servicer.core.add_request("a", list(range(1, 11)), params(max_tokens=4))
    servicer.core.add_request("b", list(range(1, 7)), params(max_tokens=4))
    load = await stub.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=10)
    assert (load.num_waiting, load.num_running, load.num_waiting_tokens) == (2, 0, 16)
    assert (load.num_total_blocks, load.num_free_blocks, load.kv_usage) == (8, 8, 0.0)
    assert not load.serving  # No readiness step has run.
    plan = servicer.core.schedule()
    servicer.core.update_from_output(plan, FakeWorker(4).execute(plan))
    load = await stub.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=10)
    assert (load.num_waiting, load.num_running, load.num_waiting_tokens) == (0, 2, 0)
    assert load.num_free_blocks == 8 - 5 and load.kv_usage == pytest.approx(5 / 8)
    servicer.engine.state = EngineState.SERVING  # As after the readiness step.
    assert (await stub.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=10)).serving
    servicer.draining = True
    assert not (await stub.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=10)).serving


async def test_a_subscriber_that_falls_behind_sees_its_stream_end(service):
    servicer, stub = service
    servicer.kv_events.queue_batches = 1
    stream = stub.SubscribeKvEvents(scheduler_pb2.SubscribeKvEventsRequest(), timeout=10)
    await stream.read()  # The snapshot: the handler now waits on its queue.
    for i in range(3):  # Without an await between them: the handler cannot keep up.
        servicer.kv_events.publish([BlockStored(H[i], None)], 4)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        while True:
            await stream.read()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "resubscribe" in err.value.details()
    await asyncio.sleep(0)
    assert not servicer.kv_events.subscribers
