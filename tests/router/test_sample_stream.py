"""A sample's stream gives the same text, tokens and finish however the engine grouped
its tokens into outputs (one per step, or N at a time with --stream-interval)."""

from __future__ import annotations

import random

import pytest

from llmserve.contract.outputs import FinishReason, RequestOutput, TokenLogprobs
from llmserve.router.detokenizer import IncrementalDetokenizer
from llmserve.router.sample_stream import SampleStream
from llmserve.router.stop_strings import StopStringMatcher


def streamed(tokenizer, token_ids: list[int], group_sizes: list[int], stops: list[str]):
    """(text, token ids, logprob ids, finish, stop reason) of one sample whose tokens
    arrive in outputs of the given sizes, the last one finishing by length."""
    stream = SampleStream(0, IncrementalDetokenizer(tokenizer), StopStringMatcher(stops))
    text, ids, lp_ids, start = "", [], [], 0
    for i, size in enumerate(group_sizes):
        chunk = token_ids[start:start + size]
        start += size
        last = i == len(group_sizes) - 1
        out = RequestOutput("r", new_token_ids=chunk, logprobs=[TokenLogprobs(t, -1.0) for t in chunk],
                            finish_reason=FinishReason.LENGTH if last else FinishReason.NONE)
        delta = stream.process(out, lambda t: tokenizer.decode([t]))
        text += delta.text
        ids += delta.token_ids
        lp_ids += [lp.token_id for lp in delta.logprobs]
        if delta.finish_reason != FinishReason.NONE:
            return text, ids, lp_ids, delta.finish_reason, delta.stop_reason, stream.num_tokens
    raise AssertionError("the stream never finished")


@pytest.mark.parametrize("seed", range(4))
def test_grouping_of_outputs_changes_nothing(smollm2, seed):
    rng = random.Random(seed)
    token_ids = smollm2.encode_text("The quick brown fox jumps over the lazy dog. 天气很好，我们去公园吧！ 🎉 Done.",
                                    False)
    text = smollm2.decode(token_ids)
    words = text.split()
    stops_cases = [[], [words[3]], [words[-2], "公园"], ["no such stop"]]
    for stops in stops_cases:
        one_by_one = streamed(smollm2, token_ids, [1] * len(token_ids), stops)
        sizes = [1]
        while sum(sizes) < len(token_ids):
            sizes.append(min(rng.randint(1, 6), len(token_ids) - sum(sizes)))
        grouped = streamed(smollm2, token_ids, sizes, stops)
        assert grouped == one_by_one, (stops, sizes)
        _, ids, lp_ids, finish, stop_reason, num_tokens = grouped
        assert lp_ids == ids and num_tokens == len(ids)
        if stops and stops[0] in text:
            # The tokens after the one completing the stop string are cut, even inside a group.
            assert finish == FinishReason.STOP and stop_reason in stops and len(ids) < len(token_ids)
        else:
            assert finish == FinishReason.LENGTH and ids == token_ids


def test_min_tokens_holds_off_stop_strings(smollm2):
    # "fox" ends in the 4th token: with min_tokens 4 it is text, with 3 it stops.
    token_ids = smollm2.encode_text("The quick brown fox jumps over the fox again", False)
    ends = [i for i in range(1, len(token_ids) + 1) if "fox" in smollm2.decode(token_ids[:i])]
    first_end = ends[0]
    later_end = next(i for i in ends if "fox" in smollm2.decode(token_ids[first_end:i]))

    def run(min_tokens):
        stream = SampleStream(0, IncrementalDetokenizer(smollm2), StopStringMatcher(["fox"]), min_tokens=min_tokens)
        delta = stream.process(RequestOutput("r", new_token_ids=token_ids, finish_reason=FinishReason.LENGTH),
                               lambda t: smollm2.decode([t]))
        return delta.text, len(delta.token_ids), delta.stop_reason

    assert run(first_end - 1) == (smollm2.decode(token_ids[:first_end]).split("fox")[0], first_end, "fox")
    text, kept, reason = run(first_end)
    assert (kept, reason) == (later_end, "fox") and text.count("fox") == 1
