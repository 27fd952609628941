"""The scheduler's end of a worker's Execute stream: send a plan, await its result."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve import wire
from llmserve.grpc_server import insecure_channel
from llmserve.internal.v1 import worker_pb2_grpc
from llmserve.plan import StepPlan, StepResult
from llmserve.worker_info import WorkerInfo


class WorkerLost(RuntimeError):
    """The worker's stream ended or broke: its KV cache and request state are gone."""


class WorkerLink:
    def __init__(self, address: str, info: WorkerInfo):
        self.address = address
        self.info = info
        self._channel = insecure_channel(address)
        self._call = worker_pb2_grpc.WorkerStub(self._channel).Execute()

    async def execute(self, plan: StepPlan) -> StepResult:
        try:
            await self._call.write(wire.step_plan_to_pb(plan))
            reply = await self._call.read()
        except grpc.aio.AioRpcError as err:
            raise WorkerLost(f"worker {self.address}: {err.code().name} {err.details()}") from err
        if reply is grpc.aio.EOF:
            raise WorkerLost(f"worker {self.address} closed its stream")
        result = wire.step_result_from_pb(reply)
        if result.step_id != plan.step_id:
            raise WorkerLost(f"worker {self.address} answered step {result.step_id}, expected {plan.step_id}")
        return result

    async def alive(self) -> bool:
        """False when the worker cannot be reached (its process is gone). A slow answer
        from a busy worker still counts as alive."""
        try:
            await health_pb2_grpc.HealthStub(self._channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.aio.AioRpcError as err:
            return err.code() != grpc.StatusCode.UNAVAILABLE
        return True

    async def close(self) -> None:
        self._call.cancel()
        await self._channel.close()
