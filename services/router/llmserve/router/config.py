"""The router's settings (flags, LLMSERVE_* variables and config-file keys alike)."""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.contract.api_keys import ApiKeyOptions
from llmserve.contract.grpc_server import ServerOptions, service_command
from llmserve.contract.security import SecurityOptions
from llmserve.settings import group, setting


@dataclass(frozen=True)
class RouterConfig:
    model: str = setting("default", help="local HF model directory; 'default' = the embedded SmolLM2-135M-Instruct")
    served_model_name: str | None = setting(None, help="the name clients pass as `model`",
                                            unset="the directory's name")
    server: ServerOptions = group(lambda: ServerOptions(port=50051))
    security: SecurityOptions = group(SecurityOptions)
    api: ApiKeyOptions = group(ApiKeyOptions)
    scheduler_address: str = setting("localhost:50052", flag="scheduler", help="the scheduler's address")
    connect_timeout_s: float = setting(600.0, flag="connect-timeout",
                                       help="seconds to wait for the scheduler to serve a model")

    def problem(self) -> str | None:
        """The public port takes no call without a key, unless --insecure."""
        return None if self.security.insecure else self.api.problem()


COMMAND = service_command("router", "the public gRPC API", RouterConfig, "llmserve.router.service:serve")
