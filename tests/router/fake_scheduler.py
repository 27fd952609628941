"""What a fake scheduler answers besides its Session (the router's tests write their own
Session): serving info for one worker, no load, no KV events, health SERVING."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.contract import wire
from llmserve.contract.worker_info import WorkerInfo
from llmserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc

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
