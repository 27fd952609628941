"""The OpenAI HTTP layer's own refusals, in process over ASGI (no cluster): keys, body
size, body shape, a draining router, and the error bodies and Retry-After headers."""

from __future__ import annotations

import json

import grpc
import httpx2  # The openai SDK's HTTP client, whose ASGITransport drives the app in process.
import pytest

from llmserve.contract.api_keys import ApiKeys
from llmserve.router.generation import Generation
from llmserve.router.openai.api import create_app
from llmserve.router.openai.errors import error_response

KEY = "sk-test"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}


def http(generation: Generation, limit: int = 4096) -> httpx2.AsyncClient:
    app = create_app(generation, ApiKeys([KEY]), lambda: (b"# TYPE x counter\n", "text/plain"), limit)
    return httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://router",
                              headers={"authorization": f"Bearer {KEY}"})


def draining() -> Generation:
    """A router told to shut down: it refuses before touching the tokenizer or the scheduler."""
    generation = Generation(tokenizer=None, replicas=None, metrics=None)
    generation.draining = True
    return generation


async def test_draining_router_is_503_and_unhealthy():
    async with http(draining()) as client:
        health = await client.get("/health", headers={"authorization": ""})
        assert (health.status_code, health.json()) == (503, {"status": "not serving"})
        refused = await client.post("/v1/chat/completions", json=CHAT)
        assert refused.status_code == 503
        assert refused.json() == {"error": {"message": "the router is shutting down", "type": "service_unavailable",
                                            "param": None, "code": "unavailable"}}
        assert (await client.get("/v1/models")).status_code == 503


@pytest.mark.parametrize("authorization,message", [
    ("", "missing API key: send the metadata `authorization: Bearer <key>`"),
    ("Basic abc", "malformed authorization: expected `Bearer <key>`"),
    ("Bearer wrong", "invalid API key"),
])
async def test_keys_are_checked_like_grpc(authorization, message):
    async with http(draining()) as client:
        reply = await client.post("/v1/completions", json={"model": "m", "prompt": "x"},
                                  headers={"authorization": authorization})
    assert reply.status_code == 401
    assert reply.json()["error"] == {"message": message, "type": "authentication_error", "param": None,
                                     "code": "unauthenticated"}


async def test_body_shape_errors_are_400_naming_the_field():
    async with http(draining()) as client:
        reply = await client.post("/v1/chat/completions", json={"model": "m", "messages": "Hi"})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages"
        not_json = await client.post("/v1/completions", content=b"{nope", headers={"content-type": "application/json"})
        assert not_json.status_code == 400 and not_json.json()["error"]["type"] == "invalid_request_error"


async def test_body_over_the_limit_is_413_before_it_is_read():
    async with http(draining(), limit=100) as client:
        reply = await client.post("/v1/completions", json={"model": "m", "prompt": "x" * 200})
    assert reply.status_code == 413
    assert "the limit is 100 (--max-request-bytes)" in reply.json()["error"]["message"]


async def test_metrics_and_health_need_no_key():
    async with http(draining()) as client:
        reply = await client.get("/metrics", headers={"authorization": ""})
    assert reply.status_code == 200 and reply.text == "# TYPE x counter\n"


def test_refusal_carries_retry_after_in_seconds_and_ms():
    response = error_response(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", retry_after_ms=1500)
    assert response.status_code == 429
    assert (response.headers["retry-after"], response.headers["retry-after-ms"]) == ("2", "1500")
    assert json.loads(response.body)["error"]["type"] == "rate_limit_error"
    unknown = error_response(grpc.StatusCode.INTERNAL, "boom")
    assert unknown.status_code == 500 and "retry-after" not in unknown.headers
