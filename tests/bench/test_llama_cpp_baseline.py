"""`bench throughput --baseline llama-cpp` without llama.cpp: flags and defaults, the
server sized for the workload, the missing-build error, and the whole baseline path
against a stand-in llama-server (tests/bench/fake_llama_server.py) that speaks its HTTP
API. The server's own lifecycle: test_llama_server.py."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from llmserve.bench import llama_cpp
from llmserve.bench.llama_server import LlamaServer, server_command
from llmserve.bench.workloads import BenchRequest, random_workload, reference_workload, summary
from llmserve.launcher.cluster import free_port
from tests.bench.llama_cpp_fakes import FAKE_SERVER, alive, fake_command, records

SMALL = ["--workload", "random", "--num-requests", "3", "--input-len", "8", "20", "--output-len", "3", "6",
         "--kv-cache-memory", "64MiB"]


def fake_build(root: Path, model_name: str, quants=("F32",)) -> llama_cpp.LlamaCppBuild:
    """The layout scripts/build_llama_cpp.sh writes, with the stand-in as bin/llama-server."""
    build = llama_cpp.LlamaCppBuild(root)
    build.server.parent.mkdir(parents=True)
    build.server.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_SERVER}" "$@"\n')
    build.server.chmod(build.server.stat().st_mode | stat.S_IXUSR)
    for quant in quants:
        build.gguf(model_name, quant).parent.mkdir(parents=True, exist_ok=True)
        build.gguf(model_name, quant).write_bytes(b"GGUF")
    return build


def parse(argv: list[str]):
    from llmserve.cli import build_parser

    args = build_parser().parse_args(["bench", "throughput", *argv])
    args.argv = ["llmserve", "bench", "throughput", *argv]
    return args


# --- flags and defaults ---------------------------------------------------------------


@pytest.mark.parametrize("dtype, quantization, quant", [("float32", "none", "F32"), ("bfloat16", "none", "BF16"),
                                                        ("bfloat16", "int8", "Q8_0"), ("float32", "int8", "Q8_0")])
def test_the_default_precision_matches_the_engine_weights(dtype, quantization, quant):
    assert llama_cpp.chosen_quants(parse(["--baseline", "llama-cpp"]), dtype, quantization) == [quant]


def test_an_engine_dtype_without_a_gguf_asks_for_the_flag():
    with pytest.raises(SystemExit, match="--llama-cpp-quant"):
        llama_cpp.chosen_quants(parse(["--baseline", "llama-cpp"]), "float16", "none")
    assert llama_cpp.chosen_quants(parse(["--baseline", "llama-cpp", "--llama-cpp-quant", "Q4_K_M"]), "float16",
                                   "none") == ["Q4_K_M"]


def test_each_precision_is_a_system_of_its_own_beside_the_other_baselines():
    from llmserve.bench.throughput import _baseline_systems, _label

    args = parse(["--baseline", "hf", "--baseline", "llama-cpp", "--llama-cpp-quant", "F32", "Q4_K_M", "F32"])
    assert args.llama_cpp_dir == ".cache/llama.cpp"
    quants = llama_cpp.chosen_quants(args, "float32", "none")
    assert quants == ["F32", "Q4_K_M"]
    assert _baseline_systems(args, quants) == ["hf", "llama-cpp-F32", "llama-cpp-Q4_K_M"]
    assert _label("llama-cpp-Q4_K_M", 16) == "llama.cpp llama-server Q4_K_M"
    with pytest.raises(SystemExit):
        parse(["--baseline", "llama-cpp", "--llama-cpp-quant", "Q5_K"])


def test_a_precision_without_the_baseline_is_refused():
    with pytest.raises(SystemExit, match="needs --baseline llama-cpp"):
        llama_cpp.chosen_quants(parse(["--llama-cpp-quant", "F32"]), "float32", "none")
    assert llama_cpp.chosen_quants(parse(["--baseline", "hf"]), "float32", "none") == []


# --- sizing the server, and finding it ------------------------------------------------------


def test_the_server_is_sized_for_the_workload():
    requests = reference_workload(49152)
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    settings = llama_cpp.server_settings(requests, max_slots=256, threads=2)
    assert settings.slots == 64 and settings.threads == 2
    # Every slot holds the longest request, with room to spare, rounded up.
    assert longest < settings.slot_context <= longest + llama_cpp.CONTEXT_ROUNDING
    assert settings.slot_context % llama_cpp.CONTEXT_ROUNDING == 0
    assert settings.context == 64 * settings.slot_context
    # No more slots than the engine has seats.
    assert llama_cpp.server_settings(requests, max_slots=16, threads=2).slots == 16
    assert llama_cpp.server_settings([BenchRequest([1] * 62, 1)], 256, 1).slot_context == 64
    assert llama_cpp.server_settings([BenchRequest([1] * 63, 1)], 256, 1).slot_context == 128


def test_a_missing_build_names_the_file_and_the_script(tmp_path):
    build = llama_cpp.LlamaCppBuild(tmp_path)
    build.check("M", [])  # No llama.cpp baseline asked for: no build needed (CI has none).
    with pytest.raises(llama_cpp.LlamaCppNotBuilt) as missing_binary:
        build.check("M", ["F32"])
    message = str(missing_binary.value)
    assert str(build.server) in message and "bash scripts/build_llama_cpp.sh" in message and "\n" not in message
    fake_build(tmp_path, "M", quants=["F32"])
    build.check("M", ["F32"])
    with pytest.raises(llama_cpp.LlamaCppNotBuilt, match="M-q8_0.gguf is missing"):
        build.check("M", ["F32", "Q8_0"])


def test_bench_throughput_stops_at_a_missing_build_before_the_engine(tiny_llama_dir, tmp_path, monkeypatch):
    from llmserve.bench import throughput
    from llmserve.bench.cli import run_bench

    monkeypatch.setattr(throughput, "measure_matmul_peak", lambda *a, **k: pytest.fail("the run went on"))
    args = parse(["--model", str(tiny_llama_dir), *SMALL, "--baseline", "llama-cpp", "--llama-cpp-dir",
                  str(tmp_path / "nothing"), "--output-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="build_llama_cpp.sh"):
        run_bench(args)


# --- the baseline end to end, against the stand-in ------------------------------------------


def test_a_round_of_llama_cpp_counts_every_requested_token(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_RECORD", str(tmp_path / "record.jsonl"))
    build = fake_build(tmp_path / "llama.cpp", "M", quants=["Q8_0"])
    requests = random_workload(5, (4, 30), (2, 9), vocab_size=100, seed=3)
    settings = llama_cpp.server_settings(requests, max_slots=256, threads=3)
    result = llama_cpp.run_llama_cpp(build, "M", "Q8_0", requests, settings)
    assert "error" not in result, result.get("error")
    assert result["output_tokens"] == summary(requests)["output_tokens"]
    assert result["output_tokens_per_s"] == pytest.approx(result["output_tokens"] / result["seconds"])
    assert result["llama_server"]["slots"] == 5 and result["llama_server"]["threads"] == 3
    (started,) = records(tmp_path / "record.jsonl")
    port = int(started["argv"][started["argv"].index("--port") + 1])
    assert started["argv"] == server_command(build.server, build.gguf("M", "Q8_0"), port, settings)[1:]
    assert not alive(started["pid"])


def test_a_short_completion_fails_the_round(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_SHORT_BY", "1")
    build = fake_build(tmp_path / "llama.cpp", "M")
    requests = [BenchRequest([5, 6, 7], 4), BenchRequest([8, 9], 2)]
    result = llama_cpp.run_llama_cpp(build, "M", "F32", requests, llama_cpp.server_settings(requests, 256, 1))
    assert "2 of 2 requests did not generate their max_tokens (r0: 3 tokens, not 4)" in result["error"]


def test_bench_throughput_runs_each_precision_beside_the_engine_and_grpc(tiny_llama_dir, tmp_path, monkeypatch,
                                                                          capsys):
    """The whole command: one system per precision, its ratios to the engine and to the
    round's gRPC run. (gRPC is a stand-in here, with a known throughput: the real
    cluster runs in test_bench_commands.py's smoke test.)"""
    from llmserve.bench import throughput
    from llmserve.bench.cli import run_bench

    grpc_tok_s = 1000.0

    def fake_grpc(cluster, requests, cache_salt):
        assert cluster == "a cluster" and cache_salt
        tokens = sum(r.output_len for r in requests)
        return {"seconds": tokens / grpc_tok_s, "output_tokens": tokens, "output_tokens_per_s": grpc_tok_s,
                "outputs": {}}

    monkeypatch.setattr(throughput.GrpcClusters, "get", lambda self, insecure: "a cluster")
    monkeypatch.setattr(throughput, "run_through_grpc", fake_grpc)
    # The machine's peaks take seconds to measure and play no part here.
    monkeypatch.setattr(throughput, "measure_matmul_peak", lambda *a, **k: 1e11)
    monkeypatch.setattr(throughput, "measure_memory_bandwidth", lambda *a, **k: 1e10)
    build = fake_build(tmp_path / "llama.cpp", tiny_llama_dir.name, quants=["F32", "Q4_K_M"])
    out = tmp_path / "out"
    args = parse(["--model", str(tiny_llama_dir), "--dtype", "float32", *SMALL, "--through-grpc", "--baseline",
                  "llama-cpp", "--llama-cpp-quant", "F32", "Q4_K_M", "--llama-cpp-dir", str(build.root),
                  "--output-dir", str(out)])
    assert run_bench(args) == 0
    printed = capsys.readouterr().out
    report = json.loads(next(out.glob("throughput-*.json")).read_text())
    engine = report["results"]["engine"]
    for quant in ("F32", "Q4_K_M"):
        run = report["results"][f"llama-cpp-{quant}"]
        assert run["output_tokens"] == report["workload"]["output_tokens"]
        assert run["engine_over_this"] == pytest.approx(engine["output_tokens_per_s"] / run["output_tokens_per_s"])
        assert run["grpc_over_this"] == pytest.approx(grpc_tok_s / run["output_tokens_per_s"])
        assert "same_tokens_as_engine" not in run  # No token ids to compare.
        assert run["llama_server"]["gguf"] == str(build.gguf(tiny_llama_dir.name, quant))
        row = next(line for line in printed.splitlines() if f"llama.cpp llama-server {quant}" in line)
        assert f"engine/this {run['engine_over_this']:.2f}x" in row
        assert f"gRPC/this {run['grpc_over_this']:.2f}x" in row
    assert "grpc_over_this" not in report["results"]["grpc"]  # A ratio of baselines, not of gRPC itself.


