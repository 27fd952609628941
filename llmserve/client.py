"""A small asyncio client for the public llmserve API (llmserve.v1.Generation).

    async with LLMServeClient("localhost:50051", tls_ca="ca.crt", api_key=KEY) as client:
        async for delta in client.generate("Hi", max_tokens=32):
            print(delta.text, end="", flush=True)
        text = await client.complete(messages=[("user", "What is 2+2?")])

TLS by default: the server is verified against `tls_ca` (a path or PEM bytes; the
system's roots if none), and `api_key` goes with every call as `authorization: Bearer
<key>`. Unset, they come from LLMSERVE_TLS_CA and LLMSERVE_API_KEY (the variables the
services read too), and the address from LLMSERVE_TARGET (else localhost:50051). `insecure=True` (or LLMSERVE_INSECURE=1) talks plaintext to a
server run with --insecure, and sends no key.

RPC failures surface as ``grpc.aio.AioRpcError`` (``.code()`` keeps the status). A
``generate`` stream that fails after its first delta raises ``StreamFailed``, a subclass
that says so: e.g. UNAVAILABLE "worker lost: the worker at ... stopped answering", not a
connection problem. ``is_transport_failure(err)`` tells the two apart.
Leaving a ``generate`` loop early (``break``, task cancel) cancels the call, and the
server aborts the request.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.contract.outputs import TokenLogprobs
from llmserve.contract.security import channel_credentials
from llmserve.v1 import generation_pb2 as pb
from llmserve.v1 import generation_pb2_grpc as pb_grpc

# (role, content) pairs or {"role": ..., "content": ...} mappings.
Messages = Sequence[tuple[str, str]] | Sequence[Mapping[str, Any]]

_FINISH_REASONS = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_ERROR: "error",
    pb.FINISH_REASON_TOOL_CALLS: "tool_calls",
}


class GenerationError(RuntimeError):
    """A sample finished with finish_reason "error" (the server's message attached)."""


# What gRPC's own failures say (no server sent these statuses): the call never reached a
# server, or lost its connection to it.
TRANSPORT_FAILURES = ("failed to connect to all addresses", "Connection refused", "DNS resolution failed",
                      "Socket closed", "Connection reset", "Broken pipe", "GOAWAY", "keepalive watchdog",
                      "Ssl handshake failed", "CERTIFICATE_VERIFY_FAILED", "WRONG_VERSION_NUMBER",
                      "No route to host", "Network is unreachable", "Cancelling all calls")


def is_transport_failure(err: grpc.aio.AioRpcError) -> bool:
    """Whether `err` is the connection failing (never reached the server, or lost it),
    rather than a status the server sent (which names its own cause)."""
    if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
        return False
    details = err.details() or ""
    return any(needle in details for needle in TRANSPORT_FAILURES)


class StreamFailed(grpc.aio.AioRpcError):
    """A Generate stream that failed after `deltas` deltas arrived. ``code()`` and
    ``details()`` are the failure's, as on any AioRpcError (code catching that still
    works); ``transport`` says whether the connection broke rather than the server
    ending the stream with this status."""

    def __init__(self, err: grpc.aio.AioRpcError, deltas: int):
        super().__init__(err.code(), err.initial_metadata(), err.trailing_metadata(), err.details(),
                         err.debug_error_string())
        self.deltas = deltas
        self.transport = is_transport_failure(err)

    def __str__(self) -> str:
        how = "the connection to the server broke" if self.transport else "the server ended it"
        return f"the stream failed after {self.deltas} deltas ({how}): {self.code().name}: {self.details()}"


def _logprobs(msgs) -> list[TokenLogprobs]:
    return [TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob, top_token_ids=tuple(lp.top_token_ids),
                          top_logprobs=tuple(lp.top_logprobs), rank=lp.rank) for lp in msgs]


