"""--stream-interval: a sample's tokens are sent N at a time, its first and last at once."""

from __future__ import annotations

import pytest

from llmserve.contract.outputs import FinishReason, RequestOutput, TokenLogprobs
from llmserve.scheduler.request import StreamState
from llmserve.scheduler.stream_interval import OutputCoalescer


class Streams(dict):
    """Each request's stream state by id, as the service keeps it on the request's record."""

    def __missing__(self, request_id: str) -> StreamState:
        self[request_id] = StreamState()
        return self[request_id]

    def in_flight(self) -> int:
        """Requests with a sample in flight (nothing may outlive its request)."""
        return sum(1 for stream in self.values() if stream.held)


def token(request_id: str, token_id: int, index: int = 0, finish=FinishReason.NONE) -> RequestOutput:
    return RequestOutput(request_id, index=index, new_token_ids=[token_id],
                         logprobs=[TokenLogprobs(token_id, -0.1 * token_id)], finish_reason=finish)


def run(coalescer: OutputCoalescer, streams: Streams, outputs: list[RequestOutput]) -> list[RequestOutput]:
    return [sent for out in outputs if (sent := coalescer.push(out, streams[out.request_id])) is not None]


def test_first_token_at_once_then_groups_of_n_and_the_rest_with_the_finish():
    coalescer = OutputCoalescer(4)
    streams = Streams()
    outputs = [token("a", t) for t in range(1, 10)] + [token("a", 10, finish=FinishReason.LENGTH)]
    sent = run(coalescer, streams, outputs)
    assert [out.new_token_ids for out in sent] == [[1], [2, 3, 4, 5], [6, 7, 8, 9], [10]]
    assert [lp.token_id for out in sent for lp in out.logprobs] == list(range(1, 11))
    assert [out.finish_reason for out in sent] == [FinishReason.NONE] * 3 + [FinishReason.LENGTH]
    assert streams.in_flight() == 0


def test_a_finish_carries_the_held_tokens_and_its_error():
    coalescer = OutputCoalescer(8)
    streams = Streams()
    sent = run(coalescer, streams, [token("a", 1), token("a", 2), token("a", 3),
                                    RequestOutput("a", finish_reason=FinishReason.ERROR, error="worker lost")])
    assert [out.new_token_ids for out in sent] == [[1], [2, 3]]
    assert sent[-1].finish_reason == FinishReason.ERROR and sent[-1].error == "worker lost"
    assert streams.in_flight() == 0


def test_an_abort_before_the_first_token_is_sent_and_leaves_nothing():
    coalescer = OutputCoalescer(4)
    streams = Streams()
    sent = run(coalescer, streams, [RequestOutput("a", finish_reason=FinishReason.ABORT)])
    assert [out.finish_reason for out in sent] == [FinishReason.ABORT]
    assert streams.in_flight() == 0


def test_samples_and_requests_are_grouped_independently():
    coalescer = OutputCoalescer(2)
    streams = Streams()
    outputs = []
    for t in range(1, 6):  # Interleaved as a step's outputs are: a/0, a/1, b/0 each step.
        outputs += [token("a", t, index=0), token("a", 100 + t, index=1), token("b", 200 + t)]
    sent = run(coalescer, streams, outputs)
    by_sample: dict[tuple[str, int], list[list[int]]] = {}
    for out in sent:
        by_sample.setdefault((out.request_id, out.index), []).append(out.new_token_ids)
    assert by_sample == {("a", 0): [[1], [2, 3], [4, 5]], ("a", 1): [[101], [102, 103], [104, 105]],
                         ("b", 0): [[201], [202, 203], [204, 205]]}
    # One sample of "a" ends; the other still holds its place until it ends too.
    run(coalescer, streams, [token("a", 6, index=0, finish=FinishReason.STOP)])
    assert streams.in_flight() == 2
    coalescer.forget(streams["a"])
    coalescer.forget(streams["b"])
    assert streams.in_flight() == 0


def test_interval_one_sends_every_output_unchanged():
    coalescer = OutputCoalescer(1)
    streams = Streams()
    outputs = [token("a", 1), token("a", 2, finish=FinishReason.STOP)]
    assert [coalescer.push(out, streams[out.request_id]) for out in outputs] == outputs
    assert streams.in_flight() == 0


def test_interval_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        OutputCoalescer(0)
