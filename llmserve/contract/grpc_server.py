"""What every llmserve service shares: an asyncio gRPC server with the standard
health service (TLS unless --insecure; optionally also plaintext on --health-port for
probes that cannot do TLS), the one way to dial another service, and channel options
sized for step plans and long prompts."""

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

from llmserve.contract import event_loop, parent_watch
from llmserve.contract.security import SecurityOptions, internal_credentials, server_credentials
from llmserve.contract.startup_errors import port_error
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
    # A peer that comes back (a restarted scheduler, one started after its router) is
    # reconnected within 5 s, not after gRPC's default backoff of up to 2 minutes.
    ("grpc.max_reconnect_backoff_ms", 5_000),
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

    TLS with the certificate of `security` (re-read when its files change); with
    `client_auth`, clients must present a certificate from its CA (the internal
    services). Plaintext only with --insecure. Health starts NOT_SERVING; the service
    flips it once it can do its job.

    With a `health_port`, a second, plaintext server on it answers grpc.health.v1 only,
    from the same servicer (so the same status), for Kubernetes' `grpc:` probes, which
    cannot do TLS; it starts, stops and drains with the main server (0: none).
    """

    def __init__(self, service_name: str, host: str, port: int, security: SecurityOptions, *,
                 client_auth: bool = True, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 max_receive_bytes: int | None = None, interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                 health_port: int = 0):
        self.service_name = service_name
        options = with_message_limits(SERVER_OPTIONS, max_message_bytes, max_receive_bytes)
        self.server = grpc.aio.server(options=options, interceptors=list(interceptors) or None)
        self.health = health_async.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.health_server = PlaintextHealthServer(self.health, host, health_port) if health_port else None
        self.certificates = None  # The served certificate's files (None: plaintext).
        # NOTE: asked of the OS first: gRPC says only "Failed to bind", after a C-core log line.
        if port and (busy := _bind_error(host, port)) is not None:
            raise port_error("gRPC", host, port, "--port", busy)
        try:
            if security.insecure:
                self.port = self.server.add_insecure_port(f"{host}:{port}")
                self.transport = "plaintext: --insecure"
            else:
                creds, self.certificates = server_credentials(security, client_auth)
                self.port = self.server.add_secure_port(f"{host}:{port}", creds)
                self.transport = "TLS, client certificates required" if client_auth else "TLS"
        except RuntimeError as err:  # gRPC's "Failed to bind": the OS's reason is only in its debug log.
            raise port_error("gRPC", host, port, "--port", _bind_error(host, port)) from err
        if self.port == 0:
            raise port_error("gRPC", host, port, "--port", _bind_error(host, port))
        self.host = host

    async def start(self) -> None:
        await self.set_serving(False)
        await self.server.start()
        logger.info("%s listening on %s:%d (%s)", self.service_name, self.host, self.port, self.transport)
        if self.health_server is not None:
            await self.health_server.start()

    async def set_serving(self, serving: bool) -> None:
        status = SERVING if serving else NOT_SERVING
        # "" is the whole server's status, the name is the service's own.
        await self.health.set("", status)
        await self.health.set(self.service_name, status)

    async def stop(self, grace: float | None = 5.0) -> None:
        # NOT_SERVING on both ports at once (one servicer): probes see the drain start.
        await self.health.enter_graceful_shutdown()
        if self.health_server is None:
            await self.server.stop(grace)
        else:
            await asyncio.gather(self.server.stop(grace), self.health_server.stop(grace))


class PlaintextHealthServer:
    """grpc.health.v1 alone, without TLS, on --health-port: what Kubernetes' native gRPC
    probes can reach. It serves no other service (not the service's own, not
    reflection): a caller without a certificate or a key learns only the status."""

    def __init__(self, health: health_async.HealthServicer, host: str, port: int):
        # No SO_REUSEPORT (as SERVER_OPTIONS): a port another process holds fails here,
        # rather than the kubelet's probes reaching that process half the time.
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(health, self.server)
        if (busy := _bind_error(host, port)) is not None:
            raise port_error("gRPC health", host, port, "--health-port", busy)
        try:
            self.port = self.server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as err:
            raise port_error("gRPC health", host, port, "--health-port", _bind_error(host, port)) from err
        self.host = host

    async def start(self) -> None:
        await self.server.start()
        logger.info("grpc.health.v1 (plaintext, health only) listening on %s:%d", self.host, self.port)

    async def stop(self, grace: float | None) -> None:
        await self.server.stop(grace)


def _bind_error(host: str, port: int) -> OSError | None:
    """Why `host:port` cannot be bound, asked of the OS directly (gRPC does not say)."""
    import socket

    try:
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        with socket.socket(family) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # As gRPC binds.
            s.bind((host.strip("[]"), port))
    except OSError as err:
        return err
    return None


def channel(target: str, security: SecurityOptions, max_message_bytes: int = MAX_MESSAGE_BYTES,
            tls_name: str | None = None) -> grpc.aio.Channel:
    """A channel to another llmserve service: mutual TLS with this service's own
    certificate (plaintext with --insecure). `tls_name`: the name the peer's certificate
    must carry when `target` is one of the addresses that name resolves to."""
    options = with_message_limits(CHANNEL_OPTIONS, max_message_bytes)
    if tls_name is not None and not security.insecure:
        options = options + [("grpc.ssl_target_name_override", tls_name), ("grpc.default_authority", tls_name)]
    if security.insecure:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, internal_credentials(security), options=options)


def run_until_signal(serve: Callable[[Any, asyncio.Event], Awaitable[None]], config: Any) -> int:
    """Runs `serve(config, stop)` on a new event loop (uvloop's unless LLMSERVE_EVENT_LOOP
    says asyncio: contract/event_loop.py); SIGINT or SIGTERM sets `stop`, and so does the
    exit of the launcher that started it (contract/parent_watch.py); the service drains
    and returns. Returns the process's exit code."""

    parent = parent_watch.parent_to_follow()

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        # A launcher's child stops when the launcher is gone.
        watch = asyncio.create_task(parent_watch.stop_when_orphaned(parent, stop)) if parent is not None else None
        try:
            await serve(config, stop)
        finally:
            if watch is not None:
                watch.cancel()

    try:
        name, factory = event_loop.loop_factory()
    except ValueError as err:
        logger.error("%s", err)
        return 2
    logger.info("event loop: %s", name)
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())
    return 0


