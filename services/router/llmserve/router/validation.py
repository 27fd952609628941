"""Checks a request (its sampling settings as SamplingParams, whichever front door it came
through) and resolves the sampling defaults.

User input gets a real error with a gRPC status code (never an `assert`, which
vanishes under `python -O`); the router turns `RequestError` into the call's status.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, replace

import grpc
from google.protobuf.unknown_fields import UnknownFieldSet

from llmserve.contract.sampling import STRUCTURED_OUTPUT_KINDS, SamplingParams
from llmserve.contract.structured_output import can_compile, check_structured_output

MAX_LOGPROBS = 20
MAX_N = 64
MAX_LOGIT_BIAS = 1024  # Entries of one request's logit_bias.
MAX_STRUCTURED_SPEC_BYTES = 256 * 1024  # A structured output's schema, regex or grammar.
# Error details travel in a trailer: a message echoing a huge client string would exceed
# the client's metadata limit and reach it as a transport error instead.
MAX_ERROR_CHARS = 1024


def shown(text: str, limit: int = 80) -> str:
    """A client's string for an error message: quoted, and cut short if long."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


class RequestError(Exception):
    """`param`: the request field it is about, where one is (the OpenAI error body's)."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None):
        if len(message) > MAX_ERROR_CHARS:
            message = message[:MAX_ERROR_CHARS] + "..."
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


def invalid(message: str, param: str | None = None) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message, param)


def check_known_fields(msg, path: str = "") -> None:
    """Refuses a message carrying fields this server's API version does not know (a newer
    client's): protobuf keeps them as unknown fields, which nothing here would read, so
    the request would run as if they were not there. `path`: where msg is, for the error."""
    unknown = UnknownFieldSet(msg)
    if len(unknown):
        numbers = sorted({field.field_number for field in unknown})
        raise invalid(f"{path or msg.DESCRIPTOR.name} has field number(s) {numbers} of {msg.DESCRIPTOR.full_name} "
                      f"that this server does not know (a newer API version's?): it cannot honour them")
    for field, value in msg.ListFields():
        if field.message_type is None or field.message_type.GetOptions().map_entry:
            continue
        name = f"{path}.{field.name}" if path else field.name
        if field.is_repeated:
            for i, item in enumerate(value):
                check_known_fields(item, f"{name}[{i}]")
        else:
            check_known_fields(value, name)


@dataclass(frozen=True)
class ServedModel:
    """The limits a request is checked against (from the scheduler's serving info)."""

    name: str
    max_model_len: int
    vocab_size: int
    max_prompt_bytes: int  # See limits.prompt_byte_limit.


def check_model_name(requested: str, served: ServedModel) -> None:
    if requested and requested != served.name:
        raise RequestError(
            grpc.StatusCode.NOT_FOUND,
            f"model {shown(requested)} is not served here; this router serves {served.name!r}",
        )


def check_token_ids(token_ids: list[int], served: ServedModel) -> None:
    for token_id in token_ids:
        if not 0 <= token_id < served.vocab_size:
            raise invalid(f"token id {token_id} is outside the vocabulary [0, {served.vocab_size})")


def check_sampling(sampling: SamplingParams, n: int) -> None:
    """Checks the settings that do not depend on the prompt, as a client gave them
    (wire.sampling_from_public_pb, or the OpenAI body's conversion: max_tokens None when
    unset, top_k as sent)."""
    temperature = sampling.temperature
    if not temperature >= 0 or math.isinf(temperature):  # `not >=` also catches NaN.
        raise invalid(f"temperature must be a finite number >= 0, got {temperature}")
    if not 0 < sampling.top_p <= 1:
        raise invalid(f"top_p must be in (0, 1], got {sampling.top_p}")
    if sampling.top_k < -1:
        raise invalid(f"top_k must be -1 or 0 (off) or a positive number, got {sampling.top_k}")
    if not 1 <= n <= MAX_N:
        raise invalid(f"n must be between 1 and {MAX_N}, got {n}")
    if sampling.logprobs is not None and not 0 <= sampling.logprobs <= MAX_LOGPROBS:
        raise invalid(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {sampling.logprobs}")
    if sampling.prompt_logprobs is not None and not 0 <= sampling.prompt_logprobs <= MAX_LOGPROBS:
        raise invalid(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {sampling.prompt_logprobs}")
    if any(s == "" for s in sampling.stop):
        raise invalid("stop strings must not be empty")
    if sampling.max_tokens is not None and sampling.max_tokens < 1:
        raise invalid(f"max_tokens must be at least 1, got {sampling.max_tokens}")
    _check_sampling_extras(sampling)


def _check_sampling_extras(sampling: SamplingParams) -> None:
    """Penalties, min_p, logit_bias's values and min_tokens (logit_bias's ids are checked
    against the vocabulary by resolve_sampling)."""
    if not sampling.repetition_penalty > 0 or math.isinf(sampling.repetition_penalty):
        raise invalid(f"repetition_penalty must be a finite number > 0, got {sampling.repetition_penalty}")
    for name in ("frequency_penalty", "presence_penalty"):
        if not -2 <= getattr(sampling, name) <= 2:
            raise invalid(f"{name} must be in [-2, 2], got {getattr(sampling, name)}")
    if not 0 <= sampling.min_p <= 1:
        raise invalid(f"min_p must be in [0, 1], got {sampling.min_p}")
    if len(sampling.logit_bias) > MAX_LOGIT_BIAS:
        raise invalid(f"logit_bias has {len(sampling.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
    for token_id, bias in sampling.logit_bias:
        if not -100 <= bias <= 100:
            raise invalid(f"logit_bias of token {token_id} must be in [-100, 100], got {bias}")
    if sampling.min_tokens < 0:
        raise invalid(f"min_tokens must be >= 0, got {sampling.min_tokens}")
    if sampling.max_tokens is not None and sampling.min_tokens > sampling.max_tokens:
        raise invalid(f"min_tokens ({sampling.min_tokens}) must not exceed max_tokens ({sampling.max_tokens})")
    so = sampling.structured_output
    if so is not None:
        if so.kind not in STRUCTURED_OUTPUT_KINDS:
            raise invalid(f"structured_output.kind must be one of {', '.join(STRUCTURED_OUTPUT_KINDS)}")
        if len(so.spec.encode()) > MAX_STRUCTURED_SPEC_BYTES:
            raise invalid(f"structured_output.spec has {len(so.spec.encode())} bytes; at most "
                          f"{MAX_STRUCTURED_SPEC_BYTES}")


async def check_grammar(sampling: SamplingParams) -> None:
    """A structured output that cannot be compiled is the client's error, found before
    anything is queued: parsed off the event loop, once per (kind, spec) (cached)."""
    so = sampling.structured_output
    if so is None or not can_compile():  # (a router without the worker's xgrammar: see can_compile)
        return
    problem = await asyncio.to_thread(check_structured_output, so)
    if problem is not None:
        raise invalid(f"structured output ({so.kind}) cannot be compiled: {problem[:600]}")


def check_prompt_tokens(prompt_len: int, served: ServedModel) -> None:
    if prompt_len >= served.max_model_len:
        raise invalid(
            f"the prompt has {prompt_len} tokens; max_model_len is {served.max_model_len}, "
            f"which leaves no room to generate"
        )


def resolve_sampling(sampling: SamplingParams, prompt_len: int, served: ServedModel) -> SamplingParams:
    """What the scheduler gets, once check_sampling passed: the prompt's length checked
    against max_model_len, max_tokens filled in (unset: all the room left), top_k -1 as 0."""
    if prompt_len == 0:
        raise invalid("the prompt is empty")
    check_prompt_tokens(prompt_len, served)
    room = served.max_model_len - prompt_len
    max_tokens = sampling.max_tokens
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise invalid(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {prompt_len + max_tokens} "
            f"exceeds max_model_len {served.max_model_len}"
        )
    check_token_ids(list(sampling.stop_token_ids), served)
    try:
        check_token_ids([token_id for token_id, _ in sampling.logit_bias], served)
    except RequestError as err:
        raise invalid(f"logit_bias: {err.message}") from None
    if sampling.min_tokens > max_tokens:
        raise invalid(f"min_tokens ({sampling.min_tokens}) exceeds the {max_tokens} tokens the prompt leaves "
                      f"room for (max_model_len {served.max_model_len})")
    return replace(sampling, max_tokens=max_tokens, top_k=max(sampling.top_k, 0))
