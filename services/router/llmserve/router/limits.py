"""Bounds on the work one public request can ask of the router, checked before that work
starts: before tokenizing, rendering a chat template or copying a repeated field.

    what                                          status               where
    a message over --max-request-bytes            RESOURCE_EXHAUSTED   gRPC, while reading it
    request_id over 256 bytes                     INVALID_ARGUMENT     here
    text, or chat roles + contents, over
      --max-prompt-bytes (UTF-8)                  INVALID_ARGUMENT     here
    more chat messages than max_model_len         INVALID_ARGUMENT     here
    max_model_len token_ids or more               INVALID_ARGUMENT     here
    over 16 stop strings, one over 256 chars      INVALID_ARGUMENT     here
    over 256 stop_token_ids                       INVALID_ARGUMENT     here
    cache_salt over 1,024 bytes                   INVALID_ARGUMENT     here
    a prompt of max_model_len tokens or more      INVALID_ARGUMENT     validation, after tokenizing

Each error names the limit it hit.
"""

from __future__ import annotations

from llmserve.router.validation import ServedModel, check_prompt_tokens, invalid

MAX_REQUEST_ID_BYTES = 256
# The stop-string matcher checks the held-back text against every stop string for each
# token (count x length work per token); real stop lists are a few short strings.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
# The engine tests every sampled token against this list.
MAX_STOP_TOKEN_IDS = 256
# Bad words: each is tokenized twice by the router and matched every step by the sampler.
MAX_BAD_WORDS = 128
MAX_BAD_WORD_BYTES = 256
# Hashed once per request (its first block's parent key); a 256-bit secret is 44 base64 chars.
MAX_CACHE_SALT_BYTES = 1024


def prompt_byte_limit(configured: int | None, max_model_len: int, longest_token_bytes: int) -> int:
    """--max-prompt-bytes, or by default the most bytes a prompt that fits max_model_len can
    have: a longer one is sure to be refused after tokenizing, so it is refused before."""
    return configured if configured is not None else max_model_len * longest_token_bytes


def check_request_id(request_id: str) -> None:
    size = len(request_id.encode("utf-8"))
    if size > MAX_REQUEST_ID_BYTES:
        raise invalid(f"request_id is {size} bytes; the limit is {MAX_REQUEST_ID_BYTES}")


def check_cache_salt(salt: str) -> None:
    size = len(salt.encode("utf-8"))
    if size > MAX_CACHE_SALT_BYTES:
        raise invalid(f"cache_salt is {size} bytes; the limit is {MAX_CACHE_SALT_BYTES}", param="cache_salt")


def check_prompt_size(request, served: ServedModel) -> None:
    """The input of a GenerateRequest or TokenizeRequest, sized without tokenizing it."""
    kind = request.WhichOneof("input")
    if kind == "text":
        _check_bytes("the prompt", len(request.text.encode("utf-8")), served)
    elif kind == "messages":
        messages = request.messages.messages
        if len(messages) > served.max_model_len:
            # Every turn renders to at least one token, so more turns than max_model_len never fit.
            raise invalid(f"{len(messages)} chat messages; at most max_model_len ({served.max_model_len}) can fit")
        size = sum(len(m.role.encode("utf-8")) + len(m.content.encode("utf-8")) for m in messages)
        _check_bytes("the chat messages (roles and contents)", size, served)
    elif kind == "token_ids":
        check_prompt_tokens(len(request.token_ids.ids), served)


def check_stop_sizes(params) -> None:
    """Stop strings, stop token ids and bad words: bounded work per generated token."""
    if len(params.stop) > MAX_STOP_STRINGS:
        raise invalid(f"{len(params.stop)} stop strings; the limit is {MAX_STOP_STRINGS}")
    longest = max((len(s) for s in params.stop), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise invalid(f"a stop string is {longest} characters; the limit is {MAX_STOP_STRING_CHARS}")
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise invalid(f"{len(params.stop_token_ids)} stop_token_ids; the limit is {MAX_STOP_TOKEN_IDS}")
    if len(params.bad_words) > MAX_BAD_WORDS:
        raise invalid(f"{len(params.bad_words)} bad_words; the limit is {MAX_BAD_WORDS}")
    if any(not word.strip() for word in params.bad_words):
        raise invalid("bad_words must not be empty or only spaces")
    longest = max((len(w.encode()) for w in params.bad_words), default=0)
    if longest > MAX_BAD_WORD_BYTES:
        raise invalid(f"a bad word is {longest} bytes; the limit is {MAX_BAD_WORD_BYTES}")


def _check_bytes(what: str, size: int, served: ServedModel) -> None:
    if size > served.max_prompt_bytes:
        raise invalid(f"{what} is {size} bytes; the limit is {served.max_prompt_bytes} bytes (--max-prompt-bytes)")
