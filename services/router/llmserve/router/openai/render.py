"""`Generation`'s outputs as OpenAI response bodies: chat.completion(.chunk) and
text_completion objects, their logprobs and usage (plain dicts, serialized once)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from llmserve.contract.outputs import FinishReason, TokenLogprobs
from llmserve.router.sample_stream import SampleDelta
from llmserve.router.tool_parsers import ToolCallDelta
from llmserve.router.usage import Usage

FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort",
                  FinishReason.TOOL_CALLS: "tool_calls"}


def finish_reason(delta: SampleDelta) -> str | None:
    return FINISH_REASONS.get(delta.finish_reason)


def _token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _message(text: str, reasoning: str, first: bool, tool_calls: list[dict] | None = None) -> dict:
    """A chat message or delta: `reasoning_content` (--reasoning-parser) and `tool_calls`
    only when there are some, and then `content` only when there is some too."""
    message: dict = {"role": "assistant"} if first else {}
    if reasoning:
        message["reasoning_content"] = reasoning
    if text or not (reasoning or tool_calls):
        message["content"] = text
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def _call_delta(call: ToolCallDelta) -> dict:
    """A streamed piece of a call: the first names it (id, type, name), later ones only
    add to its arguments."""
    if not call.id:
        return {"index": call.index, "function": {"arguments": call.arguments}}
    return {"index": call.index, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def _calls(pieces: list[ToolCallDelta]) -> list[dict]:
    """A whole reply's calls from their pieces, in index order."""
    calls: dict[int, dict] = {}
    for piece in pieces:
        if piece.id:
            calls[piece.index] = {"id": piece.id, "type": "function",
                                  "function": {"name": piece.name, "arguments": piece.arguments}}
        else:
            calls[piece.index]["function"]["arguments"] += piece.arguments
    return [calls[i] for i in sorted(calls)]


