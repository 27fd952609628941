"""A consumer that falls behind gets the outputs queued meanwhile merged into one delta
per sample: fewer, larger messages, never different content. A real `Generation` over a
fake scheduler (an in-process gRPC server speaking the Session protocol) that streams n
samples a step at a time, with logprobs, prompt logprobs and a stop string; a fast and a
slow consumer of the same request must see the same streams, field by field."""

from __future__ import annotations

import asyncio
import contextlib

from llmserve.contract import wire
from llmserve.contract.outputs import FinishReason, RequestOutput, TokenLogprobs
from llmserve.internal.v1 import scheduler_pb2
from llmserve.router.generation import Generation
from llmserve.router.sample_stream import SampleDelta
from llmserve.router.tool_parsers import ToolCallDelta
from llmserve.v1 import generation_pb2 as pb

from .fake_scheduler import FakeSchedulerBase, generation_at, start_fake

TEXTS = ["Streaming text, one token at a time: déjà vu 🙂 and STOP here, then more words follow.",
         "A second sample says something else entirely, with émojis 🎉 and numbers 12345 too."]
STEP_S = 0.002


class SteppingScheduler(FakeSchedulerBase):
    """Streams each request's samples (sample i: `samples[i]`'s ids) one token per step,
    every sample's output of a step in one update, as the real scheduler does."""

    def __init__(self, samples: list[list[int]]):
        self.samples = samples

    async def Session(self, request_iterator, context):
        async for message in request_iterator:
            if message.HasField("add"):
                await self._stream(message.add, context)

    async def _stream(self, add: scheduler_pb2.AddRequest, context) -> None:
        prompt_logprobs = [TokenLogprobs(t, -0.5 * i, (t, 7), (-0.5 * i, -3.0), 1)
                           for i, t in enumerate(add.prompt_token_ids[1:])]
        steps = max(len(ids) for ids in self.samples)
        for step in range(steps):
            outputs = []
            for index, ids in enumerate(self.samples[:add.n]):
                if step >= len(ids):
                    continue
                last = step == len(ids) - 1
                out = RequestOutput(add.request_id, index=index, new_token_ids=[ids[step]],
                                    logprobs=[TokenLogprobs(ids[step], -0.25 * step, (ids[step], 3), (-0.25 * step, -2.0),
                                                            step % 3 + 1)],
                                    finish_reason=FinishReason.LENGTH if last else FinishReason.NONE,
                                    prompt_logprobs=prompt_logprobs if step == 0 else [])
                outputs.append(wire.request_output_to_pb(out))
            await context.write(scheduler_pb2.SchedulerUpdate(outputs=outputs))
            await asyncio.sleep(STEP_S)


@contextlib.asynccontextmanager
async def generation_over(fake: SteppingScheduler, tokenizer):
    server, port = await start_fake(fake)
    try:
        async with generation_at(port, tokenizer) as generation:
            yield generation
    finally:
        await server.stop(grace=None)


async def consume(generation: Generation, request_id: str, n: int, pause_s: float):
    """Every Output of one request; `pause_s`: how long the consumer takes over each."""
    req = pb.GenerateRequest(request_id=request_id, model="m", token_ids=pb.TokenIds(ids=[5, 6, 7, 8]),
                             params=pb.SamplingParams(max_tokens=200, temperature=0.0, n=n, stop=["STOP"],
                                                      logprobs=2, prompt_logprobs=1))
    outputs = []
    async for out in generation.generate(req):
        outputs.append(out)
        await asyncio.sleep(pause_s)
    return outputs


def joined(outputs, index: int) -> dict:
    """One sample's stream, each field concatenated over its deltas in order."""
    deltas = [o.delta for o in outputs if o.delta.index == index]
    assert all(d.finish_reason == FinishReason.NONE for d in deltas[:-1])  # Only the last one ends it.
    return {"text": "".join(d.text for d in deltas), "reasoning": "".join(d.reasoning_text for d in deltas),
            "token_ids": [t for d in deltas for t in d.token_ids],
            "logprobs": [lp for d in deltas for lp in d.logprobs],
            "prompt_token_ids": [t for d in deltas for t in d.prompt_token_ids],
            "prompt_logprobs": [lp for d in deltas for lp in d.prompt_logprobs],
            "tool_calls": [c for d in deltas for c in d.tool_calls],
            "finish": (deltas[-1].finish_reason, deltas[-1].stop_reason, deltas[-1].error)}


async def test_a_slow_consumer_gets_merged_deltas_equal_to_the_fast_ones(smollm2):
    samples = [smollm2.encode_text(text, False) for text in TEXTS]
    async with generation_over(SteppingScheduler(samples), smollm2) as generation:
        fast = await consume(generation, "fast", n=2, pause_s=0)
        slow = await consume(generation, "slow", n=2, pause_s=10 * STEP_S)
    assert len(slow) < len(fast)  # The slow one was sent merged deltas ...
    for index in range(2):  # ... which say what the fast one's say.
        assert joined(slow, index) == joined(fast, index)
    stopped = joined(fast, 0)
    assert stopped["finish"] == (FinishReason.STOP, "STOP", "") and stopped["text"] == TEXTS[0][:TEXTS[0].index("STOP")]
    assert joined(fast, 1)["text"] == TEXTS[1] and len(joined(fast, 1)["logprobs"]) == len(samples[1])
    assert joined(fast, 1)["prompt_token_ids"] == [5, 6, 7, 8] and len(joined(fast, 1)["prompt_logprobs"]) == 3
    assert slow[-1].usage == fast[-1].usage and slow[-1].usage is not None
    assert all(o.usage is None for o in slow[:-1] + fast[:-1])


def test_absorb_merges_a_calls_argument_pieces_and_keeps_the_later_finish():
    first = SampleDelta(index=0, text="a", token_ids=[1], logprobs=[TokenLogprobs(1, -0.1)],
                        finish_reason=FinishReason.NONE, reasoning_text="r",
                        tool_calls=[ToolCallDelta(0, "call_1", "f", '{"x"')])
    first.absorb(SampleDelta(index=0, text="b", token_ids=[2], logprobs=[TokenLogprobs(2, -0.2)],
                             finish_reason=FinishReason.TOOL_CALLS, stop_reason="</tool_call>",
                             tool_calls=[ToolCallDelta(0, arguments=": 1}"), ToolCallDelta(1, "call_2", "g", "{}")]))
    assert (first.text, first.reasoning_text, first.token_ids) == ("ab", "r", [1, 2])
    assert first.logprobs == [TokenLogprobs(1, -0.1), TokenLogprobs(2, -0.2)]
    assert first.tool_calls == [ToolCallDelta(0, "call_1", "f", '{"x": 1}'), ToolCallDelta(1, "call_2", "g", "{}")]
    assert (first.finish_reason, first.stop_reason) == (FinishReason.TOOL_CALLS, "</tool_call>")