@dataclass(frozen=True)
class ServerOptions:
    """Where a service listens, where its metrics go and how long it drains: the same
    settings in every service (each with its own default port)."""

    # NOTE: loopback unless told otherwise: a service run alone is not reachable from
    # other hosts by accident (docker-compose and Kubernetes pass --host 0.0.0.0).
    host: str = setting("127.0.0.1", help="address to listen on (metrics too)")
    port: int = setting(0, help="gRPC port (0 picks a free one)")
    metrics_port: int = setting(0, help="Prometheus endpoint http://HOST:PORT/metrics (0 = off)")
    health_port: int = setting(0, help="plaintext port serving grpc.health.v1 only (the same status as the "
                                       "TLS port), for probes that cannot do TLS, e.g. Kubernetes' grpc probes "
                                       "(0 = off)")
    shutdown_timeout: float = setting(30.0, help="after SIGTERM, seconds in-flight work may go on before it is "
                                                 "cut off")
    max_message_bytes: int = setting(MAX_MESSAGE_BYTES, parse=parse_bytes, show=format_bytes,
                                     help="largest gRPC message between services (step plans and their results, "
                                          "requests to the scheduler); gRPC refuses a larger one with "
                                          "RESOURCE_EXHAUSTED")


def service_command(name: str, help: str, config_cls: type, serve: str) -> Command:
    """`llmserve <name>`: resolves `config_cls` and runs `serve` ("module:function", imported
    only when the command runs) until SIGINT or SIGTERM. The config's `security` group
    must be complete (TLS files) unless it says --insecure."""

    def run(config: Any) -> int:
        # A config may add its own checks (the router: an API key) as a `problem()` method.
        problem = config.security.problem() or (config.problem() if hasattr(config, "problem") else None)
        if problem is not None:
            logger.error("%s: %s", name, problem)
            return 2
        config.security.warn_if_insecure(f"the {name}")
        module, _, function = serve.partition(":")
        return run_until_signal(getattr(importlib.import_module(module), function), config)

    return Command(name, help, config_cls, run)
