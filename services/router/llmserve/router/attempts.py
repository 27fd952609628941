"""Where one request runs: on the replica the routing policy picks, then, if that
replica fails it mid-stream (its scheduler or worker lost), on another one, resubmitted
with the prompt and the tokens streamed so far, so the client's stream continues with
no token lost or repeated.

    place ─▶ outputs ... UNAVAILABLE ─▶ unplace ─▶ place elsewhere (resume_from) ─▶ outputs ...

The request's state (replica, queue, replicas tried) is its `Placement` record; this
class holds the logic and what it needs to resubmit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from llmserve.contract.grpc_server import grpc_status
from llmserve.contract.outputs import ErrorCode, FinishReason, RequestOutput
from llmserve.contract.sampling import SamplingParams
from llmserve.router.placements import Placement
from llmserve.router.replicas import ReplicaSet
from llmserve.router.scheduler_link import SchedulerUnavailable

NO_REPLICA = "no worker is ready: the scheduler or worker is down"


class GenerationError(Exception):
    """Why a request ended without finishing: a gRPC status, its message, for a
    refusal by admission control the scheduler's retry hint, and for a refused field its
    name (OpenAI's error `param`)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_ms: int = 0, param: str | None = None):
        super().__init__(message)
        self.code, self.message, self.retry_after_ms, self.param = code, message, retry_after_ms, param


@dataclass(frozen=True)
class Job:
    """What a request asks of the engine: `n` samples of a prompt (one engine request,
    sharing the prompt's KV; sample i draws with seed + i). `deadline_ms`: what is left
    of the client's deadline (0: none); `cache_salt`: see GenerateRequest.cache_salt."""

    prompt_ids: list[int]
    sampling: SamplingParams
    n: int
    priority: int = 0
    deadline_ms: int = 0
    cache_salt: str = ""


class Attempts:
    """One request's runs on replicas: the first placement, and one more per migration.
    `draining()`: whether the router is shutting down (then nothing migrates)."""

    def __init__(self, replicas: ReplicaSet, record: Placement, job: Job, draining: Callable[[], bool]):
        self.replicas = replicas
        self.record = record
        self.job = job
        self._draining = draining
        self.generated: list[list[int]] = [[] for _ in range(job.n)]  # Each sample's tokens so far.
        self._held: RequestOutput | None = None  # An error output taken by queued_outputs, next_output's next.

    async def start(self, unfinished: set[int]) -> None:
        """Places the request; GenerationError if no replica can take it."""
        await self._place(self.job.prompt_ids, self.job.sampling, unfinished)

    async def next_output(self, unfinished: set[int]) -> RequestOutput:
        """The request's next output. A replica failing it is replaced on the way (that
        output never surfaces); a refusal by admission control raises GenerationError.
        `unfinished`: the samples the client has not seen end (what a new replica runs)."""
        record = self.record
        while True:
            out, self._held = self._held or await record.queue.get(), None
            if out.finished:
                record.engine_live.discard(out.index)
            if out.retry_after_ms and out.finish_reason == FinishReason.ERROR:
                # Refused (or displaced) before it ever ran: no delta, just the status
                # with its retry hint, as a client of a load-shedding server expects.
                record.engine_live.clear()
                record.outcome = ("refused", out.error)
                raise GenerationError(grpc_status(out.error_code), out.error, out.retry_after_ms)
            if not self._migratable(out):
                if 0 <= out.index < self.job.n:
                    self.generated[out.index].extend(out.new_token_ids)
                return out
            await self._migrate(unfinished)

    def queued_outputs(self) -> list[RequestOutput]:
        """The outputs already in the queue, taken without waiting (a consumer that fell
        behind catches up at once), up to the first error: that one, which may refuse or
        migrate the request, is left to next_output."""
        record, outs = self.record, []
        while self._held is None and not record.queue.empty():
            out = record.queue.get_nowait()
            if out.finish_reason == FinishReason.ERROR:
                self._held = out
                break
            if out.finished:
                record.engine_live.discard(out.index)
            if 0 <= out.index < self.job.n:
                self.generated[out.index].extend(out.new_token_ids)
            outs.append(out)
        return outs

    async def _migrate(self, unfinished: set[int]) -> None:
        """Its replica failed mid-stream: resume elsewhere from the prompt and the tokens
        so far (recomputed there), so the stream goes on where it stopped."""
        failed = self.replicas.placements.unplace(self.record)
        self.record.tried.append(failed)
        await self._place(*resume_from(self.job.prompt_ids, self.job.sampling, self.generated), unfinished)

    async def _place(self, prompt_ids: list[int], sampling: SamplingParams, unfinished: set[int]) -> None:
        """Sends the request to the replica the routing policy picks, not one that failed it."""
        record, job, placements = self.record, self.job, self.replicas.placements
        migrated, refused = bool(record.tried), []
        while True:
            choice = self.replicas.choose(prompt_ids, record.tried + refused, job.cache_salt)
            if choice is None:
                reason = ("no replica is left to resume it on: " if migrated else "") + NO_REPLICA
                record.outcome = ("error", reason)
                raise GenerationError(grpc.StatusCode.UNAVAILABLE, reason)
            replica, expected_cached = choice
            # NOTE: placed before the add is written: a client cancelling during the write
            # may leave it sent, and the record's release then aborts it there (an abort of
            # an unknown id is a no-op).
            placements.place(record, replica, unfinished)
            try:
                await replica.link.add(record.request_id, prompt_ids, sampling, n=job.n, priority=job.priority,
                                       trace_context=record.telemetry.trace_context(), deadline_ms=job.deadline_ms,
                                       cache_salt=job.cache_salt)
            except SchedulerUnavailable:
                placements.unplace(record)  # Its session just ended, before the write: try another.
                refused.append(replica)
                continue
            record.telemetry.routed(replica.name, self.replicas.policy.name, expected_cached, migrated=migrated)
            return

    def _migratable(self, out: RequestOutput) -> bool:
        """Whether this output is its replica failing the request (not the request failing),
        and the request can resume on another replica: one sample (or none started yet),
        not shutting down, and some other replica serves."""
        if out.finish_reason != FinishReason.ERROR or out.error_code != ErrorCode.UNAVAILABLE or self._draining():
            return False
        if len(self.generated) > 1 and any(self.generated):
            return False  # n > 1 mid-stream: the samples' histories differ (see resume_from).
        failed = self.record.tried + [self.record.replica]
        return any(r not in failed for r in self.replicas.routable())


def resume_from(prompt_ids: list[int], sampling: SamplingParams, generated: list[list[int]]
                ) -> tuple[list[int], SamplingParams]:
    """What a migrated request sends its new replica: the prompt plus the tokens already
    streamed (one sample; or n samples none of which started), and that many fewer
    tokens to go. Greedy decoding continues exactly where it stopped."""
    so_far = generated[0] if len(generated) == 1 else []
    return prompt_ids + so_far, dataclasses.replace(sampling, max_tokens=sampling.max_tokens - len(so_far))
