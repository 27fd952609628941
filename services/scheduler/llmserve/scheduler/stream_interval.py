"""Streaming every N tokens instead of every token (`--stream-interval`, as in SGLang
and vLLM).

Each step's outputs cost a message to the router and one per sample to its client,
and on a small host that control-plane CPU competes with the worker's compute
threads. With an interval of N, a sample's tokens are held back (on its request's
record) until N have gathered. Its first token is never held (time to first token is
unchanged), and neither is its end (finish, abort or error), which carries whatever was
held with it.

    step:     1    2    3    4    5    6    7    8 (finish)
    sent:    [a]            [b c d e]           [f g h]      (N = 4)

The cost: the router sees a stop *string* up to N - 1 steps late, so the engine may
compute up to N - 1 tokens that are then dropped (the client's text and tokens are
the same either way; the router cuts them at the stop string).
"""

from __future__ import annotations

from dataclasses import replace

from llmserve.contract.outputs import RequestOutput
from llmserve.scheduler.request import HeldTokens, StreamState


class OutputCoalescer:
    """Decides per sample what to send now; what it holds back lives on the request's
    record (`Request.stream.held`), so it ends with the request."""

    def __init__(self, interval: int = 1):
        """Send each sample's tokens every `interval` (1: every output as it comes)."""
        if interval < 1:
            raise ValueError(f"stream interval must be at least 1, got {interval}")
        self.interval = interval

    def push(self, out: RequestOutput, stream: StreamState) -> RequestOutput | None:
        """The output to send now (with any held tokens before its own), or None to hold
        it. `stream` is the state of the request `out` belongs to."""
        if self.interval == 1:
            return out
        held = stream.held.get(out.index)
        if out.finished:
            return self._release(out, stream)
        if held is None:  # The sample's first token: sent at once.
            stream.held[out.index] = HeldTokens()
            return out
        held.token_ids += out.new_token_ids
        held.logprobs += out.logprobs
        if len(held.token_ids) < self.interval:
            return None
        stream.held[out.index] = HeldTokens()
        return replace(out, new_token_ids=held.token_ids, logprobs=held.logprobs)

    @staticmethod
    def _release(out: RequestOutput, stream: StreamState) -> RequestOutput:
        """A sample's end: whatever it held goes out with it."""
        held = stream.held.pop(out.index, None)
        if held is None:
            return out
        return replace(out, new_token_ids=held.token_ids + out.new_token_ids, logprobs=held.logprobs + out.logprobs)

    @staticmethod
    def forget(stream: StreamState) -> None:
        """Drops whatever is held for a request that has ended."""
        stream.held.clear()