@dataclass
class GenerationDelta:
    """One streamed step of one sample."""

    request_id: str
    index: int  # Which of the n samples.
    text: str  # New text since this sample's previous delta.
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort", "error", "tool_calls"; None while running.
    usage: dict[str, int] | None = None  # On the request's last delta.
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    stop_reason: str = ""  # The stop string or token that ended the sample.
    error: str = ""
    reasoning_text: str = ""  # A chat's new reasoning, split from `text` (the router's --reasoning-parser).
    # With prompt_logprobs, on the sample's first delta: the prompt's tokens 1.. .
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)

    @classmethod
    def from_pb(cls, msg: pb.GenerateResponse) -> "GenerationDelta":
        usage = None
        if msg.HasField("usage"):
            usage = {
                "prompt_tokens": msg.usage.prompt_tokens,
                "completion_tokens": msg.usage.completion_tokens,
                "cached_tokens": msg.usage.cached_tokens,
            }
        return cls(
            request_id=msg.request_id,
            index=msg.index,
            text=msg.text,
            token_ids=list(msg.token_ids),
            finish_reason=_FINISH_REASONS.get(msg.finish_reason, "error"),
            usage=usage,
            logprobs=_logprobs(msg.logprobs),
            prompt_logprobs=_logprobs(msg.prompt_logprobs),
            stop_reason=msg.stop_reason,
            error=msg.error,
            reasoning_text=msg.reasoning_text,
        )


@dataclass(frozen=True)
class TokenizeResult:
    token_ids: list[int]
    count: int
    prompt: str  # For chat messages: the rendered chat template.


@dataclass(frozen=True)
class ModelInfo:
    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int
    dtype: str
    block_size: int
    num_kv_blocks: int
    tensor_parallel_size: int
    device: str = "cpu"
    cuda_graphs: bool = False
    data_parallel_size: int = 1
    quantization: str = "none"
    dtype_reason: str = ""
    # One engine step's limits and why (0 and "": a router that predates them).
    max_num_batched_tokens: int = 0
    max_num_seqs: int = 0
    step_budget_reason: str = ""

    @classmethod
    def from_pb(cls, msg: pb.ModelInfo) -> "ModelInfo":
        return cls(
            model=msg.model,
            max_model_len=msg.max_model_len,
            vocab_size=msg.vocab_size,
            eos_token_ids=tuple(msg.eos_token_ids),
            bos_token_id=msg.bos_token_id,
            dtype=msg.dtype,
            block_size=msg.block_size,
            num_kv_blocks=msg.num_kv_blocks,
            tensor_parallel_size=msg.tensor_parallel_size,
            device=msg.device or "cpu",
            cuda_graphs=msg.cuda_graphs,
            data_parallel_size=msg.data_parallel_size or 1,
            quantization=msg.quantization or "none",
            dtype_reason=msg.dtype_reason,
            max_num_batched_tokens=msg.max_num_batched_tokens,
            max_num_seqs=msg.max_num_seqs,
            step_budget_reason=msg.step_budget_reason,
        )


def chat_messages_pb(messages: Messages, chat_template_kwargs: Mapping[str, Any] | None = None) -> pb.ChatMessages:
    """`chat_template_kwargs`: variables for the chat template (JSON values: {"enable_thinking": False})."""
    out = pb.ChatMessages(chat_template_kwargs={k: json.dumps(v) for k, v in (chat_template_kwargs or {}).items()})
    for message in messages:
        if isinstance(message, Mapping):
            role, content = message["role"], message["content"]
        else:
            role, content = message
        out.messages.add(role=role, content=content)
    return out


def structured_output_pb(*, json_schema: Mapping[str, Any] | str | None = None, json_object: bool = False,
                         regex: str | None = None, choice: Sequence[str] | None = None,
                         grammar: str | None = None) -> pb.StructuredOutput | None:
    """The one constraint asked for (None: none): a JSON schema (a mapping, or its JSON
    text), any JSON object, a regular expression, one of `choice`'s strings, or an EBNF
    grammar (rule `root`). ValueError if more than one is given."""
    asked = [(kind, spec) for kind, spec, given in (
        (pb.STRUCTURED_OUTPUT_KIND_JSON_SCHEMA, json_schema, json_schema is not None),
        (pb.STRUCTURED_OUTPUT_KIND_JSON_OBJECT, "", json_object),
        (pb.STRUCTURED_OUTPUT_KIND_REGEX, regex, regex is not None),
        (pb.STRUCTURED_OUTPUT_KIND_CHOICE, choice, choice is not None),
        (pb.STRUCTURED_OUTPUT_KIND_GRAMMAR, grammar, grammar is not None),
    ) if given]
    if len(asked) > 1:
        raise ValueError("pass at most one of json_schema, json_object, regex, choice or grammar")
    if not asked:
        return None
    kind, spec = asked[0]
    if not isinstance(spec, str):  # A schema mapping or the choices: JSON text on the wire.
        spec = json.dumps(spec if isinstance(spec, Mapping) else list(spec))
    return pb.StructuredOutput(kind=kind, spec=spec)


