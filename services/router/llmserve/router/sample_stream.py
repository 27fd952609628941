"""Turns one sample's token outputs into streamed text: incremental detokenization,
then stop strings (which the engine cannot see: it stops on token ids only), then, for
a reasoning model's chat, the split of that text into reasoning and answer, and for a
chat with tools, the answer's tool calls."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from llmserve.contract.outputs import FinishReason, RequestOutput, TokenLogprobs
from llmserve.router.detokenizer import IncrementalDetokenizer, StreamDetokenizer
from llmserve.router.reasoning import ReasoningSplitter
from llmserve.router.stop_strings import StopStringMatcher
from llmserve.router.tool_parsers import ToolCallDelta, ToolCallParser


@dataclass
class SampleDelta:
    """What one sample adds to the client's stream: text, tokens, and how it ended."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: FinishReason
    stop_reason: str = ""
    error: str = ""
    reasoning_text: str = ""  # With --reasoning-parser: the reasoning part (`text`: the answer).
    tool_calls: list[ToolCallDelta] = field(default_factory=list)  # Pieces of the answer's tool calls.
    # With prompt_logprobs, in the sample's first delta only: the prompt's ids, and the
    # logprobs of its tokens 1.. (each given the tokens before it).
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)

    def absorb(self, later: SampleDelta) -> None:
        """Appends what `later` (this sample's next delta) adds, so that this one delta says
        what the two said: a consumer that fell behind gets one message, not one per token.
        How it ends (finish reason, stop reason, error) is `later`'s."""
        self.text += later.text
        self.reasoning_text += later.reasoning_text
        self.token_ids += later.token_ids
        self.logprobs += later.logprobs
        self.prompt_token_ids += later.prompt_token_ids
        self.prompt_logprobs += later.prompt_logprobs
        for call in later.tool_calls:
            last = self.tool_calls[-1] if self.tool_calls else None
            if last is not None and last.index == call.index and not (call.id or call.name):
                # More arguments of the call in progress: one piece, as a client accumulates them.
                self.tool_calls[-1] = replace(last, arguments=last.arguments + call.arguments)
            else:
                self.tool_calls.append(call)
        self.finish_reason, self.stop_reason = later.finish_reason, later.stop_reason
        self.error = later.error or self.error


@dataclass
class SampleStream:
    """One sample's text so far: its detokenizer and stop strings, and its counts."""

    index: int
    detokenizer: StreamDetokenizer | IncrementalDetokenizer
    stop_matcher: StopStringMatcher
    min_tokens: int = 0  # A stop string counts only where it ends in a later token's text.
    num_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: FinishReason = FinishReason.NONE
    stop_reason: str = ""
    token_text: dict = field(default_factory=dict)
    reasoning: ReasoningSplitter | None = None  # Splits the text (stop strings apply to all of it).
    tool_calls: ToolCallParser | None = None  # Finds calls in the answer (after the reasoning's split).
    # With prompt_logprobs: the prompt's ids, which the first delta carries (then cleared).
    prompt_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason != FinishReason.NONE

    def process(self, out: RequestOutput, decode_token) -> SampleDelta:
        """Consumes one engine output (one token, or several with a stream interval);
        `decode_token(id)` names a stop token id."""
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        # Token by token, so a stop string that ends inside a multi-token output cuts
        # the tokens after it too: the result does not depend on how outputs were grouped.
        emit, matched, kept = "", None, 0
        for token_id in out.new_token_ids:
            kept += 1
            can_stop = self.num_tokens + kept > self.min_tokens
            text, matched = self.stop_matcher.feed(self.detokenizer.push([token_id]), can_stop)
            emit += text
            if matched is not None:
                break
        if matched is None and out.finished:
            text, matched = self.stop_matcher.feed(self.detokenizer.flush(), self.num_tokens + kept > self.min_tokens)
            emit += text
        self.num_tokens += kept
        finish, stop_reason = out.finish_reason, ""
        if matched is not None:
            finish, stop_reason = FinishReason.STOP, matched
        elif out.finished:
            emit += self.stop_matcher.flush()
            if out.stop_token_id >= 0:
                stop_reason = decode_token(out.stop_token_id)
        self.finish_reason, self.stop_reason = finish, stop_reason
        reasoning, calls = "", []
        if self.reasoning is not None:
            reasoning, emit = self.reasoning.feed(emit, final=finish != FinishReason.NONE)
        if self.tool_calls is not None:
            emit, calls = self.tool_calls.feed(emit, final=finish != FinishReason.NONE)
            if finish == FinishReason.STOP and self.tool_calls.called:
                finish = self.finish_reason = FinishReason.TOOL_CALLS
        prompt_ids, self.prompt_token_ids = self.prompt_token_ids, []
        return SampleDelta(
            index=self.index,
            prompt_token_ids=prompt_ids,
            prompt_logprobs=list(out.prompt_logprobs),
            text=emit,
            reasoning_text=reasoning,
            tool_calls=calls,
            token_ids=list(out.new_token_ids[:kept]),
            logprobs=list(out.logprobs[:kept]),
            finish_reason=finish,
            stop_reason=stop_reason,
            error=out.error,
        )
