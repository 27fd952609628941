"""One record per request: after a mixed workload through the scheduler service (fake
worker, fake router streams) nothing is left anywhere: no request or sample in the core,
no record waiting to be handed over, no router session, no held tokens or open spans on
any record, and every KV block back in the pool."""

from __future__ import annotations

import asyncio
import time

import grpc

from llmserve.contract import wire
from llmserve.contract.grpc_server import ServiceServer
from llmserve.contract.outputs import ErrorCode, FinishReason
from llmserve.contract.plan import StepPlan, StepResult
from llmserve.contract.sampling import SamplingParams
from llmserve.contract.security import SecurityOptions
from llmserve.internal.v1 import scheduler_pb2
from llmserve.scheduler.config import SchedulerServiceConfig
from llmserve.scheduler.service import SchedulerServicer

from .scheduler_testkit import make_scheduler
from .test_engine_loop import ScriptedWorker


class RouterStream:
    """The router's end of one Session stream (the `context` RouterHub.serve reads and
    writes): messages queued for the scheduler, and every update written back."""

    def __init__(self, servicer: SchedulerServicer):
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.updates: list[scheduler_pb2.SchedulerUpdate] = []
        self.task = asyncio.create_task(servicer.routers.serve(self, servicer))

    async def read(self):
        return await self.inbox.get()

    async def write(self, update) -> None:
        self.updates.append(update)

    def add(self, request_id: str, prompt: list[int], max_tokens: int, n: int = 1, deadline_ms: int = 0) -> None:
        add = wire.add_request_to_pb(request_id, prompt, SamplingParams(max_tokens=max_tokens), n=n,
                                     deadline_ms=deadline_ms)
        self.inbox.put_nowait(scheduler_pb2.RouterMessage(add=add))

    def abort(self, *request_ids: str) -> None:
        self.inbox.put_nowait(scheduler_pb2.RouterMessage(abort=scheduler_pb2.AbortRequests(request_ids=request_ids)))

    def end(self) -> None:
        self.inbox.put_nowait(grpc.aio.EOF)

    def outputs(self, request_id: str) -> list[scheduler_pb2.RequestOutput]:
        return [o for u in self.updates for o in u.outputs if o.request_id == request_id]

    def ends(self, request_id: str) -> dict[int, tuple[FinishReason, ErrorCode]]:
        """Sample index -> (finish reason, error code) of the request's end outputs."""
        return {o.index: (FinishReason(o.finish_reason), ErrorCode(o.error_code))
                for o in self.outputs(request_id) if o.finish_reason != FinishReason.NONE}

    def num_tokens(self, request_id: str) -> int:
        return sum(len(o.new_token_ids) for o in self.outputs(request_id))


class SlowWorker(ScriptedWorker):
    """2 ms steps, so a router's abort or a deadline lands mid-request; plans that carry
    a sample of a request named in `failing` cannot be sent."""

    def __init__(self):
        super().__init__(fail=self._fail)
        self.failing: set[str] = set()
        self.core = None

    def _fail(self, plan: StepPlan) -> None:
        for row in plan.new_requests + plan.cached_requests:
            sample = self.core.get_sample(row.seq_id)
            if sample is not None and sample.request.request_id in self.failing:
                raise ValueError("the plan could not be encoded")

    async def execute(self, plan: StepPlan) -> StepResult:
        await asyncio.sleep(0.002)
        return await super().execute(plan)


async def until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.002)


