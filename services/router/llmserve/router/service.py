"""The router: the public `llmserve.v1.Generation` API, and on --http-port the same
API in OpenAI's wire format (openai/); both run `Generation` (generation.py).

    client ──Generate──▶ validate ─▶ tokenize ─▶ replica's SchedulerLink.add ─┐
    client ◀─deltas──── stop strings ◀─ detokenize ◀─ outputs queue ◀┘

It owns everything textual (tokenizer, chat template, detokenization, stop strings);
the scheduler and workers see token ids only. A cancelled or disconnected client
aborts its request in the scheduler, so its KV blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import prometheus_client

from llmserve.contract import wire
from llmserve.contract.api_keys import ApiKeyInterceptor, ApiKeys
from llmserve.contract.grpc_server import ServiceServer
from llmserve.contract.heap import freeze_startup_heap
from llmserve.contract.retry_info import retry_status
from llmserve.contract.step_budget import StepBudget
from llmserve.model_store import resolve_model_dir
from llmserve.router.config import RouterConfig
from llmserve.router.generation import Generation, GenerationError
from llmserve.router.health import RouterHealth
from llmserve.router.http_server import HttpServer
from llmserve.router.limits import check_prompt_size, prompt_byte_limit
from llmserve.router.openai.api import create_app
from llmserve.router.reflection import enable_reflection
from llmserve.router.request_decoding import DecodeErrorInterceptor
from llmserve.router.replicas import ReplicaSet
from llmserve.router.routing import make_policy
from llmserve.router.tokenizer import PromptTokenizer
from llmserve.router.validation import RequestError, ServedModel, check_model_name, invalid
from llmserve.telemetry import RouterMetrics, setup_metrics, setup_tracing, shutdown_metrics, shutdown_tracing
from llmserve.v1 import generation_pb2, generation_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = "llmserve.v1.Generation"
NO_DEADLINE_S = 10 * 365 * 86400.0  # A deadline further off than this is no deadline.


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """The gRPC wire format of `Generation`: protobuf in, protobuf out, errors as statuses."""

    def __init__(self, generation: Generation):
        self.generation = generation
        self.model_info: generation_pb2.ModelInfo | None = None

    def set_ready(self, served: ServedModel, model_info: generation_pb2.ModelInfo) -> None:
        self.generation.served, self.model_info = served, model_info

    async def _require_ready(self, context) -> None:
        try:
            self.generation.require_ready()
        except GenerationError as err:
            await context.abort(err.code, err.message)

    # --- Generate ------------------------------------------------------------

    async def Generate(self, request, context):
        await self._require_ready(context)
        responses = self.generation.generate(request, context.invocation_metadata(), _deadline_budget_ms(context))
        try:
            # aclosing: a cancelled call closes the generation at once (it aborts the request).
            async with contextlib.aclosing(responses):
                async for output in responses:
                    response = self._response(output.request_id, output.delta)
                    if output.usage is not None:
                        response.usage.CopyFrom(output.usage.to_pb())
                    yield response
        except GenerationError as err:
            if err.retry_after_ms:
                # A load-shedding refusal: the status with its RetryInfo.
                await context.abort_with_status(retry_status(err.code, err.message, err.retry_after_ms))
            await context.abort(err.code, err.message)

    @staticmethod
    def _response(request_id: str, delta) -> generation_pb2.GenerateResponse:
        """One delta as a GenerateResponse. NOTE: one per token per request at the router's
        busiest: the fields most deltas leave empty are set only when they are not (an empty
        repeated field costs a list comprehension and a conversion each time)."""
        response = generation_pb2.GenerateResponse(request_id=request_id, index=delta.index, text=delta.text,
                                                   token_ids=delta.token_ids)
        if delta.logprobs:
            response.logprobs.extend(wire.logprobs_to_pb(lp) for lp in delta.logprobs)
        if delta.prompt_logprobs:
            response.prompt_logprobs.extend(wire.logprobs_to_pb(lp) for lp in delta.prompt_logprobs)
        if delta.finish_reason:
            response.finish_reason = int(delta.finish_reason)
        if delta.stop_reason:
            response.stop_reason = delta.stop_reason
        if delta.error:
            response.error = delta.error
        if delta.reasoning_text:
            response.reasoning_text = delta.reasoning_text
        if delta.tool_calls:
            response.tool_calls.extend(generation_pb2.ToolCallDelta(index=c.index, id=c.id, name=c.name,
                                                                    arguments=c.arguments) for c in delta.tool_calls)
        return response

    # --- Tokenize / GetModelInfo ---------------------------------------------

    async def Tokenize(self, request, context):
        await self._require_ready(context)
        served = self.generation.served
        try:
            check_model_name(request.model, served)
            check_prompt_size(request, served)
            kind = request.WhichOneof("input")
            if kind == "text":
                add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
                ids = await asyncio.to_thread(self.generation.tokenizer.encode_text, request.text, add_special)
                prompt = request.text
            elif kind == "messages":
                prompt, ids = await self.generation.render_chat(request.messages)
            else:
                raise invalid("the request has no input: set text or messages")
        except RequestError as err:
            await context.abort(err.code, err.message)
        return generation_pb2.TokenizeResponse(token_ids=ids, count=len(ids), prompt=prompt)

    async def GetModelInfo(self, request, context):
        await self._require_ready(context)
        try:
            check_model_name(request.model, self.generation.served)
        except RequestError as err:
            await context.abort(err.code, err.message)
        return self.model_info


def _deadline_budget_ms(context) -> int:
    """What is left of the client's deadline, in ms (at least 1), or 0 without one. A
    call without a deadline reports an effectively infinite time remaining."""
    remaining = context.time_remaining()
    if remaining is None or remaining > NO_DEADLINE_S:
        return 0
    return max(1, int(remaining * 1000))


def _model_info(served: ServedModel, worker, num_kv_blocks: int, tokenizer, num_replicas: int = 1,
                budget: StepBudget | None = None) -> generation_pb2.ModelInfo:
    """The public ModelInfo; the step budget is the first replica's, as the worker's facts are."""
    budget = budget or StepBudget(0, 0, "")
    return generation_pb2.ModelInfo(
        model=served.name,
        max_model_len=served.max_model_len,
        vocab_size=served.vocab_size,
        eos_token_ids=sorted(set(worker.eos_token_ids) | set(tokenizer.eos_token_ids)),
        dtype=worker.dtype,
        block_size=worker.block_size,
        num_kv_blocks=num_kv_blocks,
        tensor_parallel_size=worker.tensor_parallel_size,
        bos_token_id=worker.bos_token_id,
        device=worker.device,
        cuda_graphs=worker.cuda_graphs,
        data_parallel_size=num_replicas,
        quantization=worker.quantization,
        dtype_reason=worker.dtype_reason,
        max_num_batched_tokens=budget.max_num_batched_tokens,
        max_num_seqs=budget.max_num_seqs,
        step_budget_reason=budget.reason,
    )


async def serve(config: RouterConfig, stop_event: asyncio.Event) -> None:
    setup_tracing("llmserve-router")
    model_dir = resolve_model_dir(config.model)
    # Every metric carries the served name (the one ServedModel gets from the tokenizer: the directory's).
    metrics = RouterMetrics(setup_metrics("router", config.server.metrics_port, config.server.host),
                            model_name=config.served_model_name or model_dir.name)
    tokenizer = await asyncio.to_thread(PromptTokenizer.from_model_dir, model_dir)
    # Only the default --max-prompt-bytes needs it (the whole vocabulary is decoded once).
    longest_token_bytes = 0
    if config.max_prompt_bytes is None:
        longest_token_bytes = await asyncio.to_thread(tokenizer.longest_token_bytes)
    # The public port: TLS without client certificates (callers prove themselves with a
    # key, checked first), client requests up to --max-request-bytes; a body that does not
    # decode gets INVALID_ARGUMENT (DecodeErrorInterceptor).
    interceptors = [] if config.security.insecure else [ApiKeyInterceptor(ApiKeys.from_options(config.api))]
    server = ServiceServer(SERVICE_NAME, config.server.host, config.server.port, config.security,
                           client_auth=False, max_message_bytes=config.server.max_message_bytes,
                           max_receive_bytes=config.max_request_bytes,
                           interceptors=interceptors + [DecodeErrorInterceptor()],
                           health_port=config.server.health_port)
    replicas = ReplicaSet(config.scheduler_address, config.security, config.server.max_message_bytes,
                          make_policy(config.routing_policy), config.scheduler_resolve_interval_s)
    # One request path, two wire formats: gRPC here, OpenAI's HTTP API on --http-port.
    generation = Generation(tokenizer, replicas, metrics, config.reasoning_parser, config.tool_call_parser)
    servicer = GenerationServicer(generation)
    # Health and reflection answer from the start (NOT_SERVING until a scheduler has a worker).
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server.server)
    enable_reflection(server.server, (SERVICE_NAME, "grpc.health.v1.Health"))
    http = _http_server(config, generation) if config.http_port else None
    if http is not None:
        await http.start()
    await server.start()
    freeze_startup_heap()  # The tokenizer's and the server's objects: out of every full collection's walk.
    health = RouterHealth(server)
    await replicas.start(config.connect_timeout_s)
    supervisor = asyncio.create_task(_follow_replicas(config, replicas, servicer, health, tokenizer,
                                                      longest_token_bytes))
    stopped = asyncio.create_task(stop_event.wait())
    try:
        await asyncio.wait({supervisor, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if supervisor.done():
            supervisor.result()  # Re-raises why the router cannot serve.
    finally:
        stopped.cancel()
        await server.set_serving(False)
        if stop_event.is_set():
            await _drain(generation, config.server.shutdown_timeout)
        supervisor.cancel()
        if http is not None:
            await http.stop()
        await server.stop(grace=2.0)
        await replicas.close()
        shutdown_metrics()
        shutdown_tracing()


def _http_server(config: RouterConfig, generation: Generation) -> HttpServer:
    """The OpenAI API, with the gRPC port's keys (none under --insecure)."""
    keys = None if config.security.insecure else ApiKeys.from_options(config.api)
    app = create_app(generation, keys, prometheus_text, config.max_request_bytes)
    return HttpServer(app, config.server.host, config.http_port, config.security)


