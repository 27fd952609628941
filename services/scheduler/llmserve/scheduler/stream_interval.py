"""Streaming every N tokens instead of every token (`--stream-interval`, as in SGLang
and vLLM).

Each step's outputs cost a message to the router and one per sample to its client,
and on a small host that control-plane CPU competes with the worker's compute
threads. With an interval of N, a sample's tokens are held here until N have gathered.
Its first token is never held (time to first token is unchanged), and neither is its
end (finish, abort or error), which carries whatever was held with it.

    step:     1    2    3    4    5    6    7    8 (finish)
    sent:    [a]            [b c d e]           [f g h]      (N = 4)

The cost: the router sees a stop *string* up to N - 1 steps late, so the engine may
compute up to N - 1 tokens that are then dropped (the client's text and tokens are
the same either way; the router cuts them at the stop string).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from llmserve.contract.outputs import RequestOutput, TokenLogprobs


@dataclass
class _Held:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)


class OutputCoalescer:
    """Per sample (request id, index): what has been produced but not yet sent."""

    def __init__(self, interval: int = 1):
        if interval < 1:
            raise ValueError(f"stream interval must be at least 1, got {interval}")
        self.interval = interval
        # request id -> sample index -> held tokens. A sample is present once its first
        # token has been sent, until it ends.
        self._held: dict[str, dict[int, _Held]] = {}

    def push(self, out: RequestOutput) -> RequestOutput | None:
        """The output to send now (with any held tokens before its own), or None to hold it."""
        if self.interval == 1:
            return out
        samples = self._held.setdefault(out.request_id, {})
        held = samples.get(out.index)
        if out.finished:
            samples.pop(out.index, None)
            if not samples:
                del self._held[out.request_id]
            if held is None:
                return out
            return replace(out, new_token_ids=held.token_ids + out.new_token_ids, logprobs=held.logprobs + out.logprobs)
        if held is None:  # The sample's first token: sent at once.
            samples[out.index] = _Held()
            return out
        held.token_ids += out.new_token_ids
        held.logprobs += out.logprobs
        if len(held.token_ids) < self.interval:
            return None
        samples[out.index] = _Held()
        return replace(out, new_token_ids=held.token_ids, logprobs=held.logprobs)

    def forget(self, request_id: str) -> None:
        """Drops whatever is held for a request that has ended."""
        self._held.pop(request_id, None)

    def __len__(self) -> int:
        """Requests with a sample in flight (for tests: nothing may outlive its request)."""
        return len(self._held)

