"""The scheduler's end of a worker's Execute stream: send a plan, await its result (and
interrupt a multi-step plan while it runs)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.contract import wire
from llmserve.contract.grpc_server import MAX_MESSAGE_BYTES, channel
from llmserve.contract.security import SecurityOptions
from llmserve.internal.v1 import worker_pb2_grpc
from llmserve.contract.plan import StepPlan, StepResult
from llmserve.contract.worker_info import WorkerInfo
from llmserve.telemetry import step_phases


class WorkerLost(RuntimeError):
    """The worker's stream ended or broke: its KV cache and request state are gone."""


class WorkerLink:
    def __init__(self, address: str, info: WorkerInfo, security: SecurityOptions,
                 max_message_bytes: int = MAX_MESSAGE_BYTES):
        self.address = address
        self.info = info
        # Mutual TLS: the scheduler's certificate; the worker must hold one for `address`.
        self._channel = channel(address, security, max_message_bytes)  # Step plans can be large.
        self._call = worker_pb2_grpc.WorkerStub(self._channel).Execute()
        # The multi-step plan the worker is running (its step id), until it is interrupted
        # or answered; None otherwise. Only then may an interrupt be written: grpc.aio
        # allows one write at a time, and the plan's write is done by then.
        self._interruptible: int | None = None
        self._interrupt_task: asyncio.Task | None = None
        # While a multi-step plan is being written, an interrupt asked for waits for the
        # write and follows it (a request that arrives then must not wait for the whole run).
        self._writing_multi_step = False
        self._interrupt_asked = False
        self._sent_at: dict[int, float] = {}  # step id -> when its send began (bench overhead's round trip)

    async def execute(self, plan: StepPlan) -> StepResult:
        await self.send(plan)
        return await self.receive(plan)

    async def send(self, plan: StepPlan) -> None:
        """Write the plan; the worker runs plans in the order sent and answers each."""
        self._sent_at[plan.step_id] = time.perf_counter()
        self._writing_multi_step = plan.num_steps > 1
        try:
            with step_phases.timed("encode"):
                command = wire.plan_command_to_pb(plan)
            await self._call.write(command)
        except grpc.aio.AioRpcError as err:
            raise WorkerLost(f"worker {self.address}: {err.code().name} {err.details()}") from err
        finally:
            asked, self._interrupt_asked, self._writing_multi_step = self._interrupt_asked, False, False
        if plan.num_steps > 1:  # Written: an interrupt may follow it from now on.
            self._interruptible = plan.step_id
            if asked:
                self.interrupt()

    async def receive(self, plan: StepPlan) -> StepResult:
        """The result of `plan`, the oldest plan sent and not yet answered."""
        try:
            reply = await self._call.read()
        except grpc.aio.AioRpcError as err:
            raise WorkerLost(f"worker {self.address}: {err.code().name} {err.details()}") from err
        finally:
            self._interruptible = None
            if self._interrupt_task is not None:  # Plans and interrupts never overlap in writing.
                await asyncio.gather(self._interrupt_task, return_exceptions=True)
                self._interrupt_task = None
        if reply is grpc.aio.EOF:
            raise WorkerLost(f"worker {self.address} closed its stream")
        with step_phases.timed("encode"):
            result = wire.step_result_from_pb(reply)
        if (sent := self._sent_at.pop(plan.step_id, None)) is not None:
            # From writing the plan to its decoded result, whatever the loop did meanwhile
            # (with two plans in flight a reply may wait for the loop to come back to it).
            step_phases.add("round_trip", time.perf_counter() - sent)
        if result.step_id != plan.step_id:
            raise WorkerLost(f"worker {self.address} answered step {result.step_id}, expected {plan.step_id}")
        return result

    def interrupt(self) -> None:
        """Cut the multi-step plan in flight short after the worker's current step (a new
        request should not wait for the whole run). No-op when no such plan is in flight;
        asked while one is being written, it is written right after the plan."""
        if self._interruptible is None:
            self._interrupt_asked = self._interrupt_asked or self._writing_multi_step
            return
        command = wire.interrupt_command_to_pb(self._interruptible)
        self._interruptible = None
        self._interrupt_task = asyncio.ensure_future(self._call.write(command))

    async def alive(self) -> bool:
        """False when the worker cannot be reached (its process is gone). A slow answer
        from a busy worker still counts as alive."""
        try:
            await health_pb2_grpc.HealthStub(self._channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.aio.AioRpcError as err:
            return err.code() != grpc.StatusCode.UNAVAILABLE
        except grpc.aio.UsageError:  # Closed: the link was dropped meanwhile.
            return False
        return True

    async def close(self) -> None:
        self._call.cancel()
        await self._channel.close()


class WorkerGroup:
    """A TP x PP group of workers driven SPMD: every rank receives every plan; the
    sampled tokens come from the driver (the last PP stage's TP rank 0). Any rank lost,
    or a step not answered by every rank within `step_timeout_s`, loses the whole group."""

    def __init__(self, links: list[WorkerLink], driver: int, step_timeout_s: float):
        self.links, self.driver, self.step_timeout_s = links, driver, step_timeout_s
        d = links[driver]
        # NOTE: each rank sized its cache from the same budget and they agreed on the
        # minimum at start-up; the min here also covers ranks started with other flags.
        self.info = replace(d.info, num_kv_blocks=min(l.info.num_kv_blocks for l in links),
                            num_cpu_blocks=min(l.info.num_cpu_blocks for l in links))
        self.address = ",".join(l.address for l in links)

    async def execute(self, plan: StepPlan) -> StepResult:
        await self.send(plan)
        return await self.receive(plan)

    async def send(self, plan: StepPlan) -> None:
        await asyncio.gather(*(l.send(plan) for l in self.links))

    async def receive(self, plan: StepPlan) -> StepResult:
        """Every rank's answer to `plan` (the oldest unanswered), within step_timeout_s."""
        tasks = [asyncio.ensure_future(l.receive(plan)) for l in self.links]
        done, pending = await asyncio.wait(tasks, timeout=self.step_timeout_s, return_when=asyncio.FIRST_EXCEPTION)
        for t in pending:
            t.cancel()
        for t in done:
            if t.exception() is not None:
                raise t.exception()
        if pending:
            late = [self.links[i].address for i, t in enumerate(tasks) if t in pending]
            raise WorkerLost(f"worker(s) {', '.join(late)} did not answer step {plan.step_id} "
                             f"within {self.step_timeout_s:.0f} s")
        return tasks[self.driver].result()

    def interrupt(self) -> None:
        """Every rank gets it; the driver decides when the ranks stop (see ModelRunner)."""
        for link in self.links:
            link.interrupt()

    async def alive(self) -> bool:
        """False as soon as one rank cannot be reached: the group cannot step without it."""
        return all(await asyncio.gather(*(l.alive() for l in self.links)))

    async def close(self) -> None:
        for l in self.links:
            await l.close()
