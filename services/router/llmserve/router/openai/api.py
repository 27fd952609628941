"""The OpenAI-compatible HTTP API: the same `Generation` as the gRPC servicer, in
OpenAI's wire format.

    POST /v1/chat/completions   chat: messages → chat.completion (or SSE chunks)
    POST /v1/completions        prompt(s): text or token ids → text_completion
    GET  /v1/models             the served model
    GET  /health                200 while serving, 503 otherwise (no key needed)
    GET  /metrics               the router's Prometheus text (no key needed)

A request is translated to a `GenerateRequest` (protocol.py), run by
`Generation` (validation, tokenizer and chat template, detokenizer, stop strings,
metrics: all shared with gRPC), and its outputs rendered (render.py). Errors are
OpenAI's `{"error": {...}}` bodies with the HTTP status of the gRPC status
(errors.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable

import grpc
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from llmserve.contract.api_keys import ApiKeys, Unauthenticated
from llmserve.contract.sampling import SamplingParams
from llmserve.router.generation import Generation, GenerationError
from llmserve.router.merge import merged
from llmserve.router.openai.errors import error_body, error_response
from llmserve.router.openai.protocol import ChatCompletionRequest, CompletionRequest
from llmserve.router.openai.render import Renderer
from llmserve.router.openai.sse import SSEResponse
from llmserve.router.validation import RequestError


# How often a non-streamed request checks that its client is still there.
DISCONNECT_POLL_S = 0.25


class ApiError(Exception):
    """A refusal by the HTTP layer itself (the key, a body protobuf cannot hold)."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None, http_status: int | None = None):
        super().__init__(message)
        self.code, self.message, self.param, self.http_status = code, message, param, http_status


class BodyLimit:
    """Refuses a body larger than --max-request-bytes by its Content-Length, before it is
    read (FastAPI reads a body whole before any check of ours runs); a body without a
    length is refused too, as it would be unbounded."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            length = dict(scope["headers"]).get(b"content-length", b"")
            refusal = None
            if not length.isdigit():
                refusal = error_response(grpc.StatusCode.INVALID_ARGUMENT, "a request body needs a Content-Length",
                                         http_status=411)
            elif int(length) > self.limit:
                refusal = error_response(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                         f"the request body is {int(length)} bytes; the limit is {self.limit} "
                                         f"(--max-request-bytes)", http_status=413)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _validation_message(err: RequestValidationError) -> tuple[str, str | None]:
    """The first problem pydantic found, and the field it is about."""
    first = err.errors()[0] if err.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    return f"{param or 'body'}: {first.get('msg', 'invalid request body')}", param


def create_app(generation: Generation, keys: ApiKeys | None, metrics_text: Callable[[], tuple[bytes, str]],
               max_request_bytes: int) -> FastAPI:
    """`keys`: None serves without an API key (--insecure); `metrics_text()`: (body,
    content type) of the router's Prometheus registry."""
    app = FastAPI(title="llmserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, limit=max_request_bytes)
    for error, handler in _ERROR_HANDLERS.items():
        app.add_exception_handler(error, handler)
    guarded = [Depends(_authenticator(keys))]
    _add_status_routes(app, generation, metrics_text, guarded)
    _add_generation_routes(app, generation, guarded)
    return app


async def _invalid_body(request: Request, err: RequestValidationError) -> JSONResponse:
    message, param = _validation_message(err)
    return error_response(grpc.StatusCode.INVALID_ARGUMENT, message, param)


async def _api_error(request: Request, err: ApiError) -> JSONResponse:
    return error_response(err.code, err.message, err.param, http_status=err.http_status)


async def _generation_error(request: Request, err: GenerationError) -> JSONResponse:
    return error_response(err.code, err.message, err.param, retry_after_ms=err.retry_after_ms)


async def _request_error(request: Request, err: RequestError) -> JSONResponse:
    return error_response(err.code, err.message, err.param)


# Every refusal, whoever raised it, as an OpenAI error body with its HTTP status.
_ERROR_HANDLERS = {RequestValidationError: _invalid_body, ApiError: _api_error,
                   GenerationError: _generation_error, RequestError: _request_error}


def _authenticator(keys: ApiKeys | None) -> Callable[[Request], None]:
    def authenticate(request: Request) -> None:
        """The gRPC API's keys and check (ApiKeys.authenticate: the same messages)."""
        if keys is not None:
            try:
                keys.authenticate(request.headers.get("authorization"))
            except Unauthenticated as err:
                raise ApiError(grpc.StatusCode.UNAUTHENTICATED, str(err)) from None

    return authenticate


def _add_status_routes(app: FastAPI, generation: Generation, metrics_text: Callable[[], tuple[bytes, str]],
                       guarded: list) -> None:
    """/health and /metrics (no key needed), /v1/models."""

    @app.get("/health")
    async def health() -> Response:
        """Liveness and readiness as the gRPC "" health: serving while a worker runs steps."""
        if generation.ready:
            return JSONResponse({"status": "serving"})
        return JSONResponse({"status": "not serving"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = metrics_text()
        return Response(body, media_type=content_type)

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> JSONResponse:
        try:
            generation.require_ready()
        except GenerationError as err:
            return error_response(err.code, err.message)
        served = generation.served
        return JSONResponse({"object": "list", "data": [
            {"id": served.name, "object": "model", "created": 0, "owned_by": "llmserve",
             "max_model_len": served.max_model_len}]})


def _add_generation_routes(app: FastAPI, generation: Generation, guarded: list) -> None:
    """/v1/chat/completions and /v1/completions."""

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        body.check_fields()
        request_id = uuid.uuid4().hex
        pb = _translate(lambda: [body.to_pb(request_id)])
        sampling = _translate(body.sampling)
        renderer = _renderer(True, f"chatcmpl-{request_id}", body)
        return await _respond(generation, [pb[0]], sampling, body, renderer, body.logprobs, request)

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        body.check_fields()
        request_id = uuid.uuid4().hex
        prompts = _translate(body.prompts)
        ids = [request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))]
        requests = _translate(lambda: body.to_pb(ids))
        sampling = _translate(body.sampling)
        renderer = _renderer(False, f"cmpl-{request_id}", body, _echo(prompts) if body.echo else None,
                             body.echo_logprobs)
        return await _respond(generation, requests, sampling, body, renderer, body.logprobs is not None, request)

    def _renderer(chat: bool, response_id: str, body, prompt_text=None, echo_logprobs=None) -> Renderer:
        return Renderer(chat=chat, model=generation.served.name if generation.served else body.model,
                        response_id=response_id, n=body.n or 1, token_text=generation.token_text,
                        prompt_text=prompt_text, prompt_logprobs=body.prompt_logprobs, echo_logprobs=echo_logprobs)

    def _echo(prompts: list[str | list[int]]) -> Callable[[int], str]:
        """Prompt i's text for `echo`: as sent, or its token ids decoded (called once an
        output exists, so the ids passed validation)."""
        return lambda i: prompts[i] if isinstance(prompts[i], str) else generation.tokenizer.decode(prompts[i])


def _translate(build):
    """A body that pydantic accepted but the public API's types cannot hold (an int beyond int32)."""
    try:
        return build()
    except (ValueError, TypeError) as err:
        raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, f"invalid request: {err}") from None


