"""The sampling set and the refusals through the official `openai` SDK against the real
cluster (issue #33, items 1 and 2): logit_bias forces a token, min_tokens holds off the
end, a penalty changes greedy output, bad words are never generated, prompt logprobs and
echo with logprobs cover the prompt's tokens, and an unsupported field is a 400 naming it."""

from __future__ import annotations

import asyncio

import openai
import pytest

from .test_openai_api import CHAT, MODEL, sdk


@pytest.mark.slow
async def test_sampling_fields_over_http_and_grpc(cluster):
    async with sdk(cluster) as client:
        forced = await client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                                 temperature=0, logit_bias={"28": 100}, logprobs=0)
        tokens = forced.choices[0].logprobs.tokens
        assert len(tokens) == 4 and len(set(tokens)) == 1  # Token 28, four times.
        short = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0)
        longer = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0,
                                                      extra_body={"min_tokens": short.usage.completion_tokens + 5})
        assert short.choices[0].finish_reason == "stop"
        assert longer.usage.completion_tokens >= short.usage.completion_tokens + 5
        plain = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0,
                                                     extra_body={"ignore_eos": True})
        penalized = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0,
                                                         frequency_penalty=2.0, extra_body={"ignore_eos": True})
        assert penalized.choices[0].message.content != plain.choices[0].message.content
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model=MODEL, messages=CHAT,
                                                 prediction={"type": "content", "content": "Paris"})
        assert refused.value.param == "prediction"  # (not implemented: refused by name, never ignored)
        with pytest.raises(openai.BadRequestError) as refused:  # tool_choice auto needs --tool-call-parser
            await client.chat.completions.create(model=MODEL, messages=CHAT, tools=[
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
        assert refused.value.param == "tool_choice"


@pytest.mark.slow
async def test_bad_words_are_never_generated_and_other_rows_keep_their_tokens(cluster):
    prompt = "The capital of France is"
    async with sdk(cluster) as client:
        def complete(**extra):
            return client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=0,
                                             extra_body=extra)

        plain = await complete()
        first_word = plain.choices[0].logprobs.tokens[0].strip()  # The greedy answer's first word.
        assert first_word and first_word in plain.choices[0].text
        # Batched together: the row with bad words, and a plain row beside it.
        banned, beside = await asyncio.gather(complete(bad_words=[first_word]), complete())
        assert first_word not in banned.choices[0].text and banned.choices[0].text != plain.choices[0].text
        assert beside.choices[0].text == plain.choices[0].text
        # A two-token phrase (two word tokens in a row, e.g. " answer" " is"): its last
        # token is banned only after the first.
        tokens = plain.choices[0].logprobs.tokens
        phrase = next((a + b).strip() for a, b in zip(tokens, tokens[1:])
                      if a.startswith(" ") and b.startswith(" ") and (a + b).replace(" ", "").isalpha())
        assert phrase in plain.choices[0].text and " " in phrase
        guarded = await complete(bad_words=[phrase])
        assert phrase not in guarded.choices[0].text


@pytest.mark.slow
async def test_prompt_logprobs_and_echo_with_logprobs_cover_the_prompt(cluster):
    prompt = "The capital of France is"
    async with sdk(cluster) as client:
        echoed = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                                 echo=True, logprobs=2, extra_body={"prompt_logprobs": 1})
        choice = echoed.choices[0]
        lp = choice.logprobs
        prompt_lps = choice.model_extra["prompt_logprobs"]
        num_prompt = len(prompt_lps)
        assert num_prompt > 1 and prompt_lps[0] is None and all(len(e) in (1, 2) for e in prompt_lps[1:])
        assert len(lp.tokens) == num_prompt + 3 and "".join(lp.tokens[:num_prompt]) == prompt
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
        assert all(len(top) <= 2 for top in lp.top_logprobs[1:])
        assert lp.text_offset[:2] == [0, len(lp.tokens[0])] and lp.text_offset[num_prompt] == len(prompt)
        assert choice.text.startswith(prompt)
        # The same logprobs both ways: the echoed token's, and prompt_logprobs' entry for it (its first).
        for i in range(1, num_prompt):
            entry = next(iter(prompt_lps[i].values()))
            assert entry["decoded_token"] == lp.tokens[i] and entry["rank"] >= 1
            assert abs(entry["logprob"] - lp.token_logprobs[i]) < 1e-6
        chat = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0,
                                                    extra_body={"prompt_logprobs": 0})
        chat_lps = chat.choices[0].model_extra["prompt_logprobs"]
        assert chat_lps[0] is None and len(chat_lps) == chat.usage.prompt_tokens
        assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in chat_lps[1:])
        # A repeat of the prompt: a request asking for prompt logprobs takes no prefix-cache hit.
        again = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0,
                                                     extra_body={"prompt_logprobs": 0})
        assert again.choices[0].model_extra["prompt_logprobs"] == chat_lps
        assert not (again.usage.prompt_tokens_details and again.usage.prompt_tokens_details.cached_tokens)


@pytest.mark.slow
async def test_bad_words_and_prompt_logprobs_over_grpc(cluster):
    from llmserve.v1 import generation_pb2 as pb
    from llmserve.v1 import generation_pb2_grpc

    async with cluster.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        prompt = "The capital of France is"
        ids = list((await stub.Tokenize(pb.TokenizeRequest(text=prompt), timeout=5)).token_ids)

        async def generate(**params):
            request = pb.GenerateRequest(text=prompt, params=pb.SamplingParams(max_tokens=4, temperature=0, **params))
            return [r async for r in stub.Generate(request, timeout=30)]

        plain = await generate()
        asked = await generate(prompt_logprobs=2, bad_words=[plain[0].text.strip()])
        assert [lp.token_id for lp in asked[0].prompt_logprobs] == ids[1:]  # Tokens 1.., on the first response.
        assert all(lp.rank >= 1 and len(lp.top_token_ids) == 2 for lp in asked[0].prompt_logprobs)
        assert not any(r.prompt_logprobs for r in asked[1:]) and not any(r.prompt_logprobs for r in plain)
        assert plain[0].text.strip() not in "".join(r.text for r in asked)
