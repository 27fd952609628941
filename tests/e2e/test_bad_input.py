"""Acceptance 5: each bad input gets its status code and a clear message, while a good
request running at the same time completes with the right output. Issue 17: oversize
inputs are refused before any work (findings 4), one request id cannot be claimed twice
(finding 3), and bodies that do not decode get INVALID_ARGUMENT (finding 5)."""

from __future__ import annotations

import asyncio
import time

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
    # Limits (llmserve.router.limits): each named in its message.
    ("request id too long", pb.GenerateRequest(request_id="r" * 257, text="hi"), INVALID,
     "request_id is 257 bytes; the limit is 256"),
    ("too many stop strings", pb.GenerateRequest(text="hi", params=params(stop=["x"] * 17)), INVALID,
     "17 stop strings; the limit is 16"),
    ("stop string too long", pb.GenerateRequest(text="hi", params=params(stop=["x" * 257])), INVALID,
     "a stop string is 257 characters; the limit is 256"),
    ("too many stop token ids", pb.GenerateRequest(text="hi", params=params(stop_token_ids=[2] * 257)), INVALID,
     "257 stop_token_ids; the limit is 256"),
    ("prompt_logprobs too many", pb.GenerateRequest(text="hi", params=params(prompt_logprobs=21)), INVALID,
     "prompt_logprobs must be between 0 and 20"),
    ("too many bad words", pb.GenerateRequest(text="hi", params=params(bad_words=["x"] * 129)), INVALID,
     "129 bad_words; the limit is 128"),
    ("bad word too long", pb.GenerateRequest(text="hi", params=params(bad_words=["x" * 257])), INVALID,
     "a bad word is 257 bytes; the limit is 256"),
    ("blank bad word", pb.GenerateRequest(text="hi", params=params(bad_words=[" "])), INVALID,
     "bad_words must not be empty"),
    ("too many chat messages", pb.GenerateRequest(messages=pb.ChatMessages(
        messages=[pb.ChatMessage(role="user", content="hi")] * 8193)), INVALID, "8193 chat messages"),
    ("a million token ids", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[42] * 1_000_000)), INVALID,
     "the prompt has 1000000 tokens; max_model_len is 8192"),
    ("huge model name", pb.GenerateRequest(text="hi", model="m" * 100_000), grpc.StatusCode.NOT_FOUND,
     "(100000 characters) is not served here"),
]


async def generate_ids(client, prompt: str, **kwargs) -> list[int]:
    ids = []
    async for delta in client.generate(prompt, **kwargs):
        ids += delta.token_ids
    return ids


async def expect_error(stub, request, timeout: float = 30) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stub.Generate(request, timeout=timeout):
            pass
    return info.value


def router_channel(cluster) -> grpc.aio.Channel:
    return cluster.channel()


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


GOOD_PROMPT = "The three primary colors are"


@pytest.mark.slow
async def test_concurrent_requests_with_one_id_run_once(cluster):
    """Finding 3: eight calls with one id at once: one runs, seven get ALREADY_EXISTS at
    once (not INTERNAL, not a hang), and the id is free again afterwards."""
    def request(max_tokens: int) -> pb.GenerateRequest:
        return pb.GenerateRequest(request_id="same-id", messages=pb.ChatMessages(
            messages=[pb.ChatMessage(role="user", content="Count to ten.")]),
            params=params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))

    async def call(stub, max_tokens: int = 16) -> tuple[str, float]:
        start = time.monotonic()
        try:
            n = 0
            async for response in stub.Generate(request(max_tokens), timeout=60):
                n += len(response.token_ids)
            return f"ok {n}", time.monotonic() - start
        except grpc.aio.AioRpcError as err:
            assert err.code() != grpc.StatusCode.ALREADY_EXISTS or "'same-id' is already running" in err.details()
            return err.code().name, time.monotonic() - start

    async with router_channel(cluster) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        results = await asyncio.wait_for(asyncio.gather(*(call(stub) for _ in range(8))), timeout=60)
        outcomes = sorted(outcome for outcome, _ in results)
        assert outcomes == ["ALREADY_EXISTS"] * 7 + ["ok 16"], results
        assert all(seconds < 5 for outcome, seconds in results if outcome == "ALREADY_EXISTS"), results
        # Released after a success, and after a refusal during preparation: usable again.
        assert (await call(stub, max_tokens=2))[0] == "ok 2"
        too_long = pb.GenerateRequest(request_id="same-id", token_ids=pb.TokenIds(ids=[42] * 9000))
        assert (await expect_error(stub, too_long)).code() == INVALID
        assert (await call(stub, max_tokens=2))[0] == "ok 2"


