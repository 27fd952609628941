"""The OpenAI request bodies the HTTP API accepts, and their translation into what
`Generation` runs: a public `GenerateRequest` for the prompt (the message a gRPC client
sends) and the sampling settings as the router's `SamplingParams`, converted here once
(this module, not wire.py, because it reads pydantic models).

Only the shape is checked here (pydantic: types, required fields); every value check
(ranges, sizes, the model's name, the prompt's length) is `Generation`'s, shared with
gRPC. Extensions beyond OpenAI's fields, as vLLM names them: `top_k`, `ignore_eos`,
`stop_token_ids`, `priority`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from llmserve.contract.sampling import SamplingParams
from llmserve.contract.wire import public_float, public_int, public_str
from llmserve.router.validation import invalid
from llmserve.v1 import generation_pb2


class StreamOptions(BaseModel):
    include_usage: bool = False  # A last chunk with `usage` and no choices.


class _Sampling(BaseModel):
    """Fields both endpoints share."""

    # NOTE: unknown fields are ignored, as OpenAI-compatible servers do: clients send
    # fields of newer API versions (and `user`, `metadata`) that change nothing here.
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # Accepted for compatibility; nothing is keyed on it.
    top_k: int = 0  # Extension: 0 or -1 = off.
    ignore_eos: bool = False  # Extension: generate past end-of-sequence tokens.
    stop_token_ids: list[int] = Field(default_factory=list)  # Extension.
    priority: int = 0  # Extension: lower is served first (the gRPC API's priority).

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling(self, max_tokens: int | None, logprobs: int | None) -> tuple[SamplingParams, int]:
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
            stop_token_ids=tuple(public_int(t) for t in self.stop_token_ids),
            stop=tuple(public_str(s) for s in stop),
        )
        return sampling, 1 if self.n is None else public_int(self.n)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # `name`, `tool_calls`, ...: not used by the templates here.

    role: str
    content: str | list[TextPart] | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens.
    logprobs: bool = False
    top_logprobs: int | None = None

    def to_pb(self, request_id: str) -> generation_pb2.GenerateRequest:
        """The prompt and its scheduling (the sampling settings: `sampling`)."""
        messages = generation_pb2.ChatMessages(
            messages=[generation_pb2.ChatMessage(role=m.role, content=m.text) for m in self.messages])
        return generation_pb2.GenerateRequest(request_id=request_id, model=self.model, messages=messages,
                                              priority=self.priority)

    def sampling(self) -> tuple[SamplingParams, int]:
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs needs logprobs: true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling(max_tokens, logprobs)


class CompletionRequest(_Sampling):
    # A prompt, or a batch of them: text or token ids.
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # Top logprobs per token (0: the sampled token's only).
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The batch: one entry per prompt."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if not self.prompt:
            raise invalid("prompt is empty")
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)

    def to_pb(self, request_ids: list[str]) -> list[generation_pb2.GenerateRequest]:
        """One GenerateRequest per prompt of the batch (`request_ids`: one each); they all
        share the body's sampling settings (`sampling`)."""
        if self.echo:
            raise invalid("echo is not supported")
        if self.suffix:
            raise invalid("suffix is not supported")
        requests = []
        for request_id, prompt in zip(request_ids, self.prompts(), strict=True):
            request = generation_pb2.GenerateRequest(request_id=request_id, model=self.model, priority=self.priority)
            if isinstance(prompt, str):
                request.text = prompt
            else:
                request.token_ids.SetInParent()  # Set even when empty: Generation says what is wrong.
                request.token_ids.ids.extend(prompt)
            requests.append(request)
        return requests

    def sampling(self) -> tuple[SamplingParams, int]:
        return self._sampling(self.max_tokens, self.logprobs)