async def test_a_mixed_workload_leaves_every_table_empty_and_every_block_free():
    server = ServiceServer("llmserve.internal.v1.Scheduler", "127.0.0.1", 0, SecurityOptions(insecure=True))
    # stream_interval 2: tokens are held on the records between messages.
    servicer = SchedulerServicer(SchedulerServiceConfig(stream_interval=2), server)
    worker = SlowWorker()
    core = worker.core = make_scheduler(num_blocks=24, block_size=4, max_model_len=64, enable_prefix_caching=True)
    engine = servicer.new_engine(core, worker)
    loop_task = engine.start_loop()
    records = []  # Every record the core ever held for a router: checked at the end.
    keep = lambda request_id: records.append(core.get_request(request_id))  # noqa: E731
    a, b, c = RouterStream(servicer), RouterStream(servicer), RouterStream(servicer)

    # Finished (n = 2), a duplicate id while it runs, and one that can never fit.
    a.add("done", [1, 2, 3, 4, 5], max_tokens=3, n=2)
    await until(lambda: core.get_request("done") is not None)
    keep("done")
    a.add("done", [9, 9], max_tokens=1)
    a.add("too-long", list(range(1, 80)), max_tokens=1)
    await until(lambda: len(a.ends("done")) == 2 and a.ends("too-long"))

    # Errored: its plan cannot be sent to the worker.
    worker.failing.add("bad")
    a.add("bad", [7, 8, 9], max_tokens=5)
    await until(lambda: core.get_request("bad") is not None)
    keep("bad")
    await until(lambda: a.ends("bad"))

    # Aborted by its router mid-stream; expired by its deadline; router B's requests: one
    # migrated off (B aborts it) and re-added by router C under the same id, one left
    # running when B's stream ends.
    a.add("abort-me", [11, 12, 13], max_tokens=50)
    a.add("late", [21, 22, 23, 24, 25, 26], max_tokens=50, deadline_ms=40)
    b.add("moving", [31, 32, 33], max_tokens=50)
    b.add("orphan", [41, 42, 43, 44], max_tokens=50, n=2)
    await until(lambda: all(core.get_request(r) is not None for r in ("abort-me", "late", "moving", "orphan")))
    for request_id in ("abort-me", "late", "moving", "orphan"):
        keep(request_id)
    await until(lambda: a.num_tokens("abort-me") >= 2 and b.num_tokens("moving") >= 2)
    a.abort("abort-me")
    b.abort("moving")
    await until(lambda: b.ends("moving"))
    c.add("moving", [31, 32, 33], max_tokens=4)
    await until(lambda: core.get_request("moving") is not None)
    keep("moving")
    b.end()
    await asyncio.wait_for(b.task, 5)
    await until(lambda: a.ends("late") and c.ends("moving") and not core.has_unfinished_requests())
    a.end()
    c.end()
    await asyncio.wait_for(asyncio.gather(a.task, c.task), 5)

    assert a.ends("done") == {0: (FinishReason.LENGTH, ErrorCode.OK), 1: (FinishReason.LENGTH, ErrorCode.OK)}
    assert a.num_tokens("done") == 6  # 3 per sample, whatever was held back in between.
    [dup] = [o for o in a.outputs("done") if o.error_code == ErrorCode.ALREADY_EXISTS]
    assert dup.finish_reason == FinishReason.ERROR
    assert a.ends("too-long") == {0: (FinishReason.ERROR, ErrorCode.INVALID_ARGUMENT)}
    assert a.ends("bad") == {0: (FinishReason.ERROR, ErrorCode.INTERNAL)}
    assert a.ends("abort-me") == {0: (FinishReason.ABORT, ErrorCode.OK)}
    assert a.ends("late") == {0: (FinishReason.ERROR, ErrorCode.DEADLINE_EXCEEDED)}
    assert b.ends("moving") == {0: (FinishReason.ABORT, ErrorCode.OK)}
    assert c.ends("moving") == {0: (FinishReason.LENGTH, ErrorCode.OK)} and c.num_tokens("moving") == 4
    assert not b.ends("orphan")  # Its router was gone: nobody to tell.
    assert core.stats().num_aborted == 1 + 1 + 2  # abort-me, moving (the first), orphan's 2 samples.

    # The tables: the core's requests and samples, records awaiting hand-over, sessions.
    assert core.unfinished_requests() == [] and core.live.samples() == [] and core.take_ended() == []
    assert servicer.routers.sessions == set()
    assert len(records) == 7 and all(r is not None and r.is_finished for r in records)
    assert all(r.stream.held == {} and r.stream.spans is None for r in records)
    # The blocks: nobody holds one; every block is free (cached ones count as free).
    audit = core.audit()
    assert audit.ok and audit.num_orphaned_blocks == 0, audit.problems
    assert core.kv.num_free_blocks == core.kv.num_total_blocks == 24
    assert not engine.lost and not loop_task.done()  # The engine went on through all of it.
    loop_task.cancel()
    await asyncio.gather(loop_task, return_exceptions=True)
