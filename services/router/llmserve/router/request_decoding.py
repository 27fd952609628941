"""Request bodies that do not decode get INVALID_ARGUMENT, not UNKNOWN.

grpc.aio parses a request with its method handler's `request_deserializer` before the
servicer runs; an exception there (protobuf's DecodeError for a corrupt body, or for a
`string` field holding invalid UTF-8) escapes as UNKNOWN "Unexpected <class ...>" with an
ERROR traceback in the log. This interceptor gives each unary-request handler a
deserializer that returns an `Undecodable` marker instead of raising, and a behaviour
that answers the marker with INVALID_ARGUMENT before the servicer sees anything:

    bytes ──safe deserializer──▶ message ──────────▶ servicer method
                              └─▶ Undecodable ─────▶ abort(INVALID_ARGUMENT, why)
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable
from typing import Any

import grpc

logger = logging.getLogger(__name__)


class Undecodable:
    """Stands in for a request whose bytes did not parse."""

    __slots__ = ("error",)

    def __init__(self, error: Exception):
        self.error = error


def _safe(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception as err:  # DecodeError, or whatever a deserializer raises on bad bytes.
            return Undecodable(err)

    return deserialize


async def _refuse(request: Undecodable, context, method: str) -> None:
    logger.info("refused an undecodable request to %s: %s", method, request.error)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"the request body is not a valid message ({request.error}); string fields must be UTF-8")


def _coroutine(behavior, method: str):
    """A coroutine behaviour: unary-unary, or unary-stream writing with context.write."""

    async def handle(request, context):
        if isinstance(request, Undecodable):
            await _refuse(request, context, method)
        return await behavior(request, context)

    return handle


def _async_generator(behavior, method: str):
    """A unary-stream behaviour that yields its responses."""

    async def handle(request, context):
        if isinstance(request, Undecodable):
            await _refuse(request, context, method)
        # aclosing: when this stream is closed early (client gone), so is the servicer's,
        # at once, and its clean-up (aborting the request in the engine) runs.
        async with contextlib.aclosing(behavior(request, context)) as responses:
            async for response in responses:
                yield response

    return handle


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    """Applies to every unary-request method of the server it is installed on (the
    router's public API and its health checks). Streaming-request methods (reflection)
    are left as they are."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None or handler.request_streaming:
            return handler
        kind = "unary_stream" if handler.response_streaming else "unary_unary"
        behavior = getattr(handler, kind)
        # grpc.aio tells the two unary-stream styles apart by the behaviour's own kind.
        if inspect.isasyncgenfunction(behavior):
            wrapped = _async_generator(behavior, handler_call_details.method)
        elif inspect.iscoroutinefunction(behavior):
            wrapped = _coroutine(behavior, handler_call_details.method)
        else:
            return handler  # A synchronous behaviour (none here): left as it is.
        return handler._replace(request_deserializer=_safe(handler.request_deserializer), **{kind: wrapped})
