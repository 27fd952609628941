"""`bench serve --backend openai`: the load generator's client for any OpenAI-compatible
server (this router's --http-port, vLLM, SGLang, TGI's Messages API...), through the
official `openai` SDK.

It streams /v1/completions with the workload's token ids as the prompt, greedy, with
`ignore_eos` (vLLM's extension, which this router shares) so each request generates
exactly its output length. A chunk carries no token ids, so each chunk with text counts
as one token when it arrives, and the request's `usage` (stream_options.include_usage)
settles the count at the end: tokens whose text came in no chunk of their own (a
character spread over several tokens) are counted then, as vLLM's `bench serve`
counts them.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass


@dataclass
class Delta:
    """What run_load reads of a streamed message: how many tokens it brought. The
    message with the request's usage also carries its completion token count."""

    token_ids: list[int]
    completion_tokens: int | None = None


class OpenAIClient:
    """An async context manager with LLMServeClient.generate's shape for run_load.
    `model`: the `model` field to send; None: the first of the server's /v1/models."""

    def __init__(self, base_url: str, api_key: str | None = None, tls_ca: str | None = None,
                 model: str | None = None):
        self.base_url = base_url if "://" in base_url else f"http://{base_url}"
        self.api_key = api_key or "EMPTY"  # The SDK insists on a key; servers without keys ignore it.
        self.tls_ca = tls_ca
        self.model = model
        self._client = None

    async def __aenter__(self) -> "OpenAIClient":
        import openai

        # The SDK's HTTP client logs every request at INFO: thousands of lines a run.
        logging.getLogger("httpx2").setLevel(logging.WARNING)
        verify = ssl.create_default_context(cafile=str(self.tls_ca)) if self.tls_ca else True
        self._client = openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0,
                                          timeout=600, http_client=openai.DefaultAsyncHttpxClient(verify=verify))
        if self.model is None:
            models = await self._client.models.list()
            self.model = models.data[0].id
        return self

    async def __aexit__(self, *exc) -> None:
        await self._client.close()

    async def generate(self, token_ids: list[int], max_tokens: int, temperature: float = 0.0,
                       ignore_eos: bool = True) -> AsyncIterator[Delta]:
        stream = await self._client.completions.create(
            model=self.model, prompt=list(token_ids), max_tokens=max_tokens, temperature=temperature, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": ignore_eos})
        counted = 0
        async with stream:
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    counted += 1
                    yield Delta([0])
                if chunk.usage is not None:
                    reported = chunk.usage.completion_tokens
                    yield Delta([0] * max(0, reported - counted), completion_tokens=reported)
                    counted = max(counted, reported)
