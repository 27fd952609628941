"""The OpenAI request bodies the HTTP API accepts, and their translation into what
`Generation` runs: a public `GenerateRequest` for the prompt (the message a gRPC client
sends) and the sampling settings as the router's `SamplingParams`, converted here once
(this module, not wire.py, because it reads pydantic models).

Every field a client sends is honoured or refused, never silently dropped:

- a field declared on a model below is honoured (each reaches `SamplingParams`, the
  prompt, or the rendering of the reply);
- IGNORED fields only matter to OpenAI's billing and logging: accepted, and unused;
- NOT_SUPPORTED fields are refused by name with a 400 saying so (null is accepted: it
  asks for nothing);
- any other field is refused by name as unknown.

Only the shape is checked here (pydantic: types, required fields); every value check
(ranges, sizes, the model's name, the prompt's length) is `Generation`'s, shared with
gRPC. Tool calling (`tools`, `tool_choice`, `parallel_tool_calls`, messages' `tool_calls`,
`tool_call_id`, `name`) becomes the public ChatMessages' fields (router/tools.py reads
them); the deprecated `functions` and `function_call` are refused. Extensions beyond
OpenAI's fields, as vLLM names them: `top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `priority`,
`guided_regex`, `guided_choice`, `guided_grammar`, `bad_words`, `prompt_logprobs`, `cache_salt`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from llmserve.contract.sampling import SamplingParams, StructuredOutput
from llmserve.contract.wire import public_float, public_int, public_str
from llmserve.router.validation import invalid
from llmserve.v1 import generation_pb2

# Accepted and unused: on OpenAI's side they only key billing, logging and retention.
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier"})

_FUNCTIONS = "deprecated by OpenAI and not supported: use tools and tool_choice"
_STRUCTURED = ("this form of structured output is not supported (use response_format, guided_regex, "
               "guided_choice or guided_grammar)")
# Fields of OpenAI's API (and common extensions) this server does not implement: refused
# by name, with why. Later items of issue #33 move some into the models below.
NOT_SUPPORTED = {
    "functions": _FUNCTIONS, "function_call": _FUNCTIONS,
    "guided_json": "use response_format's json_schema", "structured_outputs": _STRUCTURED,
    "reasoning_effort": "reasoning options are not supported yet",
    "audio": "audio output is not supported", "modalities": "output modalities other than text are not supported",
    "prediction": "predicted outputs are not supported", "web_search_options": "web search is not supported",
    "verbosity": "verbosity is not supported", "moderation": "moderation is not supported",
    "prompt_cache_key": "prompt cache controls are not supported (prefix caching is automatic)",
    "prompt_cache_retention": "prompt cache controls are not supported (prefix caching is automatic)",
    "prompt_cache_options": "prompt cache controls are not supported (prefix caching is automatic)",
}

_TOOLS = "tool calling is for chat completions (/v1/chat/completions)"
# Chat's fields that /v1/completions refuses (by name, with why).
CHAT_ONLY = {"tools": _TOOLS, "tool_choice": _TOOLS, "parallel_tool_calls": _TOOLS}


def _check_extra(model: BaseModel, refused: dict[str, str]) -> None:
    """Refuses, by name, a body field the model does not declare (see the module's
    docstring); `refused`: the known fields it does not implement, and why."""
    for name, value in (model.model_extra or {}).items():
        if name in IGNORED:
            continue
        if name in refused:
            if value is None:
                continue
            raise invalid(f"{name}: {refused[name]}", param=name)
        raise invalid(f"{name}: unknown field (this server implements OpenAI's request fields and the "
                      f"extensions in docs/guide/openai.md; it refuses what it would otherwise ignore)",
                      param=name)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False  # A last chunk with `usage` and no choices.


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # None: any JSON.
    strict: bool | None = None  # Always strict: the output follows the schema.


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(BaseModel):
    """Fields both endpoints share."""

    # NOTE: undeclared fields are kept (model_extra) so that `check_fields` can refuse
    # each by name; pydantic's extra="forbid" would name none of them helpfully.
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    # Token id (a JSON object's keys are strings: "50256") -> bias in [-100, 100].
    logit_bias: dict[int, float] | None = None
    top_k: int = 0  # Extension: 0 or -1 = off.
    min_p: float = 0.0  # Extension: 0 = off.
    repetition_penalty: float | None = None  # Extension: 1 (unset) = off.
    min_tokens: int = 0  # Extension: no stop before this many tokens.
    ignore_eos: bool = False  # Extension: generate past end-of-sequence tokens.
    stop_token_ids: list[int] = Field(default_factory=list)  # Extension.
    bad_words: list[str] = Field(default_factory=list)  # Extension (vLLM's): words never generated.
    # Extension (vLLM's): each prompt token's logprob given the tokens before it, and the top k.
    prompt_logprobs: int | None = None
    priority: int = 0  # Extension: lower is served first (the gRPC API's priority).
    # Extension (vLLM's): prefix-cache isolation, GenerateRequest.cache_salt ("" refused, as vLLM does).
    cache_salt: str | None = Field(default=None, min_length=1)
    # Structured output: OpenAI's response_format, or one of the extensions (at most one).
    response_format: ResponseFormat | None = None
    guided_regex: str | None = None  # Extension: the output matches this regex in full.
    guided_choice: list[str] | None = None  # Extension: the output is one of these.
    guided_grammar: str | None = None  # Extension: an EBNF (GBNF) grammar, rule `root`.

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_fields(self) -> None:
        """Refuses (400, by name) every field sent that is neither honoured nor ignored."""
        _check_extra(self, NOT_SUPPORTED)

    def _sampling(self, max_tokens: int | None, logprobs: int | None,
                  prompt_logprobs: int | None) -> tuple[SamplingParams, int]:
        """The settings as SamplingParams, and n: read as wire.sampling_from_public_pb reads
        a gRPC client's (unset: the API's defaults, max_tokens None; numbers held to the
        public API's types, so a number beyond them is a ValueError, a 400). Unchecked:
        validation.check_sampling checks both front doors' alike."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        sampling = SamplingParams(
            max_tokens=None if max_tokens is None else public_int(max_tokens),
            temperature=1.0 if self.temperature is None else public_float(self.temperature),
            top_p=1.0 if self.top_p is None else public_float(self.top_p),
            top_k=public_int(self.top_k),
            seed=None if self.seed is None else public_int(self.seed, 64),
            ignore_eos=self.ignore_eos,
            logprobs=None if logprobs is None else public_int(logprobs),
            prompt_logprobs=None if prompt_logprobs is None else public_int(prompt_logprobs),
            stop_token_ids=tuple(public_int(t) for t in self.stop_token_ids),
            stop=tuple(public_str(s) for s in stop),
            repetition_penalty=1.0 if self.repetition_penalty is None else public_float(self.repetition_penalty),
            frequency_penalty=public_float(self.frequency_penalty or 0.0),
            presence_penalty=public_float(self.presence_penalty or 0.0),
            min_p=public_float(self.min_p),
            logit_bias=tuple(sorted((public_int(t), public_float(b)) for t, b in (self.logit_bias or {}).items())),
            min_tokens=public_int(self.min_tokens),
            structured_output=self._structured_output(),
            bad_words=tuple(public_str(w) for w in self.bad_words),
        )
        return sampling, 1 if self.n is None else public_int(self.n)

    def _structured_output(self) -> StructuredOutput | None:
        """The one constraint asked for (response_format type "text": none), as the gRPC
        API's StructuredOutput carries it; whether it compiles is Generation's check."""
        asked: dict[str, StructuredOutput] = {}
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            asked["response_format"] = StructuredOutput("json_object")
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise invalid("response_format.json_schema is required with type json_schema",
                              param="response_format.json_schema")
            schema = fmt.json_schema.schema_
            asked["response_format"] = (StructuredOutput("json_object") if schema is None
                                        else StructuredOutput("json_schema", public_str(json.dumps(schema))))
        if self.guided_regex is not None:
            asked["guided_regex"] = StructuredOutput("regex", public_str(self.guided_regex))
        if self.guided_choice is not None:
            asked["guided_choice"] = StructuredOutput("choice", public_str(json.dumps(self.guided_choice)))
        if self.guided_grammar is not None:
            asked["guided_grammar"] = StructuredOutput("grammar", public_str(self.guided_grammar))
        if len(asked) > 1:
            raise invalid(f"{' and '.join(asked)}: ask for one structured output only", param=next(iter(asked)))
        return next(iter(asked.values()), None)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # A JSON schema (an object's); None: no parameters.
    # Accepted either way: tool_choice required or a named function always constrains the
    # arguments to the schema; auto's parser reads what the model wrote, unchecked.
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition

    def to_pb(self) -> generation_pb2.Tool:
        f = self.function
        parameters = "" if f.parameters is None else json.dumps(f.parameters, ensure_ascii=False)
        return generation_pb2.Tool(name=public_str(f.name), description=public_str(f.description or ""),
                                   parameters=public_str(parameters))


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionName


_TOOL_CHOICE_MODES = {"none": generation_pb2.TOOL_CHOICE_MODE_NONE, "auto": generation_pb2.TOOL_CHOICE_MODE_AUTO,
                      "required": generation_pb2.TOOL_CHOICE_MODE_REQUIRED}


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str  # JSON text, as the reply gave it.


class MessageToolCall(BaseModel):
    """A call in an earlier assistant reply."""

    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def to_pb(self) -> generation_pb2.ToolCall:
        return generation_pb2.ToolCall(id=public_str(self.id), name=public_str(self.function.name),
                                       arguments=public_str(self.function.arguments))


class ChatMessage(BaseModel):
    # NOTE: kept, and refused by name (`check_fields`): other fields (`audio`,
    # `function_call`, ...) would change what the model sees if the template got them.
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None
    refusal: str | None = None  # An earlier reply's refusal text: accepted as null only.
    tool_calls: list[MessageToolCall] | None = None  # An assistant reply's calls.
    tool_call_id: str | None = None  # A "tool" message: the call it answers.
    name: str | None = None  # The author's (a "tool" message: the function's) name.

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def check_fields(self, index: int) -> None:
        where = f"messages.{index}."
        if self.refusal is not None:
            raise invalid(f"{where}refusal: an assistant refusal in the history is not supported",
                          param=f"{where}refusal")
        for name, value in (self.model_extra or {}).items():
            if value is not None:  # `"audio": null` and the like ask for nothing.
                raise invalid(f"{where}{name}: not supported (role, content, tool_calls, tool_call_id and name "
                              f"reach the chat template)", param=f"{where}{name}")

    def to_pb(self) -> generation_pb2.ChatMessage:
        return generation_pb2.ChatMessage(role=self.role, content=self.text,
                                          tool_calls=[call.to_pb() for call in self.tool_calls or ()],
                                          tool_call_id=public_str(self.tool_call_id or ""),
                                          name=public_str(self.name or ""))


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens.
    logprobs: bool = False
    top_logprobs: int | None = None
    # Extension: variables for the chat template ({"enable_thinking": false}).
    chat_template_kwargs: dict[str, JsonValue] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools.
    parallel_tool_calls: bool | None = None  # None: true.

    def check_fields(self) -> None:
        super().check_fields()
        for i, message in enumerate(self.messages):
            message.check_fields(i)

    def to_pb(self, request_id: str) -> generation_pb2.GenerateRequest:
        """The prompt and its scheduling (the sampling settings: `sampling`)."""
        messages = generation_pb2.ChatMessages(
            messages=[m.to_pb() for m in self.messages],
            chat_template_kwargs={public_str(name): public_str(json.dumps(value, ensure_ascii=False))
                                  for name, value in (self.chat_template_kwargs or {}).items()},
            tools=[tool.to_pb() for tool in self.tools or ()],
            parallel_tool_calls=self.parallel_tool_calls)
        if isinstance(self.tool_choice, NamedToolChoice):
            messages.tool_choice.function_name = public_str(self.tool_choice.function.name)
        elif self.tool_choice is not None:
            messages.tool_choice.mode = _TOOL_CHOICE_MODES[self.tool_choice]
        return generation_pb2.GenerateRequest(request_id=request_id, model=self.model, messages=messages,
                                              priority=self.priority, cache_salt=self.cache_salt or "")

    def sampling(self) -> tuple[SamplingParams, int]:
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling(max_tokens, logprobs, self.prompt_logprobs)


