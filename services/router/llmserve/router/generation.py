"""One request path for every front door: the gRPC servicer and the OpenAI HTTP API
both translate their wire format into a `GenerateRequest` (the public API's request
schema) and render what `Generation.generate` yields back into theirs.

    GenerateRequest ─▶ validate ─▶ tokenize ─▶ Attempts: pick a replica, add ─┐
    (delta, usage) ◀── stop strings ◀─ detokenize ◀──── the record's queue ◀───┘

Each request has one record (placements.py) from the claim of its id to its end; a
replica that fails it mid-stream hands it to another (attempts.py).

Refusals and failures are raised as `GenerationError` (a gRPC status code, which the
HTTP side maps to an HTTP status). Closing the generator early (a client gone)
aborts the request in the scheduler, so its KV blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import grpc

from llmserve.contract import wire
from llmserve.contract.grpc_server import grpc_status
from llmserve.contract.outputs import FinishReason, RequestOutput
from llmserve.contract.sampling import SamplingParams
from llmserve.router.attempts import Attempts, GenerationError, Job
from llmserve.router.detokenizer import new_detokenizer
from llmserve.router.limits import check_cache_salt, check_prompt_size, check_stop_sizes
from llmserve.router.placements import Placement, Placements
from llmserve.router.reasoning import REASONING_PARSERS, ReasoningSplitter
from llmserve.router.replicas import Replica, ReplicaSet
from llmserve.router.sample_stream import SampleDelta, SampleStream
from llmserve.router.stop_strings import StopStringMatcher
from llmserve.router.tokenizer import PromptTokenizer
from llmserve.router.tools import ToolPlan, plan_tools, template_messages, template_tools
from llmserve.router.usage import Usage
from llmserve.router.validation import (
    RequestError,
    ServedModel,
    check_grammar,
    check_known_fields,
    check_model_name,
    check_sampling,
    check_token_ids,
    invalid,
    resolve_sampling,
)
from llmserve.telemetry import RouterMetrics
from llmserve.telemetry.requests import RouterRequest

__all__ = ["Generation", "GenerationError", "Output"]

# How much of a chat's prompt a reasoning splitter reads: enough for "<think>\n\n</think>\n\n".
PROMPT_TAIL_TOKENS = 16


@dataclass(frozen=True)
class Output:
    """One sample's delta; the request's last one carries its usage."""

    request_id: str
    delta: SampleDelta
    usage: Usage | None = None


class Generation:
    """The router's state shared by its front doors: the tokenizer, the replicas (each a
    scheduler session, and the table of the requests placed on them), and the served
    model's limits."""

    def __init__(self, tokenizer: PromptTokenizer, replicas: ReplicaSet, metrics: RouterMetrics,
                 reasoning_parser: str = "none", tool_call_parser: str = "none"):
        self.tokenizer = tokenizer
        # --reasoning-parser: how a chat's reply splits into reasoning and answer (None: it does not).
        self.reasoning = REASONING_PARSERS.get(reasoning_parser)
        self.tool_call_parser = tool_call_parser  # --tool-call-parser: tool_choice auto's ("none": refused).
        self.replicas = replicas
        self.metrics = metrics
        self.draining = False  # After SIGTERM: new calls are refused, running ones finish.
        # Known once a scheduler has a worker; until then every call is UNAVAILABLE.
        self.served: ServedModel | None = None
        self._aborts: set[asyncio.Task] = set()  # Aborts that must outlive a cancelled caller.

    @property
    def placements(self) -> Placements:
        """The requests running, by id: the router's one table of them."""
        return self.replicas.placements

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

    async def generate(self, request, metadata=(), deadline_ms: int = 0,
                       sampling: tuple[SamplingParams, int] | None = None) -> AsyncIterator[Output]:
        """Yields each sample's deltas in order; the request's last Output carries its
        usage. `request`: a generation_pb2.GenerateRequest; `metadata`: the call's
        headers (trace context); `deadline_ms`: the client's remaining deadline or 0;
        `sampling`: the settings and n when the front door converted them itself (the
        OpenAI API), else the request's `params` are."""
        self.require_ready()
        record, job, tools = await self._admit(request, metadata, deadline_ms, sampling)
        try:  # NOTE: the record (its id) is ours from here on; the finally releases it.
            record.telemetry.admitted(record.request_id, len(job.prompt_ids))
            streams = [SampleStream(index=i, detokenizer=new_detokenizer(self.tokenizer),
                                    stop_matcher=StopStringMatcher(job.sampling.stop),
                                    min_tokens=job.sampling.min_tokens,
                                    reasoning=self._splitter(request, job.prompt_ids),
                                    tool_calls=tools.parser(),
                                    prompt_token_ids=list(job.prompt_ids)
                                    if job.sampling.prompt_logprobs is not None else [])
                       for i in range(job.n)]
            unfinished = set(range(job.n))  # Samples the client has not seen end.
            attempts = Attempts(self.replicas, record, job, lambda: self.draining)
            await attempts.start(unfinished)
            while unfinished:
                out = await attempts.next_output(unfinished)
                # The outputs that queued up meanwhile (the consumer fell behind) go out
                # merged: one delta per sample. An error output always comes alone.
                outs = [out] if out.finish_reason == FinishReason.ERROR else [out, *attempts.queued_outputs()]
                for delta in self._deltas(record.telemetry, streams, outs):
                    if delta.finish_reason != FinishReason.NONE:
                        unfinished.discard(delta.index)
                        record.outcome = (delta.finish_reason.name.lower(), "")
                    usage = None if unfinished else Usage.of(len(job.prompt_ids), streams)
                    yield Output(record.request_id, delta, usage)
                    if delta.finish_reason == FinishReason.ERROR:
                        record.outcome = ("error", delta.error)
                        raise GenerationError(grpc_status(out.error_code), delta.error or "generation failed")
        finally:
            # Done, or the client cancelled or disconnected (CancelledError or GeneratorExit lands here).
            await self._release(record)

    def _splitter(self, request, prompt_ids: list[int]) -> ReasoningSplitter | None:
        """A chat's reasoning splitter (--reasoning-parser), which reads the prompt's end:
        a chat template may have opened the reasoning already."""
        if self.reasoning is None or request.WhichOneof("input") != "messages":
            return None
        return self.reasoning(self.tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False))

    def _deltas(self, telemetry: RouterRequest, streams: list[SampleStream], outs: list[RequestOutput]
                ) -> list[SampleDelta]:
        """The text and tokens these outputs add to their samples' streams: one delta per
        sample, in the order the samples first appear (a sample's outputs merged in order);
        none for a sample that is over (cut by a stop string, it runs on until the request ends)."""
        deltas: dict[int, SampleDelta] = {}
        with telemetry.detokenizing():
            for out in outs:
                stream = streams[out.index] if 0 <= out.index < len(streams) else None
                if stream is None or stream.finished:
                    continue
                delta = stream.process(out, self.token_text)
                if out.index in deltas:
                    deltas[out.index].absorb(delta)
                else:
                    deltas[out.index] = delta
        telemetry.tokens_out(sum(len(d.token_ids) for d in deltas.values()))
        return list(deltas.values())

    async def _release(self, record: Placement) -> None:
        """Ends the request's span and metrics, aborts what its replica may still run (so
        its KV blocks are freed at once), and frees its id."""
        record.telemetry.finish(*record.outcome)
        running = bool(record.engine_live)
        try:
            replica = self.placements.unplace(record)
            if replica is not None and running:
                await self._abort(replica, record.request_id)
        finally:  # Even when a second cancellation interrupts the abort: the id must not leak.
            self.placements.release(record)

    async def _abort(self, replica: Replica, request_id: str) -> None:
        """Aborts in the scheduler even when the caller is being cancelled (an HTTP
        server may cancel a handler more than once): the abort runs as its own task."""
        task = asyncio.ensure_future(replica.link.abort([request_id]))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)
        await asyncio.shield(task)

    async def _admit(self, request, metadata, deadline_ms: int, sampling: tuple[SamplingParams, int] | None
                     ) -> tuple[Placement, Job, ToolPlan]:
        """The request's record (its id claimed), its job, checked and tokenized, and how
        its reply is read for tool calls; a refusal ends its telemetry and raises
        GenerationError."""
        telemetry = RouterRequest(self.metrics, metadata, request.model or self.served.name)
        try:
            with telemetry.tokenize_span():
                return await self._prepare(request, telemetry, deadline_ms, sampling)
        except RequestError as err:
            telemetry.finish("rejected", err.message)
            raise GenerationError(err.code, err.message, param=err.param) from None

    async def _prepare(self, request, telemetry: RouterRequest, deadline_ms: int,
                       given: tuple[SamplingParams, int] | None) -> tuple[Placement, Job, ToolPlan]:
        """Checks and tokenizes a request and claims its id; on success the caller owns the
        record (and must release it), on failure it is released here."""
        record = self.placements.claim(request.request_id, telemetry)
        try:
            check_model_name(request.model, self.served)
            check_known_fields(request)  # A newer client's fields would be dropped: refused.
            # The one conversion of a gRPC client's settings (the OpenAI API's: given).
            sampling, n = given or wire.sampling_from_public_pb(request.params)
            tools = plan_tools(request, self.tool_call_parser)
            sampling = tools.constrain(sampling)  # tool_choice required or named: a JSON schema.
            check_sampling(sampling, n)
            check_stop_sizes(sampling)
            await check_grammar(sampling)  # A schema that cannot be compiled: refused, nothing queued.
            check_prompt_size(request, self.served)  # Before tokenizing: bounded work from here on.
            check_cache_salt(request.cache_salt)
            prompt_ids = await self._prompt_ids(request)
            sampling = resolve_sampling(sampling, len(prompt_ids), self.served)
            if sampling.bad_words:
                sampling = replace(sampling, bad_words_token_ids=await asyncio.to_thread(
                    self.tokenizer.bad_words_token_ids, sampling.bad_words))
        except BaseException:  # A refusal, an error, or the client gone while tokenizing.
            self.placements.release(record)
            raise
        return record, Job(prompt_ids, sampling, n, request.priority, deadline_ms, request.cache_salt), tools

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
        """(rendered prompt, its ids) of a ChatMessages, with the model's chat template
        (its tools too, and the turns' tool calls and results)."""
        if not messages_pb.messages:
            raise invalid("messages is empty")
        messages, tools = template_messages(messages_pb), template_tools(messages_pb)
        kwargs = template_kwargs(messages_pb.chat_template_kwargs)
        try:
            return await asyncio.to_thread(self.tokenizer.encode_chat, messages, kwargs, tools)
        except ValueError as err:
            raise invalid(str(err)) from err
        except Exception as err:  # Jinja errors from the template (e.g. an unknown role).
            raise invalid(f"the chat template rejected the messages: {err}") from err


def template_kwargs(values) -> dict:
    """ChatMessages.chat_template_kwargs (name -> JSON text) as the template's variables."""
    kwargs = {}
    for name, text in values.items():
        try:
            kwargs[name] = json.loads(text)
        except ValueError:
            raise invalid(f"chat_template_kwargs.{name}: not a JSON value: {text[:80]!r}",
                          param=f"chat_template_kwargs.{name}") from None
    return kwargs
