"""The router's one table of requests, through a mixed workload: a real `Generation`
and `ReplicaSet` over two fake schedulers (in-process gRPC servers speaking the
Session protocol), each request ending a different way: finished, cancelled by its
client, closed early, failed by the scheduler, migrated between the two replicas
(an UNAVAILABLE output, then a lost session), past its deadline, refused, rejected.
Afterwards nothing of any request may remain: no placement record, no queue on a
link, no in-flight count, no pending abort; and each request's telemetry ended once,
with its own finish reason."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from opentelemetry.metrics import NoOpMeter

from llmserve.contract import wire
from llmserve.contract.outputs import ErrorCode, FinishReason, RequestOutput
from llmserve.contract.security import SecurityOptions
from llmserve.internal.v1 import scheduler_pb2
from llmserve.router.generation import Generation, GenerationError
from llmserve.router.replicas import ReplicaSet
from llmserve.router.routing import make_policy
from llmserve.router.validation import ServedModel
from llmserve.telemetry import RouterMetrics
from llmserve.v1 import generation_pb2 as pb

from .fake_scheduler import VOCAB, FakeSchedulerBase, start_fake

# What a fake scheduler does with a request, named by its prompt's first token.
FINISH, HANG, FAIL, MIGRATE, EXPIRE, REFUSE, LOSE = 10, 11, 12, 13, 14, 15, 16
PROMPT = [5, 6, 7]  # After the scenario token.
TOKENS = [1000, 1001, 1002, 1003]  # What every request generates (max_tokens 4), in order.


class FakeScheduler(FakeSchedulerBase):
    """A scheduler with a worker: each add runs as a task writing outputs to the session.
    `first`: shared between the fakes, which replica saw a request id first (a migrated
    request fails on its first replica and finishes on the second)."""

    block_size = 4
    max_model_len = 64

    def __init__(self, name: str, first: dict[str, str]):
        self.name, self.first = name, first
        self.adds: list[scheduler_pb2.AddRequest] = []
        self.aborted: list[str] = []
        self.streaming = asyncio.Event()  # A LOSE request has streamed its tokens here.
        self._tasks: dict[str, asyncio.Task] = {}

    async def Session(self, request_iterator, context):
        outbox: asyncio.Queue = asyncio.Queue()

        def send(out: RequestOutput) -> None:
            outbox.put_nowait(scheduler_pb2.SchedulerUpdate(outputs=[wire.request_output_to_pb(out)]))

        reader = asyncio.create_task(self._read(context, send))
        try:
            while True:
                await context.write(await outbox.get())
        finally:
            reader.cancel()
            for task in self._tasks.values():
                task.cancel()

    async def _read(self, context, send) -> None:
        while (message := await context.read()) != grpc.aio.EOF:
            if message.HasField("add"):
                self.adds.append(message.add)
                self._tasks[message.add.request_id] = asyncio.create_task(self._run(message.add, send))
            for request_id in message.abort.request_ids:
                self.aborted.append(request_id)
                if (task := self._tasks.pop(request_id, None)) is not None:
                    task.cancel()
                # As the real scheduler does; the router has released the request by now,
                # so this output must reach nobody.
                send(RequestOutput(request_id, finish_reason=FinishReason.ABORT))

    async def _run(self, add: scheduler_pb2.AddRequest, send) -> None:
        rid, kind = add.request_id, add.prompt_token_ids[0]
        if kind == REFUSE:
            send(error(rid, ErrorCode.RESOURCE_EXHAUSTED, "the queue is full", retry_after_ms=1500))
            return
        if kind == EXPIRE:
            await asyncio.sleep(add.deadline_ms / 1000)
            send(error(rid, ErrorCode.DEADLINE_EXCEEDED, "deadline exceeded"))
            return
        first_here = self.first.setdefault(rid, self.name) == self.name
        if kind in (MIGRATE, LOSE) and first_here:
            for token in TOKENS[:2]:
                send(RequestOutput(rid, new_token_ids=[token]))
            if kind == MIGRATE:
                send(error(rid, ErrorCode.UNAVAILABLE, "worker lost"))
            else:
                self.streaming.set()  # The test stops this server now.
            return
        done = len(add.prompt_token_ids) - 1 - len(PROMPT)  # Tokens streamed before a migration.
        for i in range(add.sampling.max_tokens):
            await asyncio.sleep(0.001)
            if kind == HANG and i == 1:
                await asyncio.Event().wait()  # Runs until aborted.
            if kind == FAIL and i == 1:
                send(error(rid, ErrorCode.INTERNAL, "worker step failed"))
                return
            last = i == add.sampling.max_tokens - 1
            send(RequestOutput(rid, new_token_ids=[TOKENS[done + i]],
                               finish_reason=FinishReason.LENGTH if last else FinishReason.NONE))


def error(request_id: str, code: ErrorCode, message: str, retry_after_ms: int = 0) -> RequestOutput:
    return RequestOutput(request_id, finish_reason=FinishReason.ERROR, error=message, error_code=code,
                         retry_after_ms=retry_after_ms)


class RecordingMetrics(RouterMetrics):
    """Each request's finish reason and each routing decision, as the router reports them."""

    def __init__(self):
        super().__init__(NoOpMeter("test"))
        self.finished: list[str] = []
        self.placed: list[str] = []

    def request_finished(self, arrival, first_token, num_tokens, finish_reason) -> None:
        self.finished.append(finish_reason)

    def request_routed(self, replica, policy, expected_cached_tokens) -> None:
        self.placed.append(replica)