async def _respond(generation: Generation, requests, sampling: tuple[SamplingParams, int], body,
                   renderer: Renderer, with_logprobs: bool, request: Request) -> Response:
    """`sampling`: the body's settings and n, shared by its `requests`."""
    generation.require_ready()
    metadata = list(request.headers.items())  # Trace context (traceparent), as gRPC metadata carries it.
    outputs = merged([generation.generate(r, metadata, sampling=sampling) for r in requests])
    if not body.stream:
        return await _whole(outputs, renderer, with_logprobs, request)
    try:
        # The first output before the first byte: a refusal or a bad request still gets
        # its HTTP status, not a 200 with an error event.
        first = await anext(outputs)
    except BaseException:
        await outputs.aclose()
        raise
    return SSEResponse(_chunks(first, outputs, renderer, with_logprobs, body.include_usage))


async def _whole(outputs: AsyncIterator, renderer: Renderer, with_logprobs: bool, request: Request) -> Response:
    """A non-streamed reply; a client gone before it is ready aborts the request (its
    KV blocks freed), as a disconnected stream does."""
    collecting = asyncio.ensure_future(_collect(outputs, renderer, with_logprobs))
    try:
        while not collecting.done():
            await asyncio.wait({collecting}, timeout=DISCONNECT_POLL_S)
            if not collecting.done() and await request.is_disconnected():
                collecting.cancel()
                await asyncio.gather(collecting, return_exceptions=True)
                return Response(status_code=499)  # Nobody reads it; nginx's "client closed request".
    finally:
        if not collecting.done():  # This handler cancelled (server shutdown).
            collecting.cancel()
    return JSONResponse(collecting.result())


async def _collect(outputs: AsyncIterator, renderer: Renderer, with_logprobs: bool) -> dict:
    deltas: dict[int, list] = {}
    usages = []
    async with contextlib.aclosing(outputs):
        async for prompt_index, out in outputs:
            deltas.setdefault(renderer.choice_index(prompt_index, out.delta), []).append(out.delta)
            if out.usage is not None:
                usages.append(out.usage)
    return renderer.completion(deltas, usages, with_logprobs)


async def _chunks(first, outputs: AsyncIterator, renderer: Renderer, with_logprobs: bool,
                  include_usage: bool) -> AsyncIterator[dict]:
    seen: set[int] = set()  # Choices whose first chunk (with the role) went out.
    usages = []
    async with contextlib.aclosing(outputs):
        item = first
        try:
            while item is not None:
                prompt_index, out = item
                delta = out.delta
                index = renderer.choice_index(prompt_index, delta)
                if (delta.text or delta.reasoning_text or delta.tool_calls or delta.logprobs or delta.finish_reason
                        or index not in seen):
                    for chunk in renderer.chunks(prompt_index, delta, index not in seen, with_logprobs):
                        yield chunk
                    seen.add(index)
                if out.usage is not None:
                    usages.append(out.usage)
                item = await anext(outputs, None)
        except GenerationError as err:
            # Past the first byte the status is sent: the error travels as an event (as vLLM's does).
            yield error_body(err.code, err.message)[1]
            return
    if include_usage:
        yield renderer.usage_chunk(usages)
