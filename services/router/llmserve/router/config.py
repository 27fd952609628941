"""The router's settings (flags, LLMSERVE_* variables and config-file keys alike)."""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.contract.api_keys import ApiKeyOptions
from llmserve.contract.grpc_server import ServerOptions, service_command
from llmserve.contract.security import SecurityOptions
from llmserve.settings import format_bytes, group, parse_bytes, setting


@dataclass(frozen=True)
class RouterConfig:
    model: str = setting("default", help="local HF model directory; 'default' = the embedded SmolLM2-135M-Instruct")
    served_model_name: str | None = setting(None, help="the name clients pass as `model`",
                                            unset="the directory's name")
    server: ServerOptions = group(lambda: ServerOptions(port=50051))
    security: SecurityOptions = group(SecurityOptions)
    api: ApiKeyOptions = group(ApiKeyOptions)
    http_port: int = setting(0, help="port of the OpenAI-compatible HTTP API (/v1/chat/completions, "
                                     "/v1/completions, /v1/models, /health, /metrics); same TLS and API keys as "
                                     "the gRPC port; 0 = off")
    scheduler_address: str = setting("localhost:50052", flag="scheduler", help="the scheduler's address")
    connect_timeout_s: float = setting(600.0, flag="connect-timeout",
                                       help="seconds to wait for the scheduler to serve a model")
    # NOTE: the public port's own limit, smaller than the internal hops' --max-message-bytes:
    # gRPC reads a whole message into memory before any check of ours can run.
    max_request_bytes: int = setting(4 * 2**20, parse=parse_bytes, show=format_bytes,
                                     help="largest request a client may send to the public port; gRPC refuses a "
                                          "larger one with RESOURCE_EXHAUSTED")
    max_prompt_bytes: int | None = setting(None, parse=parse_bytes, show=format_bytes,
                                           help="largest prompt in UTF-8 bytes (text, or chat roles and contents "
                                                "together), refused before it is tokenized",
                                           unset="max_model_len x the longest token's bytes: the most any prompt "
                                                 "that fits can take")

    def problem(self) -> str | None:
        """The public port takes no call without a key, unless --insecure."""
        return None if self.security.insecure else self.api.problem()


COMMAND = service_command("router", "the public gRPC API", RouterConfig, "llmserve.router.service:serve")