@contextlib.asynccontextmanager
async def router(smollm2):
    """A Generation over two fake schedulers, both serving."""
    first: dict[str, str] = {}
    fakes, servers = [], []
    for name in ("a", "b"):
        fake = FakeScheduler(name, first)
        server, fake.port = await start_fake(fake)
        fakes.append(fake)
        servers.append(server)
    replicas = ReplicaSet(",".join(f"127.0.0.1:{f.port}" for f in fakes), SecurityOptions(insecure=True),
                          1 << 22, make_policy("round-robin"))
    generation = Generation(smollm2, replicas, RecordingMetrics())
    generation.served = ServedModel(name="m", max_model_len=64, vocab_size=VOCAB, max_prompt_bytes=1 << 16)
    try:
        await replicas.start(connect_timeout_s=10)
        async with asyncio.timeout(10):
            while len(replicas.routable()) < 2:
                await asyncio.sleep(0.01)
        yield generation, fakes, servers
    finally:
        await replicas.close()
        for server in servers:
            await server.stop(grace=None)


def request(request_id: str, kind: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, model="m", token_ids=pb.TokenIds(ids=[kind] + PROMPT),
                              params=pb.SamplingParams(max_tokens=len(TOKENS), temperature=0.0))


async def collect(generation: Generation, req: pb.GenerateRequest, deadline_ms: int = 0):
    """(token ids, the last output) of a request run to its end."""
    ids, last = [], None
    async for out in generation.generate(req, deadline_ms=deadline_ms):
        ids += out.delta.token_ids
        last = out
    return ids, last


async def first_token_then_hold(generation: Generation, req: pb.GenerateRequest, started: asyncio.Event):
    """Reads one output, then waits for more (which never come): a client mid-stream."""
    async with contextlib.aclosing(generation.generate(req)) as outputs:
        async for _ in outputs:
            started.set()


def assert_no_request_left(generation: Generation) -> None:
    replicas = list(generation.replicas.replicas.values())
    assert len(generation.placements) == 0
    assert [generation.placements.on(r.link) for r in replicas] == [[], []]
    assert [r.in_flight for r in replicas] == [0, 0]
    assert not generation._aborts