def test_bench_serve_load_over_the_openai_client_counts_each_token_once(tmp_path):
    """The usage message now carries the count to the baseline; bench serve's load
    generator still counts each token once, and a usage-only message is no message."""
    import asyncio

    from llmserve.bench.openai_backend import OpenAIClient
    from llmserve.bench.load import run_load

    requests = random_workload(3, (4, 12), (2, 7), vocab_size=100, seed=4)
    port = free_port()
    with LlamaServer(fake_command(tmp_path, port), port) as server:
        timings, _ = asyncio.run(run_load(lambda: OpenAIClient(f"{server.url}/v1"), requests, float("inf"), None))
    assert [t.error for t in timings] == [""] * 3
    assert [len(t.token_times) for t in timings] == [len(t.delta_times) for t in timings] == \
        [r.output_len for r in requests]


def test_bench_throughput_exits_non_zero_when_a_system_fails(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    """A failed baseline leaves the other systems' figures written, and the exit status
    says that something failed."""
    from llmserve.bench import throughput
    from llmserve.bench.cli import run_bench

    monkeypatch.setattr(throughput, "measure_matmul_peak", lambda *a, **k: 1e11)
    monkeypatch.setattr(throughput, "measure_memory_bandwidth", lambda *a, **k: 1e10)
    monkeypatch.setattr(throughput, "_run_baseline", lambda *a, **k: {"error": "RuntimeError: no server"})
    out = tmp_path / "out"
    args = parse(["--model", str(tiny_llama_dir), "--dtype", "float32", *SMALL, "--baseline", "hf",
                  "--output-dir", str(out)])
    assert run_bench(args) == 1
    assert "bench throughput: hf failed (see above)" in capsys.readouterr().out
    report = json.loads(next(out.glob("throughput-*.json")).read_text())
    assert report["results"]["engine"]["output_tokens"] > 0 and "error" in report["results"]["hf"]