async def _drain(generation: Generation, timeout_s: float) -> None:
    """SIGTERM: refuse new calls (both front doors), let running streams finish for up to
    `timeout_s`, then end the rest with UNAVAILABLE."""
    generation.draining = True
    running = generation.placements
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    if running:
        logger.info("draining %d in-flight requests (up to %.0f s)", len(running), timeout_s)
    while running and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if running:
        left = sorted(running, key=lambda record: record.request_id)
        logger.warning("shutdown timeout: aborting %d requests", len(left))
        for record in left:
            if (replica := record.replica) is not None:
                record.fail(f"unavailable: the router is shutting down (requests still running after the "
                            f"{timeout_s:.0f} s shutdown timeout were aborted)")
                await replica.link.abort([record.request_id])
        await asyncio.sleep(0.1)  # Let the failed streams end before the server stops.


async def _follow_replicas(config: RouterConfig, replicas: ReplicaSet, servicer: GenerationServicer,
                           health: RouterHealth, tokenizer: PromptTokenizer, longest_token_bytes: int) -> None:
    """Waits (up to --connect-timeout) for a first replica to serve, then keeps the served
    model's limits and the router's health in step with the replicas: SERVING while any
    serves, saturated while every serving one is."""
    await replicas.wait_serving(config.connect_timeout_s)
    last = None
    while True:
        replicas.changed.clear()
        infos = replicas.serving_infos()
        if infos and infos != last:
            _update_served(config, servicer, tokenizer, longest_token_bytes, infos, len(replicas.routable()))
            last = infos
        serving = replicas.serving
        await health.update(serving=serving, saturated=replicas.saturated)
        if serving:
            logger.debug("router serving %s from %d replicas", servicer.generation.served.name,
                         len(replicas.routable()))
        await replicas.changed.wait()


