"""What a fake scheduler answers besides its Session (the router's tests write their own
Session): serving info for one worker, no load, no KV events, health SERVING; and a
router's Generation over a scheduler at a port."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.metrics import NoOpMeter

from llmserve.contract import wire
from llmserve.contract.security import SecurityOptions
from llmserve.contract.worker_info import WorkerInfo
from llmserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from llmserve.router.generation import Generation
from llmserve.router.replicas import ReplicaSet
from llmserve.router.routing import make_policy
from llmserve.router.validation import ServedModel
from llmserve.telemetry import RouterMetrics

VOCAB = 49152  # SmolLM2's: the router checks prompt ids against it and detokenizes the outputs.


class FakeSchedulerBase(scheduler_pb2_grpc.SchedulerServicer, health_pb2_grpc.HealthServicer):
    """A subclass writes Session; `block_size` and `max_model_len` describe its worker."""

    block_size = 16
    max_model_len = 256

    async def GetServingInfo(self, request, context):
        info = WorkerInfo(model="m", model_path="/m", num_kv_blocks=64, block_size=self.block_size,
                          dtype="float32", max_model_len=self.max_model_len, vocab_size=VOCAB)
        return scheduler_pb2.ServingInfo(worker=wire.worker_info_to_pb(info), num_kv_blocks=64)

    async def GetLoad(self, request, context):
        return scheduler_pb2.Load()

    async def SubscribeKvEvents(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no KV events here")

    async def Check(self, request, context):
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


async def start_fake(fake: FakeSchedulerBase) -> tuple[grpc.aio.Server, int]:
    """`fake` serving the Scheduler and Health services on a local port: (server, port)."""
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(fake, server)
    health_pb2_grpc.add_HealthServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


@contextlib.asynccontextmanager
async def generation_at(port: int, tokenizer):
    """A router's Generation over the scheduler at `port` (insecure), once it is routable."""
    replicas = ReplicaSet(f"127.0.0.1:{port}", SecurityOptions(insecure=True), 1 << 22, make_policy("round-robin"))
    generation = Generation(tokenizer, replicas, RouterMetrics(NoOpMeter("test")))
    generation.served = ServedModel(name="m", max_model_len=256, vocab_size=VOCAB, max_prompt_bytes=1 << 16)
    try:
        await replicas.start(connect_timeout_s=10)
        async with asyncio.timeout(10):
            while not replicas.routable():
                await asyncio.sleep(0.01)
        yield generation
    finally:
        await replicas.close()