async def test_every_table_is_empty_after_a_mixed_workload(smollm2):
    async with router(smollm2) as (generation, fakes, _):
        # Two clients mid-stream: their records exist, on a replica each (round-robin).
        held = {name: asyncio.Event() for name in ("cancel", "close")}
        cancel = asyncio.create_task(first_token_then_hold(generation, request("cancel", HANG), held["cancel"]))
        close_gen = generation.generate(request("close", HANG))
        assert (await anext(close_gen)).delta.token_ids == TOKENS[:1]
        await asyncio.wait_for(held["cancel"].wait(), 5)
        assert {r.request_id for r in generation.placements} == {"cancel", "close"}
        assert sorted(r.in_flight for r in generation.replicas.replicas.values()) == [1, 1]
        # A second request under a running one's id is refused before it is placed.
        with pytest.raises(GenerationError) as taken:
            await collect(generation, request("cancel", FINISH))
        assert taken.value.code == grpc.StatusCode.ALREADY_EXISTS

        results = await asyncio.gather(
            collect(generation, request("finish", FINISH)),
            collect(generation, request("fail", FAIL)),
            collect(generation, request("migrate", MIGRATE)),
            collect(generation, request("expire", EXPIRE), deadline_ms=50),
            collect(generation, request("refuse", REFUSE)),
            return_exceptions=True)
        finish, fail, migrate, expire, refuse = results
        cancel.cancel()
        await close_gen.aclose()
        with pytest.raises(asyncio.CancelledError):
            await cancel

        assert finish[0] == TOKENS and finish[1].delta.finish_reason == FinishReason.LENGTH
        assert finish[1].usage.to_pb() == pb.Usage(prompt_tokens=4, completion_tokens=4, cached_tokens=0)
        assert (fail.code, fail.message) == (grpc.StatusCode.INTERNAL, "worker step failed")
        # No token lost or repeated across the two replicas; the second resumed after two.
        assert migrate[0] == TOKENS and migrate[1].usage.completion_tokens == 4
        adds = [[a for a in f.adds if a.request_id == "migrate"] for f in fakes]
        assert [len(a) for a in adds] == [1, 1]  # One on each replica.
        assert sorted((list(a.prompt_token_ids[4:]), a.sampling.max_tokens) for a, in adds) == [
            ([], 4), (TOKENS[:2], 2)]
        assert expire.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert [a.deadline_ms for f in fakes for a in f.adds if a.request_id == "expire"] == [50]
        assert (refuse.code, refuse.retry_after_ms) == (grpc.StatusCode.RESOURCE_EXHAUSTED, 1500)

        assert_no_request_left(generation)
        # Only the requests whose engine still ran them are aborted there, once each.
        async with asyncio.timeout(5):
            while sorted(i for f in fakes for i in f.aborted) != ["cancel", "close"]:
                await asyncio.sleep(0.01)
        assert sorted(generation.metrics.finished) == sorted(
            ["rejected", "abort", "abort", "length", "error", "length", "error", "refused"])
        assert len(generation.metrics.placed) == 8  # Seven requests placed, the migrated one twice.


async def test_a_lost_session_migrates_its_requests_and_leaves_nothing(smollm2):
    async with router(smollm2) as (generation, fakes, servers):
        running = asyncio.create_task(collect(generation, request("lose", LOSE)))
        async with asyncio.timeout(5):
            while not any(f.streaming.is_set() for f in fakes):
                await asyncio.sleep(0.01)
        lost = next(i for i, f in enumerate(fakes) if f.streaming.is_set())
        await servers[lost].stop(grace=None)  # Its session breaks: the link fails what it ran.
        ids, last = await asyncio.wait_for(running, 10)
        assert ids == TOKENS and last.delta.finish_reason == FinishReason.LENGTH
        assert [len(f.adds) for f in fakes] == [1, 1]
        assert_no_request_left(generation)


async def test_a_client_cancelled_twice_still_frees_its_id(smollm2):
    """An HTTP server may cancel a handler again while it waits for its abort to be
    written: the abort still goes out (its own task), and the record is released anyway
    (else its id would be taken for good, and a drain would wait for it forever)."""
    async with router(smollm2) as (generation, fakes, _):
        held = asyncio.Event()
        client = asyncio.create_task(first_token_then_hold(generation, request("twice", HANG), held))
        await asyncio.wait_for(held.wait(), 5)
        link = generation.placements.get("twice").replica.link
        async with link._write_lock:  # Holds the abort back.
            client.cancel()
            await asyncio.sleep(0.05)  # Its release now waits on the abort's write.
            assert generation._aborts
            client.cancel()
            with pytest.raises(asyncio.CancelledError):
                await client
            assert generation.placements.get("twice") is None
        async with asyncio.timeout(5):
            while [i for f in fakes for i in f.aborted] != ["twice"]:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0)  # The abort task's done callback.
        assert_no_request_left(generation)
