"""The router: the public `llmserve.v1.Generation` API.

    client ──Generate──▶ validate ─▶ tokenize ─▶ SchedulerLink.add ─┐
    client ◀─deltas──── stop strings ◀─ detokenize ◀─ outputs queue ◀┘

It owns everything textual (tokenizer, chat template, detokenization, stop strings);
the scheduler and workers see token ids only. A cancelled or disconnected client
aborts its request in the scheduler, so its KV blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import grpc
from grpc_reflection.v1alpha import reflection

from llmserve.contract import wire
from llmserve.contract.api_keys import ApiKeyInterceptor, ApiKeys
from llmserve.contract.grpc_server import ServiceServer, grpc_status
from llmserve.contract.outputs import FinishReason
from llmserve.contract.retry_info import retry_status
from llmserve.model_store import resolve_model_dir
from llmserve.router.config import RouterConfig
from llmserve.router.detokenizer import new_detokenizer
from llmserve.router.health import RouterHealth
from llmserve.router.limits import check_prompt_size, check_request_id, check_stop_sizes, prompt_byte_limit
from llmserve.router.request_decoding import DecodeErrorInterceptor
from llmserve.router.sample_stream import SampleStream
from llmserve.router.scheduler_link import SchedulerLink, SchedulerUnavailable
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
from llmserve.contract.sampling import SamplingParams
from llmserve.telemetry import RouterMetrics, setup_metrics, setup_tracing, shutdown_metrics, shutdown_tracing
from llmserve.telemetry.requests import RouterRequest
from llmserve.v1 import generation_pb2, generation_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = "llmserve.v1.Generation"
HEALTH_POLL_S = 1.0  # How often the router re-reads the scheduler's health.
NO_DEADLINE_S = 10 * 365 * 86400.0  # A deadline further off than this is no deadline.


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, tokenizer: PromptTokenizer, link: SchedulerLink, metrics: RouterMetrics,
                 longest_token_bytes: int):
        self.tokenizer = tokenizer
        self.longest_token_bytes = longest_token_bytes  # Sizes the default --max-prompt-bytes.
        self.link = link
        self.metrics = metrics
        self.draining = False  # After SIGTERM: new calls get UNAVAILABLE, running ones finish.
        # Known once the scheduler has a worker; until then every call is UNAVAILABLE.
        self.served: ServedModel | None = None
        self.model_info: generation_pb2.ModelInfo | None = None
        self.serving = False  # Follows the scheduler's health (set by _stay_connected).
        self._active: set[str] = set()

    def set_ready(self, served: ServedModel, model_info: generation_pb2.ModelInfo) -> None:
        self.served, self.model_info = served, model_info

    async def _require_ready(self, context) -> None:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the router is shutting down")
        if self.served is None or not self.serving or not self.link.connected.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is ready: the scheduler or worker is down")

    # --- Generate ------------------------------------------------------------

    async def Generate(self, request, context):
        await self._require_ready(context)
        telemetry = RouterRequest(self.metrics, context.invocation_metadata(), request.model or self.served.name)
        try:
            with telemetry.tokenize_span():
                request_id, prompt_ids, sampling, n = await self._prepare(request)
        except RequestError as err:
            telemetry.finish("rejected", err.message)
            await context.abort(err.code, err.message)
        finish = "abort"  # Unless the samples end by themselves.
        added = False
        engine_live: set[int] = set()  # Samples the engine still runs.
        try:  # NOTE: request_id is ours (claimed by _prepare) from here on; the finally releases it.
            telemetry.admitted(request_id, len(prompt_ids))
            # One engine request of n samples sharing the prompt's KV; sample i draws with seed + i.
            streams = [SampleStream(index=i, detokenizer=new_detokenizer(self.tokenizer),
                                    stop_matcher=StopStringMatcher(sampling.stop)) for i in range(n)]
            unfinished = set(range(n))  # Samples the client has not seen end.
            engine_live = set(range(n))
            # NOTE: a client cancelling while the add is written may leave it sent: count it
            # as added from here, so the finally aborts it (an abort of an unknown id is a no-op).
            added = True
            try:
                queue = await self.link.add(request_id, prompt_ids, sampling, n=n, priority=request.priority,
                                            trace_context=telemetry.trace_context(),
                                            deadline_ms=_deadline_budget_ms(context))
            except SchedulerUnavailable as err:
                added = False  # Refused before anything was written.
                telemetry.finish("error", str(err))
                telemetry = None
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
            while unfinished:
                out = await queue.get()
                if out.finished:
                    engine_live.discard(out.index)
                if out.retry_after_ms and out.finish_reason == FinishReason.ERROR:
                    # Refused (or displaced) before it ever ran: no delta, just the status
                    # with its RetryInfo, as a client of a load-shedding server expects.
                    engine_live.clear()
                    telemetry.finish("refused", out.error)
                    telemetry = None
                    await context.abort_with_status(retry_status(grpc_status(out.error_code), out.error,
                                                                 out.retry_after_ms))
                stream = streams[out.index] if 0 <= out.index < n else None
                if stream is None or stream.finished:
                    continue  # A sample cut by a stop string runs on until the request ends.
                with telemetry.detokenizing():
                    delta = stream.process(out, self._token_text)
                telemetry.tokens_out(len(delta.token_ids))
                if delta.finish_reason != FinishReason.NONE:
                    unfinished.discard(out.index)
                    finish = delta.finish_reason.name.lower()
                response = self._response(request_id, delta)
                if not unfinished:
                    response.usage.CopyFrom(self._usage(len(prompt_ids), streams))
                yield response
                if delta.finish_reason == FinishReason.ERROR:
                    telemetry.finish("error", delta.error)
                    telemetry = None
                    await context.abort(grpc_status(out.error_code), delta.error or "generation failed")
        finally:
            if telemetry is not None:
                telemetry.finish(finish)
            # Client cancelled or disconnected (CancelledError lands here), or done.
            if added:
                self.link.release(request_id)
                if engine_live:
                    await self.link.abort([request_id])
            self._active.discard(request_id)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

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
            self._active.discard(request_id)
            raise
        return request_id, prompt_ids, sampling, n

    def _claim(self, client_id: str) -> str:
        """The request's id, now in use. NOTE: check and add with no await between, or two
        calls with one id could both pass the check (and then collide in the engine)."""
        check_request_id(client_id)
        request_id = client_id or uuid.uuid4().hex
        if request_id in self._active:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request id {request_id!r} is already running")
        self._active.add(request_id)
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
        return (await self._render_chat(request.messages))[1]

    async def _render_chat(self, messages_pb) -> tuple[str, list[int]]:
        messages = [(m.role, m.content) for m in messages_pb.messages]
        if not messages:
            raise invalid("messages is empty")
        try:
            return await asyncio.to_thread(self.tokenizer.encode_chat, messages)
        except ValueError as err:
            raise invalid(str(err)) from err
        except Exception as err:  # Jinja errors from the template (e.g. an unknown role).
            raise invalid(f"the chat template rejected the messages: {err}") from err

    @staticmethod
    def _response(request_id: str, delta) -> generation_pb2.GenerateResponse:
        return generation_pb2.GenerateResponse(
            request_id=request_id,
            index=delta.index,
            text=delta.text,
            token_ids=delta.token_ids,
            logprobs=[wire.logprobs_to_pb(lp) for lp in delta.logprobs],
            finish_reason=int(delta.finish_reason),
            stop_reason=delta.stop_reason,
            error=delta.error,
        )

    @staticmethod
    def _usage(prompt_tokens: int, streams) -> generation_pb2.Usage:
        streams = list(streams)
        return generation_pb2.Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=sum(s.num_tokens for s in streams),
            cached_tokens=max((s.num_cached_tokens for s in streams), default=0),
        )

    # --- Tokenize / GetModelInfo ---------------------------------------------

    async def Tokenize(self, request, context):
        await self._require_ready(context)
        try:
            check_model_name(request.model, self.served)
            check_prompt_size(request, self.served)
            kind = request.WhichOneof("input")
            if kind == "text":
                add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
                ids = await asyncio.to_thread(self.tokenizer.encode_text, request.text, add_special)
                prompt = request.text
            elif kind == "messages":
                prompt, ids = await self._render_chat(request.messages)
            else:
                raise invalid("the request has no input: set text or messages")
        except RequestError as err:
            await context.abort(err.code, err.message)
        return generation_pb2.TokenizeResponse(token_ids=ids, count=len(ids), prompt=prompt)

    async def GetModelInfo(self, request, context):
        await self._require_ready(context)
        try:
            check_model_name(request.model, self.served)
        except RequestError as err:
            await context.abort(err.code, err.message)
        return self.model_info


def _deadline_budget_ms(context) -> int:
    """What is left of the client's deadline, in ms (at least 1), or 0 without one. A
    call without a deadline reports an effectively infinite time remaining."""
    remaining = context.time_remaining()
    if remaining is None or remaining > NO_DEADLINE_S:
        return 0
    return max(1, int(remaining * 1000))


def _model_info(served: ServedModel, worker, num_kv_blocks: int, tokenizer) -> generation_pb2.ModelInfo:
    return generation_pb2.ModelInfo(
        model=served.name,
        max_model_len=served.max_model_len,
        vocab_size=served.vocab_size,
        eos_token_ids=sorted(set(worker.eos_token_ids) | set(tokenizer.eos_token_ids)),
        dtype=worker.dtype,
        block_size=worker.block_size,
        num_kv_blocks=num_kv_blocks,
        tensor_parallel_size=worker.tensor_parallel_size,
        bos_token_id=worker.bos_token_id,
        device=worker.device,
        cuda_graphs=worker.cuda_graphs,
    )


async def serve(config: RouterConfig, stop_event: asyncio.Event) -> None:
    setup_tracing("llmserve-router")
    model_dir = resolve_model_dir(config.model)
    # Every metric carries the served name (the one ServedModel gets from the tokenizer: the directory's).
    metrics = RouterMetrics(setup_metrics("router", config.server.metrics_port, config.server.host),
                            model_name=config.served_model_name or model_dir.name)
    tokenizer = await asyncio.to_thread(PromptTokenizer.from_model_dir, model_dir)
    # Only the default --max-prompt-bytes needs it (the whole vocabulary is decoded once).
    longest_token_bytes = 0
    if config.max_prompt_bytes is None:
        longest_token_bytes = await asyncio.to_thread(tokenizer.longest_token_bytes)
    # The public port: TLS without client certificates (callers prove themselves with a
    # key, checked first), client requests up to --max-request-bytes; a body that does not
    # decode gets INVALID_ARGUMENT (DecodeErrorInterceptor).
    interceptors = [] if config.security.insecure else [ApiKeyInterceptor(ApiKeys.from_options(config.api))]
    server = ServiceServer(SERVICE_NAME, config.server.host, config.server.port, config.security,
                           client_auth=False, max_message_bytes=config.server.max_message_bytes,
                           max_receive_bytes=config.max_request_bytes,
                           interceptors=interceptors + [DecodeErrorInterceptor()])
    link = SchedulerLink(config.scheduler_address, config.security, config.server.max_message_bytes)
    # Health and reflection answer from the start (NOT_SERVING until the scheduler has a worker).
    servicer = GenerationServicer(tokenizer, link, metrics, longest_token_bytes)
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server.server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, reflection.SERVICE_NAME, "grpc.health.v1.Health"), server.server
    )
    await server.start()
    health = RouterHealth(server)
    supervisor = asyncio.create_task(_stay_connected(config, link, servicer, health, tokenizer))
    saturation = asyncio.create_task(_follow_saturation(link, health))
    stopped = asyncio.create_task(stop_event.wait())
    try:
        await asyncio.wait({supervisor, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if supervisor.done():
            supervisor.result()  # Re-raises why the router cannot serve.
    finally:
        stopped.cancel()
        saturation.cancel()
        await server.set_serving(False)
        if stop_event.is_set():
            await _drain(servicer, link, config.server.shutdown_timeout)
        supervisor.cancel()
        await server.stop(grace=2.0)
        await link.close()
        shutdown_metrics()
        shutdown_tracing()


async def _drain(servicer: GenerationServicer, link: SchedulerLink, timeout_s: float) -> None:
    """SIGTERM: refuse new calls, let running streams finish for up to `timeout_s`, then
    end the rest with UNAVAILABLE."""
    servicer.draining = True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    if servicer._active:
        logger.info("draining %d in-flight requests (up to %.0f s)", len(servicer._active), timeout_s)
    while servicer._active and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if servicer._active:
        left = sorted(servicer._active)
        logger.warning("shutdown timeout: aborting %d requests", len(left))
        link.fail_requests(left, f"unavailable: the router is shutting down (requests still running after"
                                 f" the {timeout_s:.0f} s shutdown timeout were aborted)")
        await link.abort(left)
        end = loop.time() + 2.0
        while servicer._active and loop.time() < end:
            await asyncio.sleep(0.05)
    logger.info("drained")


async def _stay_connected(config: RouterConfig, link: SchedulerLink, servicer: GenerationServicer,
                          health: RouterHealth, tokenizer: PromptTokenizer) -> None:
    """Connects to the scheduler, and again whenever the session is lost. The router's
    health follows the scheduler's: SERVING only while a worker can run steps."""
    while True:
        await _refresh_serving_info(config, link, servicer, tokenizer)
        await link.connect()
        servicer.serving = True
        await health.update(serving=True)
        logger.info("router serving %s on port %d", servicer.served.name, health.server.port)
        serving = True
        while not link.disconnected.is_set():
            try:
                await asyncio.wait_for(link.disconnected.wait(), HEALTH_POLL_S)
                break
            except TimeoutError:
                pass
            now_serving = await link.scheduler_serving()
            if now_serving and not serving:
                # A worker (re)registered: its KV cache may differ from the last one's.
                await _refresh_serving_info(config, link, servicer, tokenizer)
            if now_serving != serving:
                servicer.serving = serving = now_serving
                await health.update(serving=now_serving)
        servicer.serving = False
        await health.update(serving=False)
        logger.warning("lost the scheduler session; reconnecting")


