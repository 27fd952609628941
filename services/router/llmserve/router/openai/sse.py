"""A Server-Sent Events response that stops its producer when the client goes away.

uvicorn answers a `send` after a disconnect by dropping it silently, so a stream that
only learns of the disconnect from `send` would generate to its end. This response
also watches `receive` for `http.disconnect` and cancels the producer at once; the
producer (an async generator over `Generation.generate`) is closed either way, which
aborts the request in the scheduler and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"


def event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


class SSEResponse(Response):
    """An ASGI response of `data: {...}` events from `events` (dicts), then `data: [DONE]`."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[dict]):
        super().__init__(status_code=200)
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.ensure_future(self._stream(send))
        disconnected = False

        async def watch() -> None:
            nonlocal disconnected
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected = True
            streaming.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await streaming
        except asyncio.CancelledError:
            if not disconnected:
                raise  # This handler itself is being cancelled (server shutdown).
        finally:
            watcher.cancel()
            streaming.cancel()

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no")]})  # Proxies (nginx) must not buffer the stream.
        async with contextlib.aclosing(self.events) as events:
            async for payload in events:
                await send({"type": "http.response.body", "body": event(payload), "more_body": True})
        await send({"type": "http.response.body", "body": DONE, "more_body": False})
