"""A small asyncio client for the public llmserve API (llmserve.v1.Generation).

    async with LLMServeClient("localhost:50051", tls_ca="ca.crt", api_key=KEY) as client:
        async for delta in client.generate("Hi", max_tokens=32):
            print(delta.text, end="", flush=True)
        text = await client.complete(messages=[("user", "What is 2+2?")])
        deltas = [d async for d in client.generate(messages=[("user", "Weather in Paris?")],
                                                   tools=[weather], tool_choice="required")]
        calls = collect_tool_calls(deltas)  # [ToolCall(id="call_...", name=..., arguments="{...}")]

Every keyword after the input is a field of ``GenerateOptions``, the one record that
becomes the request (``options=`` takes a whole one).

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
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
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


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of one tool call of a streamed chat reply: its first piece has the call's
    `id` and `name`, later ones extend its `arguments` (``collect_tool_calls`` joins them)."""

    index: int  # Which call of the sample, from 0.
    id: str = ""
    name: str = ""
    arguments: str = ""  # More of the arguments' JSON text.


@dataclass(frozen=True)
class ToolCall:
    """A whole tool call: what a reply asked for, and what an assistant turn sends back
    (``{"role": "assistant", "tool_calls": [call]}``)."""

    id: str  # "call_...": the tool turn answering it repeats it as tool_call_id.
    name: str
    arguments: str  # A JSON object's text.


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
    # A chat's tool calls (tool_choice required, a named function, or auto with the router's
    # --tool-call-parser); the sample then ends with finish_reason "tool_calls".
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

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
            tool_calls=[ToolCallDelta(index=c.index, id=c.id, name=c.name, arguments=c.arguments)
                        for c in msg.tool_calls],
        )


def collect_tool_calls(deltas: Iterable[GenerationDelta], index: int = 0) -> list[ToolCall]:
    """Sample `index`'s tool calls, their pieces joined, in call order."""
    calls: dict[int, ToolCall] = {}
    for piece in (p for d in deltas if d.index == index for p in d.tool_calls):
        call = calls.get(piece.index, ToolCall(piece.id, piece.name, ""))
        calls[piece.index] = replace(call, arguments=call.arguments + piece.arguments)
    return [calls[i] for i in sorted(calls)]


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


def _refuse_other_keys(mapping: Mapping[str, Any], allowed: tuple[str, ...], what: str) -> None:
    """ValueError naming the keys of `mapping` outside `allowed`: sent on, the server would
    not know them; dropped, the caller would not know they did nothing."""
    unknown = sorted(set(mapping) - set(allowed))
    if unknown:
        raise ValueError(f"{what}: {', '.join(map(repr, unknown))} not supported (only {', '.join(allowed)})")


def tool_call_pb(call: ToolCall | Mapping[str, Any]) -> pb.ToolCall:
    """An earlier reply's call: a ToolCall (``collect_tool_calls``), or as the OpenAI API
    writes it: ``{"id": ..., "type": "function", "function": {"name": ..., "arguments": ...}}``
    (the arguments a JSON object's text, or the mapping)."""
    if isinstance(call, ToolCall):
        return pb.ToolCall(id=call.id, name=call.name, arguments=call.arguments)
    _refuse_other_keys(call, ("id", "type", "function"), "tool_calls")
    if call.get("type", "function") != "function":
        raise ValueError(f"tool_calls: type {call['type']!r}; only 'function' calls exist")
    function = call["function"]
    _refuse_other_keys(function, ("name", "arguments"), "tool_calls function")
    arguments = function["arguments"]
    return pb.ToolCall(id=call["id"], name=function["name"],
                       arguments=arguments if isinstance(arguments, str) else json.dumps(arguments))


