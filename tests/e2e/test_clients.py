"""Clients in other languages and tools against a real cluster: the Node example over the
npm package, `buf curl` through reflection v1 and v1alpha, reflection's source comments,
and the pip package in an environment that has nothing else of llmserve."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2

from llmserve.protogen import PROTO_ROOT
from tests.api_wheel import build_api_wheel

pytestmark = pytest.mark.slow
EXAMPLES = PROTO_ROOT.parent / "examples"
PROMPT = "What is the capital of France?"


def client_env(cluster, **extra) -> dict[str, str]:
    """The variables `llmserve up` prints, as a user would export them."""
    return {**os.environ, "LLMSERVE_TARGET": cluster.router_address, "LLMSERVE_TLS_CA": str(cluster.credentials.ca),
            "LLMSERVE_API_KEY": cluster.api_key, **extra}


async def greedy_chat_text(cluster, max_tokens: int) -> str:
    async with cluster.client() as client:
        pieces = [d.text async for d in client.generate(messages=[("user", PROMPT)], max_tokens=max_tokens,
                                                        temperature=0)]
    return "".join(pieces)


async def test_node_example_streams_the_same_greedy_text_as_python(cluster, node_example):
    result = subprocess.run(["node", "stream_chat.js", PROMPT], cwd=node_example, capture_output=True, text=True,
                            env=client_env(cluster, MAX_TOKENS="4"), timeout=120)
    assert result.returncode == 0, result.stderr
    text, _, summary = result.stdout.rpartition("\n[")
    # max_tokens arrived (snake_case kept by the loader): the sample stopped at 4 tokens (its whole answer is 8).
    assert summary.startswith("FINISH_REASON_LENGTH") and "completion_tokens=4" in summary, result.stdout
    assert text == await greedy_chat_text(cluster, 4)


def test_node_example_reports_a_refused_key_in_one_line(cluster, node_example):
    result = subprocess.run(["node", "stream_chat.js", PROMPT], cwd=node_example, capture_output=True, text=True,
                            env=client_env(cluster, LLMSERVE_API_KEY="wrong"), timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip() == "stream_chat: UNAUTHENTICATED: invalid API key"


def buf_curl(cluster, *args: str, **env) -> subprocess.CompletedProcess:
    buf = shutil.which("buf", path=str(Path(sys.executable).parent))
    assert buf, "buf is missing: it comes with the test extra (buf-bin)"
    path = f"{Path(buf).parent}{os.pathsep}{os.environ['PATH']}"
    return subprocess.run(["bash", str(EXAMPLES / "buf_curl.sh"), *args], capture_output=True, text=True,
                          env=client_env(cluster, PATH=path, **env), timeout=120)


@pytest.mark.parametrize("protocol", ["grpc-v1", "grpc-v1alpha"])
async def test_buf_curl_example_streams_through_reflection(cluster, protocol):
    result = buf_curl(cluster, PROMPT, MAX_TOKENS="5", REFLECT_PROTOCOL=protocol)
    assert result.returncode == 0, result.stderr
    # buf curl prints each streamed message as a JSON object (proto3 JSON mapping).
    messages = [json.loads(chunk) for chunk in result.stdout.replace("}\n{", "}\x00{").split("\x00")]
    assert messages[-1]["finishReason"] == "FINISH_REASON_LENGTH"
    assert "".join(m.get("text", "") for m in messages) == await greedy_chat_text(cluster, 5)


@pytest.mark.parametrize("service", ["grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"])
def test_reflection_lists_the_api_and_serves_its_comments(cluster, service):
    # v1 and v1alpha are the same messages under two package names.
    credentials = grpc.ssl_channel_credentials(cluster.credentials.ca.read_bytes())
    with grpc.secure_channel(cluster.router_address, credentials) as channel:
        call = channel.stream_stream(f"/{service}/ServerReflectionInfo",
                                     request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                     response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        listed, found = call(iter([reflection_pb2.ServerReflectionRequest(list_services=""),
                                   reflection_pb2.ServerReflectionRequest(
                                       file_containing_symbol="llmserve.v1.SamplingParams")]),
                             metadata=cluster.call_metadata)
    names = {s.name for s in listed.list_services_response.service}
    assert {"llmserve.v1.Generation", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= names
    (serialized,) = found.file_descriptor_response.file_descriptor_proto
    file = descriptor_pb2.FileDescriptorProto.FromString(serialized)
    assert file.name == "llmserve/v1/generation.proto"
    comments = " ".join(loc.leading_comments for loc in file.source_code_info.location)
    assert "Most tokens to generate" in comments and "Why a sample ended" in comments


def test_pip_package_alone_calls_the_router(cluster, tmp_path):
    """A Python user with only `llmserve-api` (and grpcio, protobuf): no llmserve code at all."""
    wheel = build_api_wheel(tmp_path)
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    # grpc and protobuf from this environment's site-packages, added as a plain path: its
    # .pth files (llmserve's editable installs among them) are not run.
    purelib = sysconfig.get_paths()["purelib"]
    script = f"""
