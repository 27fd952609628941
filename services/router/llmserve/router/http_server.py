"""uvicorn serving the OpenAI API in the router's own asyncio loop, beside grpc.aio.

TLS with the router's server certificate unless --insecure (read once at start-up: a
rotated certificate reaches the HTTP port at the next restart, unlike the gRPC port).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import uvicorn

from llmserve.contract.security import SecurityOptions

logger = logging.getLogger(__name__)

# After the router's own drain, how long open connections may take to close.
CLOSE_GRACE_S = 2.0


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers."""

    def capture_signals(self):
        # NOTE: uvicorn would take SIGTERM/SIGINT over; the router's own handler drains
        # both front doors in order, then stops this server.
        return contextlib.nullcontext()


class HttpServer:
    """The OpenAI API's port: uvicorn as a task of the router's loop."""

    def __init__(self, app, host: str, port: int, security: SecurityOptions):
        tls = {} if security.insecure else {"ssl_certfile": str(security.tls_cert), "ssl_keyfile": str(security.tls_key)}
        config = uvicorn.Config(app, host=host, port=port, lifespan="off", access_log=False, log_level="warning",
                                timeout_graceful_shutdown=CLOSE_GRACE_S, **tls)
        self.server = _EmbeddedServer(config)
        self.scheme = "http" if security.insecure else "https"
        self.host, self.port = host, port
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Returns once the port is bound (raises if it cannot be)."""
        self._task = asyncio.create_task(self.server.serve(), name="http-server")
        while not self.server.started:
            if self._task.done():
                self._task.result()  # Re-raises why it stopped.
                raise RuntimeError(f"the HTTP server on port {self.port} stopped during start-up")
            await asyncio.sleep(0.02)
        logger.info("OpenAI-compatible API on %s://%s:%d/v1", self.scheme, self.host, self.port)

    async def stop(self) -> None:
        if self._task is None:
            return
        self.server.should_exit = True
        with contextlib.suppress(Exception, SystemExit):
            await self._task