def chat_message_pb(message: tuple[str, str] | Mapping[str, Any]) -> pb.ChatMessage:
    """One turn: ``(role, content)``, or a mapping of ``role``, ``content`` and, in a tool
    round trip, an assistant turn's ``tool_calls`` (``tool_call_pb``) and a ``tool`` turn's
    ``tool_call_id`` and ``name``."""
    if not isinstance(message, Mapping):
        role, content = message
        return pb.ChatMessage(role=role, content=content)
    _refuse_other_keys(message, ("role", "content", "tool_calls", "tool_call_id", "name"), "messages")
    return pb.ChatMessage(role=message["role"], content=message.get("content") or "",
                          tool_calls=[tool_call_pb(call) for call in message.get("tool_calls") or ()],
                          tool_call_id=message.get("tool_call_id") or "", name=message.get("name") or "")


def chat_messages_pb(messages: Messages, chat_template_kwargs: Mapping[str, Any] | None = None) -> pb.ChatMessages:
    """`chat_template_kwargs`: variables for the chat template (JSON values: {"enable_thinking": False})."""
    return pb.ChatMessages(messages=[chat_message_pb(m) for m in messages],
                           chat_template_kwargs={k: json.dumps(v) for k, v in (chat_template_kwargs or {}).items()})


def tool_pb(tool: Mapping[str, Any]) -> pb.Tool:
    """A function the model may call: its definition, ``{"name": ..., "description": ...,
    "parameters": <JSON schema>}`` (the schema a mapping or its JSON text; none: it takes
    no parameters), or the same wrapped as the OpenAI API writes it: ``{"type": "function",
    "function": {...}}``."""
    function = tool
    if "function" in tool:
        _refuse_other_keys(tool, ("type", "function"), "tools")
        if tool.get("type") != "function":
            raise ValueError(f"tools: type {tool.get('type')!r}; only 'function' tools exist")
        function = tool["function"]
    # NOTE: "strict" is accepted as the router's OpenAI door accepts it: tool_choice
    # required or a named function constrains the arguments to the schema either way.
    _refuse_other_keys(function, ("name", "description", "parameters", "strict"), "tools function")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, str):
        parameters = json.dumps(parameters)
    return pb.Tool(name=function["name"], description=function.get("description") or "",
                   parameters=parameters or "")


_TOOL_CHOICE_MODES = {"none": pb.TOOL_CHOICE_MODE_NONE, "auto": pb.TOOL_CHOICE_MODE_AUTO,
                      "required": pb.TOOL_CHOICE_MODE_REQUIRED}


def tool_choice_pb(choice: str | Mapping[str, Any]) -> pb.ToolChoice:
    """``"none"``, ``"auto"`` (the router's --tool-call-parser reads the calls),
    ``"required"``, or one function the model must call, as the OpenAI API names it:
    ``{"type": "function", "function": {"name": ...}}``."""
    if isinstance(choice, str):
        if choice not in _TOOL_CHOICE_MODES:
            raise ValueError(f"tool_choice: {choice!r}; pass none, auto, required or "
                             "{'type': 'function', 'function': {'name': ...}}")
        return pb.ToolChoice(mode=_TOOL_CHOICE_MODES[choice])
    _refuse_other_keys(choice, ("type", "function"), "tool_choice")
    if choice.get("type") != "function":
        raise ValueError(f"tool_choice: type {choice.get('type')!r}; only 'function' tools exist")
    _refuse_other_keys(choice["function"], ("name",), "tool_choice function")
    return pb.ToolChoice(function_name=choice["function"]["name"])


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


