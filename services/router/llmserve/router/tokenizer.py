"""The router's view of the model's tokenizer: text and chat in, token ids out.

Wraps an HF ``AutoTokenizer`` loaded from a local model directory (never the network)
and adds what the tokenizer alone does not know: the model's config vocab size and the
eos ids from ``config.json`` / ``generation_config.json``.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from llmserve.contract.startup_errors import StartupError

# Variables apply_chat_template gives every template itself: chat_template_kwargs cannot set them.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                                         "bos_token", "eos_token", "unk_token", "pad_token"})

# A chat: ``[("user", "Hi")]`` or ``[{"role": "user", "content": "Hi"}]``.
Messages = Sequence[tuple[str, str]] | Sequence[Mapping[str, Any]]


def normalize_messages(messages: Messages) -> list[dict[str, Any]]:
    """Turn (role, content) pairs or role/content mappings into the dicts templates expect."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if isinstance(message, Mapping):
            if "role" not in message or "content" not in message:
                raise ValueError(f"message {i} needs 'role' and 'content'")
            out.append(dict(message))
        elif isinstance(message, (tuple, list)) and len(message) == 2:
            role, content = message
            out.append({"role": str(role), "content": str(content)})
        else:
            raise ValueError(f"message {i} is neither (role, content) nor a mapping")
    if not out:
        raise ValueError("a chat needs at least one message")
    return out


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _as_id_list(value: Any) -> list[int]:
    """``eos_token_id`` may be absent, an int or a list of ints."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value if v is not None]


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids that ``decode(skip_special_tokens=True)`` drops.

    NOTE: in transformers 5 ``all_special_ids`` lists only the named special tokens
    (bos/eos/unk/pad); SmolLM2's other added special tokens (<repo_name>, ...) are
    found through ``added_tokens_decoder``.
    """
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", ()) or ()}
    for token_id, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(token, "special", False):
            ids.add(int(token_id))
    return frozenset(ids)


class PromptTokenizer:
    """Encodes prompts and chats for one model; decodes ids back to text."""

    def __init__(self, tokenizer: Any, *, name: str, config: Mapping[str, Any] | None = None,
                 generation_config: Mapping[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.name = name
        config = dict(config or {})
        generation_config = dict(generation_config or {})
        # NOTE: config.json's vocab_size is the embedding/logits width, the bound every
        # token id must respect; len(tokenizer) counts base vocab + added tokens and may
        # be smaller (padded embeddings) or, for broken checkpoints, larger.
        self.tokenizer_vocab_size: int = len(tokenizer)
        self.model_vocab_size: int = int(config.get("vocab_size") or self.tokenizer_vocab_size)
        eos: set[int] = set(_as_id_list(getattr(tokenizer, "eos_token_id", None)))
        eos.update(_as_id_list(config.get("eos_token_id")))
        eos.update(_as_id_list(generation_config.get("eos_token_id")))
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(eos))
        bos = getattr(tokenizer, "bos_token_id", None)
        if bos is None:
            bos = generation_config.get("bos_token_id", config.get("bos_token_id"))
        self.bos_token_id: int | None = None if bos is None else int(bos)
        self.special_token_ids: frozenset[int] = special_token_ids(tokenizer)

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike[str]) -> "PromptTokenizer":
        """Load the tokenizer and the config files of an HF model directory, offline."""
        from transformers import AutoTokenizer

        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"{path} is not a model directory")
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as err:
            # HF's own message lists conversion libraries; the usual cause is a directory
            # without tokenizer.json (weights copied alone).
            found = ", ".join(sorted(p.name for p in path.glob("tokenizer*"))) or "no tokenizer files"
            raise StartupError(f"cannot load a tokenizer from {path} ({found})",
                               "the router needs the model's tokenizer.json (or tokenizer.model) and "
                               "tokenizer_config.json beside config.json") from err
        return cls(
            tokenizer,
            name=path.name,
            config=_read_json(path / "config.json"),
            generation_config=_read_json(path / "generation_config.json"),
        )

    @property
    def vocab_size(self) -> int:
        """Token ids are valid below this (the model's logits width, from config.json)."""
        return self.model_vocab_size

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return self._check_ids(list(ids))

    def bad_words_token_ids(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """Each word's token ids as it reads at the start of a text and after a space (as
        vLLM tokenizes bad words: most tokenizers spell a word differently after a space),
        without special tokens; each distinct sequence once, in order."""
        sequences = (tuple(self.encode_text(prefix + word.lstrip(), add_special_tokens=False))
                     for word in words for prefix in ("", " "))
        return tuple(dict.fromkeys(seq for seq in sequences if seq))

    def render_chat(self, messages: Messages, template_kwargs: Mapping[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text of a chat, with the assistant's generation prompt appended;
        `template_kwargs`: variables for the template (e.g. ``enable_thinking``);
        `tools`: the functions the model may call, in OpenAI's shape (the template's `tools`)."""
        if not self.has_chat_template:
            raise ValueError(f"model {self.name} has no chat template")
        kwargs = dict(template_kwargs or {})
        reserved = sorted(set(kwargs) & self._reserved_template_names())
        if reserved:
            raise ValueError(f"chat_template_kwargs: {', '.join(reserved)} cannot be set (the template's own "
                             f"arguments)")
        return self.tokenizer.apply_chat_template(
            normalize_messages(messages), tools=tools, tokenize=False, add_generation_prompt=True, **kwargs
        )

    def _reserved_template_names(self) -> frozenset[str]:
        """apply_chat_template's own parameters (`chat_template` would swap the template,
        `tokenize` the return type) and what it passes the template itself."""
        params = inspect.signature(self.tokenizer.apply_chat_template).parameters
        named = {name for name, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        return frozenset(named | RESERVED_TEMPLATE_VARIABLES)

    def encode_chat(self, messages: Messages, template_kwargs: Mapping[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
        """(rendered prompt, its ids).

        NOTE: chat templates write their own special tokens (SmolLM2's emits
        ``<|im_start|>`` itself), so the rendered text is encoded without adding
        special tokens again, as ``apply_chat_template(tokenize=True)`` does.
        """
        prompt = self.render_chat(messages, template_kwargs, tools)
        return prompt, self.encode_text(prompt, add_special_tokens=False)

    def longest_token_bytes(self) -> int:
        """The most UTF-8 bytes of input one token can stand for (SmolLM2: 82, a newline
        and 80 spaces, +1), so a prompt of N tokens has at most N times this many bytes
        (for tokenizers whose normalizer deletes no characters: Llama, Qwen2, Gemma).
        Decodes the whole vocabulary once (~0.4 s for 49k tokens): call it off the event
        loop."""
        ids = [[i] for i in range(self.tokenizer_vocab_size)]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        # +1: a SentencePiece decoder drops a lone token's leading space ("▁Hi" -> "Hi").
        return max((len(text.encode("utf-8")) for text in texts), default=0) + 1

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _check_ids(self, ids: list[int]) -> list[int]:
        bad = [i for i in ids if not 0 <= i < self.model_vocab_size]
        if bad:
            raise ValueError(
                f"model {self.name}: tokenizer produced ids {bad[:5]} outside the model "
                f"vocabulary of {self.model_vocab_size}"
            )
        return ids
