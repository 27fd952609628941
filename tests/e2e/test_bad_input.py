"""Acceptance 5: each bad input gets its status code and a clear message, while a good
request running at the same time completes with the right output."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from llmserve.v1 import generation_pb2 as pb
from llmserve.v1 import generation_pb2_grpc

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def params(**kw) -> pb.SamplingParams:
    return pb.SamplingParams(**kw)


BAD_REQUESTS = [
    ("no input", pb.GenerateRequest(), INVALID, "no input"),
    ("empty text", pb.GenerateRequest(text=""), INVALID, "the prompt text is empty"),
    ("empty token ids", pb.GenerateRequest(token_ids=pb.TokenIds()), INVALID, "token_ids is empty"),
    ("empty messages", pb.GenerateRequest(messages=pb.ChatMessages()), INVALID, "messages is empty"),
    ("prompt too long", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[42] * 9000)), INVALID, "max_model_len"),
    ("max_tokens 0", pb.GenerateRequest(text="hi", params=params(max_tokens=0)), INVALID,
     "max_tokens must be at least 1"),
    ("max_tokens negative", pb.GenerateRequest(text="hi", params=params(max_tokens=-5)), INVALID,
     "max_tokens must be at least 1"),
    ("prompt + max_tokens too long", pb.GenerateRequest(text="hi", params=params(max_tokens=10_000)), INVALID,
     "exceeds max_model_len"),
    ("negative temperature", pb.GenerateRequest(text="hi", params=params(temperature=-0.1)), INVALID,
     "temperature"),
    ("nan temperature", pb.GenerateRequest(text="hi", params=params(temperature=float("nan"))), INVALID,
     "temperature"),
    ("top_p 0", pb.GenerateRequest(text="hi", params=params(top_p=0.0)), INVALID, "top_p must be in (0, 1]"),
    ("top_p > 1", pb.GenerateRequest(text="hi", params=params(top_p=1.5)), INVALID, "top_p must be in (0, 1]"),
    ("top_k -2", pb.GenerateRequest(text="hi", params=params(top_k=-2)), INVALID, "top_k"),
    ("token id past vocab", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 49152])), INVALID,
     "outside the vocabulary"),
    ("negative token id", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[-1])), INVALID, "outside the vocabulary"),
    ("unknown model", pb.GenerateRequest(text="hi", model="gpt-17"), grpc.StatusCode.NOT_FOUND, "not served"),
    ("n 0", pb.GenerateRequest(text="hi", params=params(n=0)), INVALID, "n must be"),
    ("logprobs too many", pb.GenerateRequest(text="hi", params=params(logprobs=1000)), INVALID, "logprobs"),
    ("empty stop string", pb.GenerateRequest(text="hi", params=params(stop=[""])), INVALID, "stop strings"),
]


async def generate_ids(client, prompt: str, **kwargs) -> list[int]:
    ids = []
    async for delta in client.generate(prompt, **kwargs):
        ids += delta.token_ids
    return ids


async def expect_error(stub, request) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stub.Generate(request, timeout=30):
            pass
    return info.value


@pytest.mark.slow
async def test_bad_inputs_fail_cleanly_while_a_good_request_runs(cluster):
    async with cluster.client() as client:
        solo = await generate_ids(client, "The three primary colors are", max_tokens=48, temperature=0.0,
                                         ignore_eos=True)
        good = asyncio.create_task(generate_ids(client, "The three primary colors are", max_tokens=48,
                                                       temperature=0.0, ignore_eos=True))
        async with cluster.channel() as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            for label, request, code, message in BAD_REQUESTS:
                err = await expect_error(stub, request)
                assert err.code() == code, f"{label}: {err.code()} {err.details()}"
                assert message in err.details(), f"{label}: {err.details()!r}"
            dup = pb.GenerateRequest(request_id="dup", text="Hello", params=params(max_tokens=64, ignore_eos=True))
            first = stub.Generate(dup)
            await first.read()  # The first one is running now.
            err = await expect_error(stub, dup)
            assert err.code() == grpc.StatusCode.ALREADY_EXISTS
            first.cancel()
        assert await good == solo