@dataclass(frozen=True)
class GenerateOptions:
    """Everything a Generate call asks for besides its input, in one record:
    ``build_generate_request`` and ``LLMServeClient.generate`` take its fields as keywords
    (or a whole record as ``options=``), and ``request_pb`` alone turns it into the request.

    A field named as one of SamplingParams' (protos/llmserve/v1/generation.proto) is sent
    as that field, None leaving it unset (the server's default); json_schema to grammar are
    its structured_output, at most one (structured_output_pb). chat_template_kwargs and the
    tool fields are a chat's (``messages=``) and refused with any other input.
    """

    # SamplingParams' fields.
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int = 0
    seed: int | None = None
    stop: Sequence[str] | str = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    n: int | None = None
    logprobs: int | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    min_tokens: int = 0
    bad_words: Sequence[str] = ()
    prompt_logprobs: int | None = None
    # SamplingParams.structured_output.
    json_schema: Mapping[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    # GenerateRequest's own fields.
    request_id: str = ""
    model: str = ""
    priority: int = 0
    cache_salt: str = ""  # Prefix-cache isolation: cached blocks shared only with this salt's requests.
    # ChatMessages' fields. chat_template_kwargs: JSON values ({"enable_thinking": False}).
    chat_template_kwargs: Mapping[str, Any] | None = None
    tools: Sequence[Mapping[str, Any]] = ()  # Function definitions (tool_pb).
    tool_choice: str | Mapping[str, Any] | None = None  # tool_choice_pb; None: auto with tools, else none.
    parallel_tool_calls: bool | None = None  # False: at most one call. None: true.

    def sampling_pb(self) -> pb.SamplingParams:
        given = {name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None}
        if isinstance(self.stop, str):
            given["stop"] = (self.stop,)
        if self.logit_bias is not None:
            given["logit_bias"] = dict(self.logit_bias)
        return pb.SamplingParams(**given, structured_output=structured_output_pb(
            json_schema=self.json_schema, json_object=self.json_object, regex=self.regex, choice=self.choice,
            grammar=self.grammar))

    def chat_pb(self, messages: Messages) -> pb.ChatMessages:
        chat = chat_messages_pb(messages, self.chat_template_kwargs)
        chat.tools.extend(tool_pb(tool) for tool in self.tools)
        if self.tool_choice is not None:
            chat.tool_choice.CopyFrom(tool_choice_pb(self.tool_choice))
        if self.parallel_tool_calls is not None:
            chat.parallel_tool_calls = self.parallel_tool_calls
        return chat

    def request_pb(self, prompt: str | None = None, *, messages: Messages | None = None,
                   token_ids: Sequence[int] | None = None) -> pb.GenerateRequest:
        """The GenerateRequest for exactly one input: a prompt, chat messages or token ids."""
        if sum(x is not None for x in (prompt, messages, token_ids)) != 1:
            raise ValueError("pass exactly one of prompt, messages or token_ids")
        request = pb.GenerateRequest(request_id=self.request_id, model=self.model, params=self.sampling_pb(),
                                     priority=self.priority, cache_salt=self.cache_salt)
        if messages is not None:
            request.messages.CopyFrom(self.chat_pb(messages))
            return request
        chat_only = self.chat_pb(()).ListFields()  # What the chat fields would send.
        if chat_only:
            raise ValueError(f"{', '.join(f.name for f, _ in chat_only)}: for chat messages only (pass messages=)")
        if prompt is not None:
            request.text = prompt
        else:
            request.token_ids.ids.extend(token_ids)
        return request


# The options sent as the SamplingParams field of the same name.
_SAMPLING_FIELDS = tuple(f.name for f in pb.SamplingParams.DESCRIPTOR.fields
                         if f.name in GenerateOptions.__dataclass_fields__)


def build_generate_request(prompt: str | None = None, *, messages: Messages | None = None,
                           token_ids: Sequence[int] | None = None, options: GenerateOptions | None = None,
                           **fields: Any) -> pb.GenerateRequest:
    """The GenerateRequest for exactly one input, asking for `options` with `fields` (any
    of GenerateOptions', as keywords: ``max_tokens=16, temperature=0``) over them."""
    return replace(options or GenerateOptions(), **fields).request_pb(prompt, messages=messages,
                                                                     token_ids=token_ids)


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

    async def generate(self, prompt: str | None = None, *, messages: Messages | None = None,
                       token_ids: Sequence[int] | None = None, options: GenerateOptions | None = None,
                       metadata: Sequence[tuple[str, str]] | None = None,
                       **fields: Any) -> AsyncIterator[GenerationDelta]:
        """Stream the deltas of all samples (a chat's reasoning, where the router splits
        it, in ``reasoning_text``; its tool calls in ``tool_calls``). The arguments are
        ``build_generate_request``'s: one input, and GenerateOptions' fields as keywords
        (``None``: the server's default). ``metadata``: gRPC call metadata, e.g.
        ``(("traceparent", "00-..."),)``."""
        request = build_generate_request(prompt, messages=messages, token_ids=token_ids, options=options, **fields)
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
