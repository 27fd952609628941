"""What every llmserve service shares: an asyncio gRPC server with the standard
health service, and channel options sized for step plans and long prompts."""

from __future__ import annotations

import asyncio
import importlib
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.settings import Command, format_bytes, parse_bytes, setting

logger = logging.getLogger(__name__)

# A step plan for hundreds of sequences, or a max_model_len prompt, exceeds gRPC's
# default 4 MiB receive limit: the default of the internal hops (--max-message-bytes).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Long-lived streams between services: notice a dead peer within seconds.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),
]



def with_message_limits(options: list[tuple[str, Any]], max_message_bytes: int,
                        max_receive_bytes: int | None = None) -> list[tuple[str, Any]]:
    """`options` with gRPC's message size limits set: `max_message_bytes` each way, or
    `max_receive_bytes` for what the peer sends (the router's public port takes smaller
    requests than it sends). gRPC itself refuses a larger message with RESOURCE_EXHAUSTED."""
    sizes = {"grpc.max_send_message_length": max_message_bytes,
             "grpc.max_receive_message_length": max_receive_bytes or max_message_bytes}
    return [(key, sizes.get(key, value)) for key, value in options]


_STATUS_BY_CODE = {status.value[0]: status for status in grpc.StatusCode}


def grpc_status(code: int) -> grpc.StatusCode:
    """The gRPC status for a google.rpc.Code number (an engine ErrorCode); INTERNAL for 0
    or an unknown number: an error without a known cause is ours."""
    status = _STATUS_BY_CODE.get(int(code), grpc.StatusCode.INTERNAL)
    return grpc.StatusCode.INTERNAL if status is grpc.StatusCode.OK else status


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ServiceServer:
    """An aio server bound to `host:port`, with grpc.health.v1 for `service_name`.

    Health starts NOT_SERVING; the service flips it once it can do its job.
    """

    def __init__(self, service_name: str, host: str, port: int, *, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 max_receive_bytes: int | None = None, interceptors: Sequence[grpc.aio.ServerInterceptor] = ()):
        self.service_name = service_name
        options = with_message_limits(SERVER_OPTIONS, max_message_bytes, max_receive_bytes)
        self.server = grpc.aio.server(options=options, interceptors=list(interceptors) or None)
        self.health = health_async.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"{service_name}: cannot bind {host}:{port}")

    async def start(self) -> None:
        await self.set_serving(False)
        await self.server.start()
        logger.info("%s listening on port %d", self.service_name, self.port)

    async def set_serving(self, serving: bool) -> None:
        status = SERVING if serving else NOT_SERVING
        # "" is the whole server's status, the name is the service's own.
        await self.health.set("", status)
        await self.health.set(self.service_name, status)

    async def stop(self, grace: float | None = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


def insecure_channel(target: str, max_message_bytes: int = MAX_MESSAGE_BYTES) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(target, options=with_message_limits(CHANNEL_OPTIONS, max_message_bytes))


def run_until_signal(serve: Callable[[Any, asyncio.Event], Awaitable[None]], config: Any) -> int:
    """Runs `serve(config, stop)` on a new event loop; SIGINT or SIGTERM sets `stop`, and
    the service drains and returns. Returns the process's exit code."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(config, stop)

    asyncio.run(main())
    return 0


@dataclass(frozen=True)
class ServerOptions:
    """Where a service listens, where its metrics go and how long it drains: the same
    settings in every service (each with its own default port)."""

    host: str = setting("0.0.0.0", help="address to listen on")
    port: int = setting(0, help="gRPC port (0 picks a free one)")
    metrics_port: int = setting(0, help="Prometheus endpoint http://HOST:PORT/metrics (0 = off)")
    shutdown_timeout: float = setting(30.0, help="after SIGTERM, seconds in-flight work may go on before it is "
                                                 "cut off")
    max_message_bytes: int = setting(MAX_MESSAGE_BYTES, parse=parse_bytes, show=format_bytes,
                                     help="largest gRPC message between services (step plans and their results, "
                                          "requests to the scheduler); gRPC refuses a larger one with "
                                          "RESOURCE_EXHAUSTED")


def service_command(name: str, help: str, config_cls: type, serve: str) -> Command:
    """`llmserve <name>`: resolves `config_cls` and runs `serve` ("module:function", imported
    only when the command runs) until SIGINT or SIGTERM."""

    def run(config: Any) -> int:
        module, _, function = serve.partition(":")
        return run_until_signal(getattr(importlib.import_module(module), function), config)

    return Command(name, help, config_cls, run)