def build_generate_request(
    prompt: str | None = None,
    *,
    messages: Messages | None = None,
    token_ids: Sequence[int] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int = 0,
    seed: int | None = None,
    stop: Sequence[str] | str = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    n: int | None = None,
    logprobs: int | None = None,
    request_id: str = "",
    model: str = "",
    priority: int = 0,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    repetition_penalty: float | None = None,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    min_p: float = 0.0,
    logit_bias: Mapping[int, float] | None = None,
    min_tokens: int = 0,
    json_schema: Mapping[str, Any] | str | None = None,
    json_object: bool = False,
    regex: str | None = None,
    choice: Sequence[str] | None = None,
    grammar: str | None = None,
    bad_words: Sequence[str] = (),
    prompt_logprobs: int | None = None,
) -> pb.GenerateRequest:
    """The GenerateRequest for these arguments; exactly one input must be given. The
    sampling fields are SamplingParams' (protos/llmserve/v1/generation.proto); json_schema
    to grammar are its structured_output, at most one (structured_output_pb)."""
    given = [x is not None for x in (prompt, messages, token_ids)]
    if sum(given) != 1:
        raise ValueError("pass exactly one of prompt, messages or token_ids")
    if isinstance(stop, str):
        stop = (stop,)
    params = pb.SamplingParams(
        top_k=top_k, stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, min_p=min_p,
        logit_bias=dict(logit_bias or {}), min_tokens=min_tokens, bad_words=list(bad_words),
        structured_output=structured_output_pb(json_schema=json_schema, json_object=json_object, regex=regex,
                                               choice=choice, grammar=grammar),
    )
    # Optional fields: leave unset (server default) unless given.
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature),
                        ("top_p", top_p), ("seed", seed), ("n", n), ("logprobs", logprobs),
                        ("repetition_penalty", repetition_penalty), ("prompt_logprobs", prompt_logprobs)):
        if value is not None:
            setattr(params, name, value)
    request = pb.GenerateRequest(request_id=request_id, model=model, params=params, priority=priority)
    if prompt is not None:
        request.text = prompt
    elif messages is not None:
        request.messages.CopyFrom(chat_messages_pb(messages, chat_template_kwargs))
    else:
        request.token_ids.ids.extend(token_ids)
    return request


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes", "on")


def router_channel(target: str, *, api_key: str | None = None, tls_ca: str | Path | bytes | None = None,
                   insecure: bool | None = None) -> grpc.aio.Channel:
    """A channel to a router: TLS verified against `tls_ca`, the key on every call (see
    the module's docstring for the defaults)."""
    if insecure is None:
        insecure = _env_flag("LLMSERVE_INSECURE")
    if insecure:
        return grpc.aio.insecure_channel(target)
    api_key = api_key if api_key is not None else os.environ.get("LLMSERVE_API_KEY") or None
    tls_ca = tls_ca if tls_ca is not None else os.environ.get("LLMSERVE_TLS_CA") or None
    return grpc.aio.secure_channel(target, channel_credentials(tls_ca, api_key=api_key))


