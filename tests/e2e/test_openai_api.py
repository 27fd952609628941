"""The OpenAI-compatible HTTP API through the official `openai` SDK, against the real
three-process cluster (TLS, API key): chat and completions, streamed and not, n > 1,
stop strings, logprobs, usage with cached tokens, errors, a client that disconnects,
and greedy output identical to the gRPC API's for the same prompts."""

from __future__ import annotations

import ssl
import uuid

import httpx2  # The openai SDK's own HTTP client: raw requests (SSE framing, headers, bodies).
import openai
import pytest

from .stats import block_audit, scheduler_stats, wait_all_blocks_free

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def sdk(cluster, api_key: str | None = None) -> openai.AsyncOpenAI:
    """The SDK as a user configures it: base URL, key, and our CA for TLS (no retries:
    an error must show as itself)."""
    return openai.AsyncOpenAI(base_url=cluster.http_url, api_key=api_key or cluster.api_key, max_retries=0,
                              http_client=openai.DefaultAsyncHttpxClient(verify=_tls(cluster)))


def _tls(cluster) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cluster.credentials.ca))


def raw(cluster) -> httpx2.AsyncClient:
    return httpx2.AsyncClient(base_url=cluster.http_url.removesuffix("/v1"), verify=_tls(cluster),
                             headers={"authorization": f"Bearer {cluster.api_key}"}, timeout=60)


async def grpc_greedy(cluster, **kwargs) -> tuple[str, list[int]]:
    """(text, token ids) of a greedy gRPC generation."""
    text, ids = [], []
    async with cluster.client() as client:
        async for delta in client.generate(temperature=0.0, **kwargs):
            text.append(delta.text)
            ids += list(delta.token_ids)
    return "".join(text), ids


@pytest.mark.slow
async def test_models_health_and_metrics(cluster):
    async with sdk(cluster) as client:
        models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    async with raw(cluster) as http:
        health = await http.get("/health", headers={"authorization": ""})  # Probes carry no key.
        assert (health.status_code, health.json()) == (200, {"status": "serving"})
        metrics = await http.get("/metrics", headers={"authorization": ""})
        assert metrics.status_code == 200 and "# TYPE" in metrics.text
        assert metrics.headers["content-type"].startswith("text/plain")


@pytest.mark.slow
async def test_chat_greedy_matches_grpc_with_logprobs_and_usage(cluster, model_dir):
    from .reference import hf_tokenizer

    async with sdk(cluster) as client:
        reply = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0,
                                                     logprobs=True, top_logprobs=3)
    text, ids = await grpc_greedy(cluster, messages=CHAT, max_tokens=12)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == MODEL
    assert choice.message.role == "assistant" and choice.message.content == text
    assert choice.finish_reason == "stop" and "Paris" in text  # It ends by itself (eos) within 12 tokens.
    tok = hf_tokenizer(str(model_dir))
    tokens = choice.logprobs.content
    assert [t.token for t in tokens] == [tok.decode([i]) for i in ids]
    for t in tokens:  # The sampled token is the most likely one (greedy), listed first.
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob) and t.logprob <= 0
        assert bytes(t.bytes).decode() == t.token
    rendered = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    prompt_len = len(tok(rendered, add_special_tokens=False)["input_ids"])
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_len, len(ids))
    assert reply.usage.total_tokens == prompt_len + len(ids)


@pytest.mark.slow
async def test_streamed_chat_equals_the_whole_reply(cluster):
    async with sdk(cluster) as client:
        whole = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0)
        chunks = [c async for c in await client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True})]
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert len({c.id for c in chunks}) == 1


@pytest.mark.slow
async def test_raw_sse_ends_with_done(cluster):
    async with raw(cluster) as http:
        async with http.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": "Hello", "max_tokens": 3, "stream": True}) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            body = (await response.aread()).decode()
    events = body.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: ") for e in events[:-1])


@pytest.mark.slow
async def test_completions_batch_streamed_matches_grpc(cluster):
    prompts = ["The capital of France is", "Once upon a time"]
    async with sdk(cluster) as client:
        stream = await client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0, n=2,
                                                 stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    assert sorted(texts) == [0, 1, 2, 3]  # Prompt i, sample j: index i * n + j.
    for i, prompt in enumerate(prompts):
        expected, _ = await grpc_greedy(cluster, prompt=prompt, max_tokens=8)
        assert texts[2 * i] == texts[2 * i + 1] == expected
    assert set(finish.values()) == {"length"}
    assert chunks[-1].usage.completion_tokens == 4 * 8


@pytest.mark.slow
async def test_token_id_prompt_matches_text_prompt(cluster, model_dir):
    from .reference import hf_tokenizer

    ids = hf_tokenizer(str(model_dir))("The sky is")["input_ids"]
    async with sdk(cluster) as client:
        by_ids = await client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
        by_text = await client.completions.create(model=MODEL, prompt="The sky is", max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


@pytest.mark.slow
async def test_n_samples_and_seed(cluster):
    async with sdk(cluster) as client:
        kwargs = dict(model=MODEL, messages=CHAT, max_tokens=8, temperature=1.0, n=3, seed=7, logprobs=True)
        first = await client.chat.completions.create(**kwargs)
        again = await client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]  # The seed makes it reproducible...
    assert len(set(texts)) > 1  # ... while each sample draws with its own (seed + index).
    assert first.usage.completion_tokens == sum(len(c.logprobs.content) for c in first.choices)


@pytest.mark.slow
async def test_stop_string_cuts_the_text(cluster):
    async with sdk(cluster) as client:
        whole = (await client.completions.create(model=MODEL, prompt="Count: one, two, three,", max_tokens=12,
                                                 temperature=0)).choices[0]
        word = whole.text.split()[1]  # A word from the middle of the greedy text.
        cut = (await client.completions.create(model=MODEL, prompt="Count: one, two, three,", max_tokens=12,
                                               temperature=0, stop=[word, "never-there"])).choices[0]
    assert cut.text == whole.text[:whole.text.index(word)] and cut.finish_reason == "stop"