@dataclass
class Renderer:
    """Renders one HTTP request's outputs; `token_text(id)` names a token. Choice
    `index` = prompt index x n + sample index (a completions batch has several prompts)."""

    chat: bool
    model: str
    response_id: str
    n: int
    token_text: Callable[[int], str]
    # Completions' `echo`: the text of prompt i, put before its choices' text (None: no echo).
    prompt_text: Callable[[int], str] | None = None
    # prompt_logprobs (vLLM's extension): the top entries shown per prompt token (None: none asked).
    prompt_logprobs: int | None = None
    # Completions' echo with logprobs: the top entries per prompt token (None: no echo logprobs).
    echo_logprobs: int | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    _offsets: dict[int, int] = field(default_factory=dict)  # Completions' text_offset, per choice.

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def choice_index(self, prompt_index: int, delta: SampleDelta) -> int:
        return prompt_index * self.n + delta.index

    def logprobs(self, index: int, logprobs: list[TokenLogprobs]) -> dict:
        if self.chat:
            return {"content": [dict(_token(self.token_text(lp.token_id), lp.logprob), top_logprobs=[
                _token(self.token_text(t), v) for t, v in zip(lp.top_token_ids, lp.top_logprobs)])
                for lp in logprobs]}
        tokens = [self.token_text(lp.token_id) for lp in logprobs]
        offsets, at = [], self._offsets.get(index, 0)
        for text in tokens:
            offsets.append(at)
            at += len(text)
        self._offsets[index] = at
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [{self.token_text(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs)}
                                 for lp in logprobs],
                "text_offset": offsets}

    def _echo_logprobs(self, index: int, delta: SampleDelta) -> dict:
        """Completions' echo with logprobs: the prompt's tokens (the first without a
        logprob, as OpenAI's), before the completion's (text_offset goes on from them)."""
        k = self.echo_logprobs
        entries: list[TokenLogprobs | None] = [None, *delta.prompt_logprobs]
        tokens = [self.token_text(t) for t in delta.prompt_token_ids]
        offsets, at = [], self._offsets.get(index, 0)
        for text in tokens:
            offsets.append(at)
            at += len(text)
        self._offsets[index] = at
        return {"tokens": tokens, "token_logprobs": [None if lp is None else lp.logprob for lp in entries],
                "top_logprobs": [None if lp is None else {self.token_text(t): v for t, v in zip(
                    lp.top_token_ids[:k], lp.top_logprobs[:k])} for lp in entries],
                "text_offset": offsets}

    def _choice_logprobs(self, index: int, delta: SampleDelta, logprobs: list[TokenLogprobs]) -> dict:
        """A choice's logprobs object: with echo (completions) the prompt's part first;
        `delta`: the choice's first delta (the one carrying the prompt's)."""
        if self.echo_logprobs is None or not delta.prompt_token_ids:
            return self.logprobs(index, logprobs)
        echoed = self._echo_logprobs(index, delta)
        return {key: echoed[key] + value for key, value in self.logprobs(index, logprobs).items()}

    def _prompt_logprobs(self, delta: SampleDelta) -> list[dict | None]:
        """vLLM's prompt_logprobs: None for the first token, then for each token {id:
        {logprob, rank, decoded_token}} of the token itself and of the k most likely."""
        k = self.prompt_logprobs
        out: list[dict | None] = [None]
        for lp in delta.prompt_logprobs:
            entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank,
                                        "decoded_token": self.token_text(lp.token_id)}}
            for rank, (t, v) in enumerate(zip(lp.top_token_ids[:k], lp.top_logprobs[:k]), 1):
                entry.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": self.token_text(t)})
            out.append(entry)
        return out

    def _echo(self, prompt_index: int, first: bool) -> str:
        """What comes before a choice's first text: its prompt's, with `echo`."""
        return self.prompt_text(prompt_index) if first and self.prompt_text is not None else ""

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def chunk(self, prompt_index: int, delta: SampleDelta, first: bool, with_logprobs: bool) -> dict:
        """A streamed chunk of one choice (`first`: its first chunk, which names the role)."""
        index = self.choice_index(prompt_index, delta)
        choice: dict = {"index": index, "finish_reason": finish_reason(delta)}
        if self.chat:
            choice["delta"] = _message(delta.text, delta.reasoning_text, first,
                                       [_call_delta(call) for call in delta.tool_calls])
        else:
            choice["text"] = self._echo(prompt_index, first) + delta.text
        choice["logprobs"] = self._choice_logprobs(index, delta, delta.logprobs) \
            if with_logprobs and (delta.logprobs or delta.prompt_token_ids) else None
        if self.prompt_logprobs is not None and delta.prompt_token_ids:
            choice["prompt_logprobs"] = self._prompt_logprobs(delta)
        return self._envelope(self.object + (".chunk" if self.chat else ""), [choice])

    def chunks(self, prompt_index: int, delta: SampleDelta, first: bool, with_logprobs: bool) -> list[dict]:
        """`chunk`, except that a delta with both reasoning and an answer (text or tool
        calls) is two chunks, the reasoning first (its tokens' logprobs go with the answer's)."""
        if not (self.chat and delta.reasoning_text and (delta.text or delta.tool_calls)):
            return [self.chunk(prompt_index, delta, first, with_logprobs)]
        reasoning = replace(delta, text="", tool_calls=[], logprobs=[], finish_reason=FinishReason.NONE)
        return [self.chunk(prompt_index, reasoning, first, False),
                self.chunk(prompt_index, replace(delta, reasoning_text="", prompt_token_ids=[], prompt_logprobs=[]),
                           False, with_logprobs)]

    def usage_chunk(self, usages: list[Usage]) -> dict:
        """stream_options.include_usage: the last chunk, no choices."""
        envelope = self._envelope(self.object + (".chunk" if self.chat else ""), [])
        return dict(envelope, usage=Usage.summed(usages).to_openai())

    def completion(self, deltas: dict[int, list[SampleDelta]], usages: list[Usage], with_logprobs: bool) -> dict:
        """A whole (non-streamed) response from each choice's deltas, in order."""
        choices = []
        for index in sorted(deltas):
            parts = deltas[index]
            text = "".join(d.text for d in parts)
            reasoning = "".join(d.reasoning_text for d in parts)
            logprobs = [lp for d in parts for lp in d.logprobs]
            choice: dict = {"index": index, "finish_reason": finish_reason(parts[-1]),
                            "logprobs": self._choice_logprobs(index, parts[0], logprobs) if with_logprobs else None}
            if self.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self._prompt_logprobs(parts[0])
            if self.chat:
                calls = _calls([call for d in parts for call in d.tool_calls])
                choice["message"] = {"content": None, **_message(text, reasoning, True, calls)}
            else:
                choice["text"] = self._echo(index // self.n, True) + text
            choices.append(choice)
        return dict(self._envelope(self.object, choices), usage=Usage.summed(usages).to_openai())