class CompletionRequest(_Sampling):
    # A prompt, or a batch of them: text or token ids.
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # Top logprobs per token (0: the sampled token's only).
    echo: bool = False  # The prompt's text (and with logprobs its tokens' logprobs) before each choice's.
    suffix: str | None = None  # Only empty: insertion is not supported.
    best_of: int | None = None  # Only equal to n (no candidates beyond the n returned).

    def check_fields(self) -> None:
        _check_extra(self, NOT_SUPPORTED | CHAT_ONLY)
        if self.suffix:
            raise invalid("suffix: insertion (a suffix after the completion) is not supported", param="suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise invalid(f"best_of: only best_of = n ({self.n or 1}) is supported (no extra candidates)",
                          param="best_of")

    def prompts(self) -> list[str | list[int]]:
        """The batch: one entry per prompt."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if not self.prompt:
            raise invalid("prompt is empty", param="prompt")
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)

    def to_pb(self, request_ids: list[str]) -> list[generation_pb2.GenerateRequest]:
        """One GenerateRequest per prompt of the batch (`request_ids`: one each); they all
        share the body's sampling settings (`sampling`)."""
        requests = []
        for request_id, prompt in zip(request_ids, self.prompts(), strict=True):
            request = generation_pb2.GenerateRequest(request_id=request_id, model=self.model, priority=self.priority,
                                                     cache_salt=self.cache_salt or "")
            if isinstance(prompt, str):
                request.text = prompt
            else:
                request.token_ids.SetInParent()  # Set even when empty: Generation says what is wrong.
                request.token_ids.ids.extend(prompt)
            requests.append(request)
        return requests

    @property
    def echo_logprobs(self) -> int | None:
        """The top entries per prompt token that echo with logprobs shows (None: no echo logprobs)."""
        return self.logprobs if self.echo else None

    def sampling(self) -> tuple[SamplingParams, int]:
        """echo with logprobs asks the engine for the prompt's logprobs too (the larger k
        of the two; each is shown with its own)."""
        asked = [k for k in (self.prompt_logprobs, self.echo_logprobs) if k is not None]
        # (a negative k stays, for the validation to refuse)
        k = (min(asked) if min(asked) < 0 else max(asked)) if asked else None
        return self._sampling(self.max_tokens, self.logprobs, k)