class LLMServeClient:
    """Async client for one llmserve router. Use as ``async with``, or call close()."""

    def __init__(self, target: str | None = None, *, api_key: str | None = None,
                 tls_ca: str | Path | bytes | None = None, insecure: bool | None = None,
                 channel: grpc.aio.Channel | None = None, timeout: float | None = None) -> None:
        # The router's address: LLMSERVE_TARGET when none is given, like `llmserve generate`.
        target = target or os.environ.get("LLMSERVE_TARGET") or "localhost:50051"
        self.target = target
        self._owns_channel = channel is None
        if channel is None:
            channel = router_channel(target, api_key=api_key, tls_ca=tls_ca, insecure=insecure)
        self._channel = channel
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self.timeout = timeout  # Deadline of unary calls, in seconds (None: none).

    async def __aenter__(self) -> "LLMServeClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owns_channel:
            await self._channel.close()

    async def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Messages | None = None,
        token_ids: Sequence[int] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] | str = (),
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        n: int | None = None,
        logprobs: int | None = None,
        request_id: str = "",
        model: str = "",
        priority: int = 0,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        repetition_penalty: float | None = None,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        min_p: float = 0.0,
        logit_bias: Mapping[int, float] | None = None,
        min_tokens: int = 0,
        json_schema: Mapping[str, Any] | str | None = None,
        json_object: bool = False,
        regex: str | None = None,
        choice: Sequence[str] | None = None,
        grammar: str | None = None,
        bad_words: Sequence[str] = (),
        prompt_logprobs: int | None = None,
        metadata: Sequence[tuple[str, str]] | None = None,
    ) -> AsyncIterator[GenerationDelta]:
        """Stream the deltas of all samples (a chat's reasoning, where the router splits
        it, in ``reasoning_text``); ``None`` arguments take the server default; the
        arguments are ``build_generate_request``'s. ``metadata``: gRPC call metadata, e.g.
        ``(("traceparent", "00-..."),)``."""
        request = build_generate_request(
            prompt, messages=messages, token_ids=token_ids, max_tokens=max_tokens,
            temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop,
            stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, n=n, logprobs=logprobs,
            request_id=request_id, model=model, priority=priority, chat_template_kwargs=chat_template_kwargs,
            repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty, min_p=min_p, logit_bias=logit_bias, min_tokens=min_tokens,
            json_schema=json_schema, json_object=json_object, regex=regex, choice=choice, grammar=grammar,
            bad_words=bad_words, prompt_logprobs=prompt_logprobs,
        )
        call = self._stub.Generate(request, metadata=metadata)
        deltas = 0
        try:
            async for msg in call:
                deltas += 1
                yield GenerationDelta.from_pb(msg)
        except grpc.aio.AioRpcError as err:
            if deltas:  # Mid-stream: the request reached the server, whatever failed since.
                raise StreamFailed(err, deltas) from err
            raise
        finally:
            # NOTE: a no-op when the stream ended; otherwise (break, cancellation,
            # an exception in the caller) it tells the server to abort the request.
            call.cancel()

    async def complete(self, prompt: str | None = None, **kwargs: Any) -> str:
        """The whole text of sample 0 (arguments as for ``generate``).

        Raises GenerationError if the sample failed.
        """
        parts: list[str] = []
        async for delta in self.generate(prompt, **kwargs):
            if delta.index != 0:
                continue
            parts.append(delta.text)
            if delta.finish_reason == "error":
                raise GenerationError(delta.error or "generation failed")
        return "".join(parts)

    async def tokenize(self, text: str | None = None, *, messages: Messages | None = None,
                       add_special_tokens: bool | None = None, model: str = "") -> TokenizeResult:
        if (text is None) == (messages is None):
            raise ValueError("pass exactly one of text or messages")
        request = pb.TokenizeRequest(model=model)
        if text is not None:
            request.text = text
        else:
            request.messages.CopyFrom(chat_messages_pb(messages))
        if add_special_tokens is not None:
            request.add_special_tokens = add_special_tokens
        reply = await self._stub.Tokenize(request, timeout=self.timeout)
        return TokenizeResult(token_ids=list(reply.token_ids), count=reply.count, prompt=reply.prompt)

    async def model_info(self, model: str = "") -> ModelInfo:
        reply = await self._stub.GetModelInfo(pb.GetModelInfoRequest(model=model), timeout=self.timeout)
        return ModelInfo.from_pb(reply)

    async def health(self, service: str = "") -> str:
        """The grpc.health.v1 status: "SERVING", "NOT_SERVING", "UNKNOWN", ..."""
        reply = await self._health.Check(
            health_pb2.HealthCheckRequest(service=service), timeout=self.timeout
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