import sys
sys.path[:0] = [{str(tmp_path / 'site')!r}, {purelib!r}]
import grpc
from llmserve.v1 import generation_pb2 as pb, generation_pb2_grpc as pb_grpc
import llmserve
assert list(llmserve.__path__) == [{str(tmp_path / 'site' / 'llmserve')!r}], llmserve.__path__
creds = grpc.ssl_channel_credentials(open({str(cluster.credentials.ca)!r}, 'rb').read())
stub = pb_grpc.GenerationStub(grpc.secure_channel({cluster.router_address!r}, creds))
request = pb.GenerateRequest(text='The capital of France is', params=pb.SamplingParams(max_tokens=5, temperature=0))
pieces = list(stub.Generate(request, metadata=[('authorization', 'Bearer {cluster.api_key}')]))
print(pb.FinishReason.Name(pieces[-1].finish_reason), pieces[-1].usage.completion_tokens)
"""
    result = subprocess.run([sys.executable, "-S", "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["FINISH_REASON_LENGTH", "5"]


async def test_python_client_sends_structured_output_bias_and_min_tokens(cluster, model_dir):
    """The Python client's sampling fields reach the worker: each one visibly changes the
    greedy output of the real model."""
    from .reference import hf_tokenizer

    tok = hf_tokenizer(str(model_dir))
    async with cluster.client() as client:
        async def greedy(**kwargs) -> tuple[str, list[int], str | None]:
            deltas = [d async for d in client.generate(messages=[("user", PROMPT)], temperature=0, **kwargs)]
            return "".join(d.text for d in deltas), [i for d in deltas for i in d.token_ids], deltas[-1].finish_reason

        plain, plain_ids, plain_end = await greedy(max_tokens=12)
        choice, _, choice_end = await greedy(max_tokens=8, choice=["Lyon", "Marseille"])
        number, _, _ = await greedy(max_tokens=8, regex="[0-9]{3}")
        schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                  "required": ["city"], "additionalProperties": False}
        document, _, document_end = await greedy(max_tokens=40, json_schema=schema)
        forced = tok.encode(" banana", add_special_tokens=False)[0]
        _, biased_ids, _ = await greedy(max_tokens=3, logit_bias={forced: 100.0})
        _, long_ids, _ = await greedy(max_tokens=len(plain_ids) + 5, min_tokens=len(plain_ids) + 5)
    assert "Paris" in plain and plain_end == "stop"  # It ends by itself (eos) within 12 tokens.
    assert choice in ("Lyon", "Marseille") and choice_end == "stop"
    assert len(number) == 3 and number.isdigit()
    assert document_end == "stop" and set(json.loads(document)) == {"city"}
    assert biased_ids == [forced] * 3
    assert len(long_ids) == len(plain_ids) + 5  # Its eos (12 tokens in) could not end it.
