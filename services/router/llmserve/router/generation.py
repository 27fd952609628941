"""One request path for every front door: the gRPC servicer and the OpenAI HTTP API
both translate their wire format into a `GenerateRequest` (the public API's request
schema) and render what `Generation.generate` yields back into theirs.

    GenerateRequest ─▶ validate ─▶ tokenize ─▶ pick a replica ─▶ SchedulerLink.add ─┐
    (delta, usage) ◀── stop strings ◀─ detokenize ◀─────────────── outputs queue ◀───┘

A replica that fails mid-stream (its scheduler or worker lost) hands its requests to
another: resubmitted with the prompt and the tokens streamed so far, so the client's
stream continues with no token lost or repeated.

Refusals and failures are raised as `GenerationError` (a gRPC status code, which the
HTTP side maps to an HTTP status). Closing the generator early (a client gone)
aborts the request in the scheduler, so its KV blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from llmserve.contract.grpc_server import grpc_status
from llmserve.contract.outputs import ErrorCode, FinishReason
from llmserve.contract.sampling import SamplingParams
from llmserve.router.detokenizer import new_detokenizer
from llmserve.router.limits import check_prompt_size, check_request_id, check_stop_sizes
from llmserve.router.sample_stream import SampleDelta, SampleStream
from llmserve.router.replicas import Replica, ReplicaSet
from llmserve.router.scheduler_link import SchedulerUnavailable
from llmserve.router.stop_strings import StopStringMatcher
from llmserve.router.tokenizer import PromptTokenizer
from llmserve.router.validation import (
    RequestError,
    ServedModel,
    check_model_name,
    check_sampling_fields,
    check_token_ids,
    invalid,
    resolve_sampling,
)
from llmserve.telemetry import RouterMetrics
from llmserve.telemetry.requests import RouterRequest


class GenerationError(Exception):
    """Why a request ended without finishing: a gRPC status, its message, and for a
    refusal by admission control the scheduler's retry hint."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_ms: int = 0):
        super().__init__(message)
        self.code, self.message, self.retry_after_ms = code, message, retry_after_ms


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # Prompt tokens whose KV came from the prefix cache.


@dataclass(frozen=True)
class Output:
    """One sample's delta; the request's last one carries its usage."""

    request_id: str
    delta: SampleDelta
    usage: Usage | None = None


