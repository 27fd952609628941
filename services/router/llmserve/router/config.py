"""The router's settings (flags, LLMSERVE_* variables and config-file keys alike)."""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.contract.api_keys import ApiKeyOptions
from llmserve.contract.grpc_server import ServerOptions, service_command
from llmserve.contract.security import SecurityOptions
from llmserve.router.discovery import parse_scheduler_addresses
from llmserve.router.reasoning import REASONING_PARSER_CHOICES
from llmserve.router.routing import ROUTING_POLICIES
from llmserve.router.tool_parsers import TOOL_CALL_PARSER_CHOICES
from llmserve.settings import format_bytes, group, parse_bytes, setting


@dataclass(frozen=True)
class RouterConfig:
    """`llmserve router`'s settings (each field one command-line flag, or a group of them)."""

    model: str = setting("default", help="local HF model directory, or a GGUF file (or a directory holding one); "
                                         "'default' = the embedded SmolLM2-135M-Instruct")
    served_model_name: str | None = setting(None, help="the name clients pass as `model`",
                                            unset="the directory's name")
    server: ServerOptions = group(lambda: ServerOptions(port=50051))
    security: SecurityOptions = group(SecurityOptions)
    api: ApiKeyOptions = group(ApiKeyOptions)
    http_port: int = setting(0, help="port of the OpenAI-compatible HTTP API (/v1/chat/completions, "
                                     "/v1/completions, /v1/models, /health, /metrics); same TLS and API keys as "
                                     "the gRPC port; 0 = off")
    scheduler_address: str = setting(
        "localhost:50052", flag="scheduler", parse=parse_scheduler_addresses,
        help="the replicas' schedulers: host:port[,host:port...]; a host name that resolves to several addresses "
             "(a Kubernetes headless Service) is one replica per address")
    scheduler_resolve_interval_s: float = setting(
        10.0, flag="scheduler-resolve-interval", help="seconds between DNS lookups of --scheduler's host names "
                                                      "(replicas that appear join, those that vanish leave)")
    routing_policy: str = setting("cache-aware", choices=ROUTING_POLICIES,
                                  help="which replica runs a request: cache-aware (the longest cached prefix of "
                                       "its prompt, from the replicas' KV events, unless that unbalances the "
                                       "load), least-load, round-robin")
    reasoning_parser: str = setting("none", choices=REASONING_PARSER_CHOICES,
                                    help="how a chat reply splits into reasoning (OpenAI's reasoning_content, "
                                         "the gRPC API's reasoning_text) and answer: none; think (<think>...</think>"
                                         ": Qwen3, QwQ, DeepSeek-R1 distills; a template that opens <think> is "
                                         "seen in the prompt); deepseek_r1 (reasoning until </think>, opening tag "
                                         "or not)")
    tool_call_parser: str = setting("none", choices=TOOL_CALL_PARSER_CHOICES,
                                    help="how tool calls are found in a chat reply with tool_choice auto (the "
                                         "default when a request has tools): none (auto is refused; required and "
                                         "named functions still work: constrained decoding); hermes "
                                         "(<tool_call>{...}</tool_call>: Qwen2.5, Qwen3, Hermes); llama3_json "
                                         "({\"name\": ..., \"parameters\": ...}: Llama 3.1-3.3); mistral "
                                         "([TOOL_CALLS][...]: Mistral v0.3, Nemo)")
    connect_timeout_s: float = setting(600.0, flag="connect-timeout",
                                       help="seconds to wait at start-up for a scheduler to serve a model")
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