@pytest.mark.slow
async def test_huge_prompts_are_refused_before_tokenizing(cluster):
    """Finding 4: a 20 MB message is over the public port's 4 MiB limit (gRPC refuses it
    while reading); a 3 MB prompt fits the message but not --max-prompt-bytes (8192 tokens
    x 82 bytes): both answered at once, untokenized, while a good request runs on."""
    big_text = "All work and no play makes Jack a dull boy. " * (3_000_000 // 44)
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=big_text)])
    async with cluster.client() as client:
        solo = await generate_ids(client, GOOD_PROMPT, max_tokens=16, temperature=0.0, ignore_eos=True)
        good = asyncio.create_task(generate_ids(client, GOOD_PROMPT, max_tokens=16, temperature=0.0,
                                                ignore_eos=True))
        async with router_channel(cluster) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            start = time.monotonic()
            err = await expect_error(stub, pb.GenerateRequest(text="x" * 20_000_000), timeout=10)
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
            assert "4194304" in err.details()  # The limit, as gRPC names it.
            assert time.monotonic() - start < 2, time.monotonic() - start
            for request in (pb.GenerateRequest(text=big_text), pb.GenerateRequest(messages=chat)):
                start = time.monotonic()
                err = await expect_error(stub, request, timeout=10)
                assert err.code() == INVALID, err.details()
                assert "bytes; the limit is 671744 bytes (--max-prompt-bytes)" in err.details()
                assert time.monotonic() - start < 2, time.monotonic() - start
            start = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Tokenize(pb.TokenizeRequest(text=big_text), timeout=10)
            assert info.value.code() == INVALID and "--max-prompt-bytes" in info.value.details()
            assert time.monotonic() - start < 2, time.monotonic() - start
        assert await good == solo


GARBAGE = b"\xff\xfe not a protobuf message \x00\x01"
# GenerateRequest{text: b"caf\xc3"}: field 3 (text), length 4, a UTF-8 sequence cut short.
BAD_UTF8_TEXT = b"\x1a\x04caf\xc3"


@pytest.mark.slow
async def test_undecodable_bodies_are_invalid_argument_without_a_traceback(cluster):
    """Finding 5: bytes that do not parse, and a string field that is not UTF-8, on every
    public method: INVALID_ARGUMENT with a message, and no traceback in the router's log."""
    log = cluster.spec.log_dir / "router.log"
    log_start = log.stat().st_size
    assert pb.GenerateRequest.FromString(b"\x1a\x05caf\xc3\xa9").text == "café"  # The same body, valid.
    calls = [("Generate", GARBAGE), ("Generate", BAD_UTF8_TEXT), ("Tokenize", GARBAGE),
             ("Tokenize", b"\x12\x02\xc3\x28"), ("GetModelInfo", GARBAGE), ("GetModelInfo", b"\x0a\x01\xff")]
    async with router_channel(cluster) as channel:
        for method, body in calls:
            path = f"/llmserve.v1.Generation/{method}"
            with pytest.raises(grpc.aio.AioRpcError) as info:
                if method == "Generate":
                    async for _ in channel.unary_stream(path, request_serializer=None)(body, timeout=10):
                        pass
                else:
                    await channel.unary_unary(path, request_serializer=None)(body, timeout=10)
            err = info.value
            assert err.code() == INVALID, f"{method} {body!r}: {err.code()} {err.details()}"
            assert "the request body is not a valid message" in err.details(), err.details()
        # The router still serves well-formed calls.
        stub = generation_pb2_grpc.GenerationStub(channel)
        assert (await stub.Tokenize(pb.TokenizeRequest(text="café"), timeout=10)).count > 0
    text = log.read_bytes()[log_start:].decode(errors="replace")
    assert "Traceback" not in text and "ERROR" not in text, text