@pytest.mark.slow
async def test_completion_logprobs(cluster):
    async with sdk(cluster) as client:
        reply = await client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=6,
                                                temperature=0, logprobs=2)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == reply.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and max(top.values()) == pytest.approx(logprob) and token in top


@pytest.mark.slow
async def test_repeated_prompt_reports_cached_tokens(cluster):
    prompt = f"{uuid.uuid4().hex} " + "The quick brown fox jumps over the lazy dog. " * 8
    async with sdk(cluster) as client:
        first = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        second = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < second.usage.prompt_tokens and cached % 16 == 0  # Whole 16-token blocks.


@pytest.mark.slow
async def test_a_cache_salt_shares_cached_blocks_only_within_its_tenant(cluster):
    prompt = f"{uuid.uuid4().hex} " + "Pack my box with five dozen liquor jugs. " * 8

    async def cached(**salt) -> int:
        reply = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                                extra_body=salt)
        return reply.usage.prompt_tokens_details.cached_tokens

    async with sdk(cluster) as client:
        assert await cached() == 0
        assert await cached(cache_salt="tenant-a") == 0  # Not the unsalted request's blocks.
        assert await cached(cache_salt="tenant-b") == 0
        hits = [await cached(cache_salt="tenant-a"), await cached(cache_salt="tenant-b"), await cached()]
        assert all(h >= 16 and h % 16 == 0 for h in hits), hits
        with pytest.raises(openai.BadRequestError) as err:
            await cached(cache_salt="")
        assert "cache_salt" in str(err.value.body)
        with pytest.raises(openai.BadRequestError) as err:
            await cached(cache_salt="s" * 1025)
        assert "cache_salt is 1025 bytes; the limit is 1024" in err.value.body["message"]


@pytest.mark.slow
async def test_errors_are_openai_shaped(cluster):
    async with sdk(cluster, api_key="not-a-key") as bad:
        with pytest.raises(openai.AuthenticationError) as err:
            await bad.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert err.value.status_code == 401 and err.value.body["message"] == "invalid API key"
    async with sdk(cluster) as client:
        with pytest.raises(openai.NotFoundError) as err:
            await client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
        assert "is not served here" in err.value.body["message"]
        for bad_params in ({"temperature": -1}, {"n": 0}, {"max_tokens": 0}, {"top_p": 2},
                           {"max_tokens": 100_000}, {"top_logprobs": 3}):
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(model=MODEL, messages=CHAT, **{"max_tokens": 2, **bad_params})
            assert err.value.body["type"] == "invalid_request_error", bad_params
    async with raw(cluster) as http:
        missing = await http.post("/v1/chat/completions", json={"model": MODEL})
        assert missing.status_code == 400
        assert missing.json() == {"error": {"message": "messages: Field required", "type": "invalid_request_error",
                                            "param": "messages", "code": "invalid_argument"}}
        nokey = await http.get("/v1/models", headers={"authorization": ""})
        assert nokey.status_code == 401 and nokey.json()["error"]["type"] == "authentication_error"


@pytest.mark.slow
async def test_client_disconnect_frees_blocks(cluster):
    await wait_all_blocks_free(cluster)
    async with sdk(cluster) as client:
        # Long enough to run for minutes on a CPU unless it is aborted.
        stream = await client.completions.create(model=MODEL, prompt="Tell me a story", max_tokens=4000,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        received = 0
        async for _ in stream:
            received += 1
            if received == 3:
                break
        audit = await block_audit(cluster)
        assert audit.gpu_blocks  # The request holds its blocks while it runs...
        await stream.close()  # ... and the client goes away.
    stats = await wait_all_blocks_free(cluster, timeout_s=10)
    assert stats.num_running == 0
    # Not streamed: a client that gives up waiting aborts it all the same.
    async with raw(cluster) as http:
        with pytest.raises(httpx2.ReadTimeout):
            await http.post("/v1/completions", timeout=2.0, json={
                "model": MODEL, "prompt": "Tell me a story", "max_tokens": 4000, "ignore_eos": True})
    stats = await wait_all_blocks_free(cluster, timeout_s=10)
    assert stats.num_running == 0
    audit = await block_audit(cluster)
    assert (list(audit.gpu_blocks), list(audit.problems), list(audit.orphaned_gpu_blocks)) == ([], [], [])
    assert (await scheduler_stats(cluster)).num_orphaned_blocks == 0


@pytest.mark.slow
async def test_bench_load_generator_over_the_openai_api(cluster):
    """`bench serve --backend openai`'s client: every request completes with exactly its
    output length counted (ignore_eos), and the figures are the gRPC run's kind."""
    from llmserve.bench.openai_backend import OpenAIClient
    from llmserve.bench.load import compute_metrics, run_load
    from llmserve.bench.workloads import random_workload

    requests = random_workload(4, (8, 24), (3, 6), vocab_size=49152, seed=3)
    timings, duration = await run_load(lambda: OpenAIClient(cluster.http_url, cluster.api_key,
                                                            str(cluster.credentials.ca)),
                                       requests, float("inf"), max_concurrency=4)
    assert [t.error for t in timings] == [""] * 4
    assert [len(t.token_times) for t in timings] == [r.output_len for r in requests]
    metrics = compute_metrics(timings, duration)
    assert metrics["completed"] == 4 and metrics["output_token_throughput"] > 0
    assert 0 < metrics["ttft_ms"]["median"] < 60_000 and metrics["tpot_ms"]["median"] > 0
