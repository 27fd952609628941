"""The public API's side services: health, reflection, model info, tokenize."""

from __future__ import annotations

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from llmserve.v1 import generation_pb2 as pb
from llmserve.v1 import generation_pb2_grpc

from .reference import hf_tokenizer


@pytest.mark.slow
async def test_health_on_every_service(cluster):
    for service in ("router", "scheduler", "worker"):
        async with cluster.channel(service) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service


@pytest.mark.slow
async def test_reflection_lists_the_generation_service(cluster):
    async with cluster.channel() as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = stub.ServerReflectionInfo()
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        reply = await call.read()
        await call.done_writing()
        names = {s.name for s in reply.list_services_response.service}
    assert "llmserve.v1.Generation" in names


@pytest.mark.slow
async def test_model_info_and_tokenize(cluster, model_dir):
    async with cluster.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
        assert info.model == "SmolLM2-135M-Instruct"
        assert info.vocab_size == 49152 and 2 in info.eos_token_ids
        assert info.block_size == 16 and info.num_kv_blocks > 0 and info.dtype == "float32"
        assert info.tensor_parallel_size == 1 and info.max_model_len == 8192
        # --device auto on a host without a GPU: the CPU, eager (graphs are a CUDA thing).
        assert info.device == "cpu" and not info.cuda_graphs
        # The step budget the scheduler resolved at registration: nothing set, so the CPU's.
        assert (info.max_num_batched_tokens, info.max_num_seqs) == (512, 256)
        assert info.step_budget_reason == "by device: cpu"
        tok = hf_tokenizer(str(model_dir))
        reply = await stub.Tokenize(pb.TokenizeRequest(text="Hello world"), timeout=5)
        assert list(reply.token_ids) == tok("Hello world")["input_ids"] and reply.count == len(reply.token_ids)
        msgs = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi")])
        reply = await stub.Tokenize(pb.TokenizeRequest(messages=msgs), timeout=5)
        assert reply.prompt.startswith("<|im_start|>")
        assert reply.prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_cli_generate_streams_from_a_running_cluster(cluster):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "llmserve.cli", "generate", "--chat", "--max-tokens", "16",
         "--target", cluster.router_address, "--tls-ca", str(cluster.credentials.ca),
         "--api-key-file", str(cluster.credentials.api_key_file), "What is the capital of France?"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