def _update_served(config: RouterConfig, servicer: GenerationServicer, tokenizer: PromptTokenizer,
                   longest_token_bytes: int, infos: list, num_replicas: int) -> None:
    """The served model's limits from the serving replicas: the smallest of their context
    lengths (a request must fit wherever it lands), the first one's model facts."""
    worker, _, budget = infos[0]
    # Each KV cache must hold at least one whole sequence, or a request could never run there.
    max_model_len = min(min(w.max_model_len, blocks * w.block_size) for w, blocks, _ in infos)
    if max_model_len < worker.max_model_len:
        logger.warning("max_model_len lowered from %d to %d: a KV cache holds only that many tokens",
                       worker.max_model_len, max_model_len)
    max_prompt_bytes = prompt_byte_limit(config.max_prompt_bytes, max_model_len, longest_token_bytes)
    served = ServedModel(name=config.served_model_name or tokenizer.name, max_model_len=max_model_len,
                         vocab_size=worker.vocab_size, max_prompt_bytes=max_prompt_bytes)
    first = servicer.generation.served is None
    servicer.set_ready(served, _model_info(served, worker, sum(blocks for _, blocks, _ in infos), tokenizer,
                                           num_replicas, budget))
    if first:
        logger.info("requests: max_model_len %d tokens, prompts up to %d bytes, messages up to %d bytes",
                    max_model_len, max_prompt_bytes, config.max_request_bytes)
        logger.info("router serving %s on port %d", served.name, config.server.port)


def prometheus_text() -> tuple[bytes, str]:
    """The router's metrics for GET /metrics: the registry --metrics-port serves (OTel's
    Prometheus reader registers there; with --metrics-port 0 it holds process metrics only)."""
    return prometheus_client.generate_latest(), prometheus_client.CONTENT_TYPE_LATEST
