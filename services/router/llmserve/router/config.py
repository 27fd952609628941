"""The router's settings (flags, LLMSERVE_* variables and config-file keys alike)."""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.settings import Command, setting


@dataclass(frozen=True)
class RouterConfig:
    model: str = setting("default", help="local HF model directory; 'default' = the embedded SmolLM2-135M-Instruct")
    served_model_name: str | None = setting(None, help="the name clients pass as `model`",
                                            unset="the directory's name")
    host: str = setting("0.0.0.0", help="address to listen on")
    port: int = setting(50051, help="the public gRPC port")
    scheduler_address: str = setting("localhost:50052", flag="scheduler", help="the scheduler's address")
    connect_timeout_s: float = setting(600.0, flag="connect-timeout",
                                       help="seconds to wait for the scheduler to serve a model")
    metrics_port: int = setting(0, help="Prometheus endpoint http://HOST:PORT/metrics (0 = off)")
    shutdown_timeout_s: float = setting(30.0, flag="shutdown-timeout",
                                        help="after SIGTERM, seconds in-flight streams may run on before they are aborted")


def _run(config: RouterConfig) -> int:
    from llmserve.contract.grpc_server import run_until_signal
    from llmserve.router.service import serve

    return run_until_signal(serve, config)


COMMAND = Command("router", "the public gRPC API", RouterConfig, _run)