class Generation:
    """The router's state shared by its front doors: the tokenizer, the replicas (each a
    scheduler session), the served model's limits, and the ids of the requests running."""

    def __init__(self, tokenizer: PromptTokenizer, replicas: ReplicaSet, metrics: RouterMetrics):
        self.tokenizer = tokenizer
        self.replicas = replicas
        self.metrics = metrics
        self.draining = False  # After SIGTERM: new calls are refused, running ones finish.
        # Known once a scheduler has a worker; until then every call is UNAVAILABLE.
        self.served: ServedModel | None = None
        self.active: set[str] = set()
        self.placement: dict[str, Replica] = {}  # Running request -> the replica running it.
        self._aborts: set[asyncio.Task] = set()  # Aborts that must outlive a cancelled caller.

    @property
    def ready(self) -> bool:
        return not self.draining and self.served is not None and self.replicas.serving

    def require_ready(self) -> None:
        if self.draining:
            raise GenerationError(grpc.StatusCode.UNAVAILABLE, "the router is shutting down")
        if not self.ready:
            raise GenerationError(grpc.StatusCode.UNAVAILABLE, "no worker is ready: the scheduler or worker is down")

    def token_text(self, token_id: int) -> str:
        """One token's own text (logprobs, stop tokens): special tokens included."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def generate(self, request, metadata=(), deadline_ms: int = 0) -> AsyncIterator[Output]:
        """Yields each sample's deltas in order; the request's last Output carries its
        usage. `request`: a generation_pb2.GenerateRequest; `metadata`: the call's
        headers (trace context); `deadline_ms`: the client's remaining deadline or 0."""
        self.require_ready()
        telemetry = RouterRequest(self.metrics, metadata, request.model or self.served.name)
        try:
            with telemetry.tokenize_span():
                request_id, prompt_ids, sampling, n = await self._prepare(request)
        except RequestError as err:
            telemetry.finish("rejected", err.message)
            raise GenerationError(err.code, err.message) from None
        finish = "abort"  # Unless the samples end by themselves.
        engine_live: set[int] = set()  # Samples the engine still runs.
        try:  # NOTE: request_id is ours (claimed by _prepare) from here on; the finally releases it.
            telemetry.admitted(request_id, len(prompt_ids))
            # One engine request of n samples sharing the prompt's KV; sample i draws with seed + i.
            streams = [SampleStream(index=i, detokenizer=new_detokenizer(self.tokenizer),
                                    stop_matcher=StopStringMatcher(sampling.stop)) for i in range(n)]
            generated: list[list[int]] = [[] for _ in range(n)]  # Each sample's tokens so far.
            unfinished = set(range(n))  # Samples the client has not seen end.
            tried: list[Replica] = []  # Replicas that failed it (a migration goes elsewhere).
            submit = (prompt_ids, sampling)
            while True:
                # NOTE: a client cancelling while the add is written may leave it sent: the
                # placement is recorded before the write, so the finally aborts it there (an
                # abort of an unknown id is a no-op).
                engine_live = set(unfinished)
                try:
                    replica, queue = await self._place(request_id, *submit, n, request.priority, telemetry,
                                                       deadline_ms, exclude=tried)
                except GenerationError as err:
                    telemetry.finish("error", err.message)
                    telemetry = None
                    raise
                lost = None
                while unfinished:
                    out = await queue.get()
                    if out.finished:
                        engine_live.discard(out.index)
                    if out.retry_after_ms and out.finish_reason == FinishReason.ERROR:
                        # Refused (or displaced) before it ever ran: no delta, just the status
                        # with its retry hint, as a client of a load-shedding server expects.
                        engine_live.clear()
                        telemetry.finish("refused", out.error)
                        telemetry = None
                        raise GenerationError(grpc_status(out.error_code), out.error, out.retry_after_ms)
                    if self._migratable(out, generated, tried + [replica]):
                        lost = out
                        break
                    stream = streams[out.index] if 0 <= out.index < n else None
                    if stream is None or stream.finished:
                        continue  # A sample cut by a stop string runs on until the request ends.
                    generated[out.index].extend(out.new_token_ids)
                    with telemetry.detokenizing():
                        delta = stream.process(out, self.token_text)
                    telemetry.tokens_out(len(delta.token_ids))
                    if delta.finish_reason != FinishReason.NONE:
                        unfinished.discard(out.index)
                        finish = delta.finish_reason.name.lower()
                    yield Output(request_id, delta, None if unfinished else _usage(len(prompt_ids), streams))
                    if delta.finish_reason == FinishReason.ERROR:
                        telemetry.finish("error", delta.error)
                        telemetry = None
                        raise GenerationError(grpc_status(out.error_code), delta.error or "generation failed")
                if lost is None:
                    break
                # Its replica failed mid-stream: resume elsewhere from the prompt and the
                # tokens so far (recomputed there), so the stream goes on where it stopped.
                self._unplace(request_id, replica)
                engine_live = set()
                tried.append(replica)
                submit = resume_from(prompt_ids, sampling, generated)
        finally:
            if telemetry is not None:
                telemetry.finish(finish)
            # Client cancelled or disconnected (CancelledError or GeneratorExit lands here), or done.
            if (placed := self.placement.get(request_id)) is not None:
                self._unplace(request_id, placed)
                if engine_live:
                    await self._abort(placed, request_id)
            self.active.discard(request_id)

    async def _place(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, n: int, priority: int,
                     telemetry: RouterRequest, deadline_ms: int, exclude: list[Replica]):
        """Sends the request to the replica the routing policy picks, not one of `exclude`
        (those that failed it: a migration); (replica, its outputs queue)."""
        migrated, refused = bool(exclude), []
        while True:
            choice = self.replicas.choose(prompt_ids, exclude + refused)
            if choice is None:
                reason = ("no replica is left to resume it on: " if migrated else "") + \
                    "no worker is ready: the scheduler or worker is down"
                raise GenerationError(grpc.StatusCode.UNAVAILABLE, reason)
            replica, expected_cached = choice
            self.placement[request_id] = replica
            replica.in_flight += 1
            try:
                queue = await replica.link.add(request_id, prompt_ids, sampling, n=n, priority=priority,
                                               trace_context=telemetry.trace_context(), deadline_ms=deadline_ms)
            except SchedulerUnavailable:
                self._unplace(request_id, replica)  # Its session just ended, before the write: try another.
                refused.append(replica)
                continue
            telemetry.routed(replica.name, self.replicas.policy.name, expected_cached, migrated=migrated)
            return replica, queue

    def _unplace(self, request_id: str, replica: Replica) -> None:
        replica.link.release(request_id)
        replica.in_flight -= 1
        if self.placement.get(request_id) is replica:
            del self.placement[request_id]

    def _migratable(self, out, generated: list[list[int]], failed: list[Replica]) -> bool:
        """Whether this output is its replica failing the request (not the request failing),
        and the request can resume on another replica: one sample (or none started yet),
        not shutting down, and some other replica serves."""
        if out.finish_reason != FinishReason.ERROR or out.error_code != ErrorCode.UNAVAILABLE or self.draining:
            return False
        if len(generated) > 1 and any(generated):
            return False  # n > 1 mid-stream: the samples' histories differ (see resume_from).
        return any(r not in failed for r in self.replicas.routable())

    async def _abort(self, replica: Replica, request_id: str) -> None:
        """Aborts in the scheduler even when the caller is being cancelled (an HTTP
        server may cancel a handler more than once): the abort runs as its own task."""
        task = asyncio.ensure_future(replica.link.abort([request_id]))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)
        await asyncio.shield(task)

    async def _prepare(self, request) -> tuple[str, list[int], SamplingParams, int]:
        """Checks and tokenizes a request and claims its id; on success the caller owns the
        claim (and must release it), on failure it is released here."""
        request_id = self._claim(request.request_id)
        try:
            check_model_name(request.model, self.served)
            n, _ = check_sampling_fields(request.params)
            check_stop_sizes(request.params)
            check_prompt_size(request, self.served)  # Before tokenizing: bounded work from here on.
            prompt_ids = await self._prompt_ids(request)
            sampling = resolve_sampling(request.params, len(prompt_ids), self.served)
        except BaseException:  # A refusal, an error, or the client gone while tokenizing.
            self.active.discard(request_id)
            raise
        return request_id, prompt_ids, sampling, n

    def _claim(self, client_id: str) -> str:
        """The request's id, now in use. NOTE: check and add with no await between, or two
        calls with one id could both pass the check (and then collide in the engine)."""
        check_request_id(client_id)
        request_id = client_id or uuid.uuid4().hex
        if request_id in self.active:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request id {request_id!r} is already running")
        self.active.add(request_id)
        return request_id

    async def _prompt_ids(self, request) -> list[int]:
        kind = request.WhichOneof("input")
        if kind is None:
            raise invalid("the request has no input: set one of text, token_ids or messages")
        if kind == "text":
            if not request.text:
                raise invalid("the prompt text is empty")
            return await asyncio.to_thread(self.tokenizer.encode_text, request.text)
        if kind == "token_ids":
            ids = list(request.token_ids.ids)
            if not ids:
                raise invalid("token_ids is empty")
            check_token_ids(ids, self.served)
            return ids
        return (await self.render_chat(request.messages))[1]

    async def render_chat(self, messages_pb) -> tuple[str, list[int]]:
        """(rendered prompt, its ids) of a ChatMessages, with the model's chat template."""
        messages = [(m.role, m.content) for m in messages_pb.messages]
        if not messages:
            raise invalid("messages is empty")
        try:
            return await asyncio.to_thread(self.tokenizer.encode_chat, messages)
        except ValueError as err:
            raise invalid(str(err)) from err
        except Exception as err:  # Jinja errors from the template (e.g. an unknown role).
            raise invalid(f"the chat template rejected the messages: {err}") from err


def resume_from(prompt_ids: list[int], sampling: SamplingParams, generated: list[list[int]]
                ) -> tuple[list[int], SamplingParams]:
    """What a migrated request sends its new replica: the prompt plus the tokens already
    streamed (one sample; or n samples none of which started), and that many fewer
    tokens to go. Greedy decoding continues exactly where it stopped."""
    so_far = generated[0] if len(generated) == 1 else []
    return prompt_ids + so_far, dataclasses.replace(sampling, max_tokens=sampling.max_tokens - len(so_far))


def _usage(prompt_tokens: int, streams: list[SampleStream]) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=sum(s.num_tokens for s in streams),
        # A migrated request's new replica counts its resumed tokens as prompt: cap at the prompt.
        cached_tokens=min(prompt_tokens, max((s.num_cached_tokens for s in streams), default=0)),
    )