async def _follow_saturation(link: SchedulerLink, health: RouterHealth) -> None:
    """The Generation service's health follows the scheduler's saturation, which its
    session pushes as it changes (see health.py)."""
    while True:
        await link.saturation_changed.wait()
        link.saturation_changed.clear()
        await health.update(saturated=link.saturated)


async def _refresh_serving_info(config: RouterConfig, link: SchedulerLink, servicer: GenerationServicer,
                                tokenizer: PromptTokenizer) -> None:
    worker, num_kv_blocks = await link.wait_serving_info(config.connect_timeout_s)
    # The KV cache must hold at least one whole sequence, or a request could never run.
    max_model_len = min(worker.max_model_len, num_kv_blocks * worker.block_size)
    if max_model_len < worker.max_model_len:
        logger.warning(
            "max_model_len lowered from %d to %d: the KV cache holds only %d tokens",
            worker.max_model_len, max_model_len, num_kv_blocks * worker.block_size,
        )
    max_prompt_bytes = prompt_byte_limit(config.max_prompt_bytes, max_model_len, servicer.longest_token_bytes)
    served = ServedModel(name=config.served_model_name or tokenizer.name, max_model_len=max_model_len,
                         vocab_size=worker.vocab_size, max_prompt_bytes=max_prompt_bytes)
    logger.info("requests: max_model_len %d tokens, prompts up to %d bytes, messages up to %d bytes",
                max_model_len, max_prompt_bytes, config.max_request_bytes)
    servicer.set_ready(served, _model_info(served, worker, num_kv_blocks, tokenizer))
