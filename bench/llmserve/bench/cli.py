"""The `llmserve bench ...` subcommands' flags.

The engine's flags are the services' own settings (llmserve.launcher.engine_settings),
with the benchmarks' defaults: a 1 GiB KV cache and no swap space, so that a run's
figures do not depend on the host's free memory.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass

from llmserve.bench import llama_cpp
from llmserve.bench.overload import add_overload_arguments
from llmserve.bench.report import add_output_dir_flag
from llmserve.contract.heap import freeze_startup_heap
from llmserve.bench.loops import add_loops_flags
from llmserve.bench.offline import OfflineSettings, add_offline_flags
from llmserve.bench.overhead import add_overhead_flags
from llmserve.bench.decode_gemm import add_gemm_flags
from llmserve.bench.decode_variants import VARIANTS
from llmserve.bench.moe import PRESETS as MOE_PRESETS
from llmserve.bench.random_model import PRESETS, SHARD_BYTES
from llmserve.bench.routing import add_routing_arguments
from llmserve.bench.workloads import add_workload_flags
from llmserve.launcher.engine_settings import EngineSettings
from llmserve.settings import Command, add_flags, group, resolve
from llmserve.worker.config import DTYPES, RunnerConfig, WorkerConfig
from llmserve.worker.device import DEVICES
from llmserve.worker.layers.int8_weight import QUANTIZATIONS


# --grpc-security: the transports a round runs, as ClusterSpec.insecure values.
GRPC_SECURITY = {"tls": (False,), "insecure": (True,), "both": (False, True)}


def _bench_engine() -> EngineSettings:
    return EngineSettings(worker=WorkerConfig(runner=RunnerConfig(kv_cache_memory=2**30, swap_space=0)))


@dataclass(frozen=True)
class BenchSettings:
    engine: EngineSettings = group(_bench_engine)


@dataclass(frozen=True)
class KvSizingSettings:
    """kv-sizing checks the worker's own sizing, so it keeps the worker's defaults: no
    1 GiB budget, the profiled one on CUDA (on the CPU it asks for --kv-cache-memory)."""
    engine: EngineSettings = group(EngineSettings)


def _common(p: argparse.ArgumentParser) -> None:
    """The flags of the benchmarks that run a workload: the engine's, the workload's, where
    reports go, and the transport of launched clusters."""
    add_flags(p, BenchSettings)
    add_workload_flags(p)
    add_output_dir_flag(p, "JSON + PNG go here")
    p.add_argument("--grpc-security", choices=list(GRPC_SECURITY), default="tls",
                   help="launched clusters run mutual TLS with an API key (tls, the default), plaintext "
                        "(insecure), or both, one after the other in every round, to measure what TLS costs "
                        "(with --target: how to reach it, tls or insecure)")


def _throughput_flags(tput: argparse.ArgumentParser) -> None:
    _common(tput)
    tput.add_argument("--through-grpc", action="store_true", help="also run it through a local cluster")
    tput.add_argument("--baseline", action="append", choices=["hf", "hf-cb", "llama-cpp"], default=[],
                      help="in the same run: HF transformers' static-batch generate (hf) or its continuous "
                           "batching (hf-cb), llama.cpp's llama-server (llama-cpp, at each --llama-cpp-quant); "
                           "repeatable")
    tput.add_argument("--llama-cpp-quant", nargs="+", choices=llama_cpp.QUANTS, default=None,
                      help="with --baseline llama-cpp: the GGUF precisions, each its own system (default: the "
                           "engine's: float32 F32, bfloat16 BF16, --quantization int8 Q8_0)")
    tput.add_argument("--llama-cpp-dir", default=llama_cpp.DEFAULT_DIR,
                      help="with --baseline llama-cpp: where scripts/build_llama_cpp.sh put bin/llama-server and "
                           "models/<model>-<precision>.gguf")
    tput.add_argument("--hf-batch-size", type=int, default=16)
    tput.add_argument("--repeat", type=int, default=1,
                      help="rounds, each running every system in turn; figures are each system's median round")
    tput.add_argument("--compare", nargs="*", default=[], metavar="JSON",
                      help="earlier throughput reports (another host kind, another dtype) drawn beside this run "
                           "in the PNG, one group of bars each")


def _serve_flags(serve: argparse.ArgumentParser) -> None:
    _common(serve)
    serve.add_argument("--backend", choices=["grpc", "openai", "both"], default="grpc",
                       help="the router's native gRPC API (default), any OpenAI-compatible server's "
                            "/v1/completions (streamed, through the openai SDK), or both one after the other on "
                            "the same launched cluster in every round (pass --no-prefix-caching so the second "
                            "finds nothing cached)")
    serve.add_argument("--target", default=None,
                       help="the server: a router address (grpc; default localhost:50051) or an OpenAI base URL "
                            "(openai; default http://localhost:8000/v1)")
    serve.add_argument("--served-model", default=None,
                       help="with --backend openai: the `model` to send (default: the server's first model)")
    serve.add_argument("--tls-ca", default=None, help="with --target: the CA to verify the router against "
                                                     "(default: $LLMSERVE_TLS_CA, else the system's roots)")
    serve.add_argument("--api-key-file", default=None, help="with --target: the API key's file (default: "
                                                            "$LLMSERVE_API_KEY)")
    serve.add_argument("--span-file", default=None,
                       help="with --target: the JSON-lines span file the cluster's scheduler and worker append "
                            "to (their LLMSERVE_SPAN_FILE): also report its engine steps (known with --launch)")
    serve.add_argument("--scheduler-target", default=None, help=argparse.SUPPRESS)  # Gone: see bench_serve.
    serve.add_argument("--launch", action="store_true", help="start a local cluster for the run")
    serve.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf = all at once")
    serve.add_argument("--max-concurrency", type=int, default=None)
    serve.add_argument("--repeat", type=int, default=1,
                       help="rounds (each on a fresh cluster with --launch, then its in-process decode step); "
                            "figures are the median round's")


def _routing_flags(routing: argparse.ArgumentParser) -> None:
    _common(routing)
    add_routing_arguments(routing)


def _overload_flags(over: argparse.ArgumentParser) -> None:
    add_flags(over, BenchSettings)
    add_overload_arguments(over)


def _profile_flags(prof: argparse.ArgumentParser) -> None:
    prof.add_argument("--model", default="default", help="local HF model directory, or 'default'")
    prof.add_argument("--dtype", default="float32", choices=DTYPES)
    prof.add_argument("--batch", type=int, nargs="*", default=[64],
                      help="decode batch sizes, one profile each (none: --prefill-len alone)")
    prof.add_argument("--context", type=int, default=256, help="prompt tokens per sequence")
    prof.add_argument("--prefill-len", type=int, default=0,
                      help="also profile whole prompt-carrying steps: prompts of this many tokens (0: none)")
    prof.add_argument("--prefill-step-tokens", type=int, default=16384,
                      help="tokens each profiled prefill step carries (whole prompts; CUDA's step budget)")
    prof.add_argument("--quantization", default="none", choices=list(QUANTIZATIONS))
    prof.add_argument("--device", default="auto", choices=DEVICES,
                      help="cpu: a step's pieces timed one by one; cuda: whole steps (graphs on), GPU time by "
                           "kernel family (auto: cuda when visible)")
    prof.add_argument("--output-dir", default=None, help="write the figures as JSON here too")


def _decode_flags(decode: argparse.ArgumentParser) -> None:
    add_flags(decode, BenchSettings)
    decode.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8], help="decode batch sizes")
    decode.add_argument("--context", type=int, default=256, help="prompt tokens per sequence")
    decode.add_argument("--steps", type=int, default=64, help="timed decode steps per batch size and mode")
    decode.add_argument("--mixed", type=int, nargs=2, metavar=("CHUNK", "DECODES"),
                        help="also time steps that prefill a new CHUNK-token prompt beside DECODES decode rows "
                             "(piecewise graphs vs eager)")
    add_output_dir_flag(decode)


def _decode_floor_flags(floor: argparse.ArgumentParser) -> None:
    add_flags(floor, BenchSettings)
    floor.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256], help="decode batch sizes")
    floor.add_argument("--context", type=int, default=1024, help="prompt tokens per sequence")
    floor.add_argument("--steps", type=int, default=32, help="timed decode steps per batch size")
    floor.add_argument("--calibrate-s", type=float, default=1.0,
                       help="seconds measuring the memory bandwidth (the matmul peak: 1.5x that)")
    add_output_dir_flag(floor)


def _loops_flags(loops: argparse.ArgumentParser) -> None:
    add_flags(loops, BenchSettings)
    add_loops_flags(loops)


def _variants_flags(variants: argparse.ArgumentParser) -> None:
    add_flags(variants, BenchSettings)
    variants.add_argument("--variants", nargs="+", default=["float32", "bfloat16", "int8", "int8-wo"],
                          choices=list(VARIANTS),
                          help="int8: --quantization int8 (W8A8 where the CPU has VNNI), bfloat16 activations; "
                               "int8-wo: int8-weight-only; int8-fp32: int8 with float32 activations")
    variants.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16], help="decode batch sizes")
    variants.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    variants.add_argument("--steps", type=int, default=32, help="timed decode steps per batch size and variant")
    add_output_dir_flag(variants)


def _moe_flags(moe: argparse.ArgumentParser) -> None:
    moe.add_argument("--preset", default="small", choices=list(MOE_PRESETS), help="the two models' shape")
    moe.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    moe.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16], help="decode batch sizes")
    moe.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    moe.add_argument("--steps", type=int, default=32, help="timed decode steps per batch size and model")
    moe.add_argument("--seed", type=int, default=0, help="the random weights' seed")
    add_output_dir_flag(moe)


def _speculative_flags(spec: argparse.ArgumentParser) -> None:
    add_flags(spec, BenchSettings)
    spec.add_argument("--num-requests", type=int, default=8, help="requests per latency workload")
    spec.add_argument("--seed", type=int, default=0, help="the random workload's seed")
    spec.add_argument("--throughput-rounds", type=int, default=2,
                      help="rounds of the reference workload, plain and speculative in turns (0: skip)")
    add_output_dir_flag(spec)


def _structured_flags(structured: argparse.ArgumentParser) -> None:
    add_flags(structured, BenchSettings)
    structured.add_argument("--batch", type=int, default=64, help="requests per batch (mixed: one of them constrained)")
    structured.add_argument("--context", type=int, default=128, help="prompt tokens of each plain request")
    structured.add_argument("--output-len", type=int, default=64, help="tokens each request generates")
    structured.add_argument("--rounds", type=int, default=3, help="rounds, each running both batches in turn")
    structured.add_argument("--seed", type=int, default=0, help="the random prompts' seed")
    add_output_dir_flag(structured)


def _quality_flags(quality: argparse.ArgumentParser) -> None:
    quality.add_argument("--model", default="default", help="local HF model directory, or 'default'")
    quality.add_argument("--dtypes", nargs="*", default=["bfloat16"], choices=DTYPES[1:],
                         help="unquantized dtypes to compare with float32 (always run, the reference)")
    quality.add_argument("--quantization", nargs="*", default=["int8", "int8-weight-only"], choices=list(QUANTIZATIONS),
                         help="weight quantizations to compare with float32")
    quality.add_argument("--quantized-dtype", nargs="+", default=["bfloat16"], choices=DTYPES[1:],
                         help="activation dtypes the quantized models run in")
    quality.add_argument("--max-tokens", type=int, default=1536, help="tokens of the text evaluated")
    add_output_dir_flag(quality)


def _kv_sizing_flags(kv: argparse.ArgumentParser) -> None:
    add_flags(kv, KvSizingSettings)
    add_output_dir_flag(kv)


def _make_model_flags(make: argparse.ArgumentParser) -> None:
    make.add_argument("--out", required=True, help="directory to write config.json + model.safetensors to")
    make.add_argument("--preset", default="llama-1b", choices=list(PRESETS))
    make.add_argument("--dtype", default="bfloat16", choices=DTYPES[1:], help="the weights' dtype on disk")
    make.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                      help="where the random values are drawn (a GPU draws 1.2 B in milliseconds)")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--shard-bytes", type=int, default=SHARD_BYTES, help="most bytes per safetensors file")


@dataclass(frozen=True)
class BenchCommand:
    """One `llmserve bench <name>`: its flags, and the function that runs it
    ("module:function", imported only when it runs)."""

    name: str
    help: str
    add_flags: Callable[[argparse.ArgumentParser], None]
    run: str
    engine: type | None = BenchSettings  # The settings class of its engine flags (None: it has none).


BENCHES = (
    BenchCommand("throughput", "offline: in-process engine, optionally gRPC stack, HF and llama.cpp",
                 _throughput_flags, "llmserve.bench.throughput:bench_throughput"),
    BenchCommand("offline", "vLLM's offline benchmark: N random prompts of fixed length in and out, in-process, "
                            "greedy and temperature 1.0: req/s, tok/s and the share of the measured physical ceiling",
                 add_offline_flags, "llmserve.bench.offline:bench_offline", engine=OfflineSettings),
    BenchCommand("serve", "online: Poisson arrivals against a cluster", _serve_flags,
                 "llmserve.bench.serve:bench_serve"),
    BenchCommand("routing", "routing policies over data-parallel replicas, side by side: cached-token fraction and "
                            "throughput", _routing_flags, "llmserve.bench.routing:bench_routing"),
    BenchCommand("overload", "admission control: 2x the sustainable rate, refusals and TTFT", _overload_flags,
                 "llmserve.bench.overload:bench_overload"),
    BenchCommand("profile", "where the time of one decode step goes", _profile_flags,
                 "llmserve.bench.profile_step:bench_profile", engine=None),
    BenchCommand("gemm", "the CPU's bfloat16 and int8 products at decode rows (1-64) per projection shape: weight "
                         "bytes/s as a share of the host's measured memory bandwidth", add_gemm_flags,
                 "llmserve.bench.decode_gemm:bench_gemm", engine=None),
    BenchCommand("decode", "decode tok/s with CUDA graphs vs eager (--enforce-eager), per batch size, side by side",
                 _decode_flags, "llmserve.bench.decode_graphs:bench_decode"),
    BenchCommand("decode-floor", "decode steps per batch size (graphs as served) against the measured bandwidth "
                                 "floor: weights + KV bytes per step", _decode_floor_flags,
                 "llmserve.bench.decode_floor:bench_decode_floor"),
    BenchCommand("loops", "the serial vs the pipelined engine loop (--async-scheduling) on a real model, through a "
                          "local cluster: steady decode tok/s per batch size", _loops_flags,
                 "llmserve.bench.loops:bench_loops"),
    BenchCommand("decode-variants", "decode tok/s per weight format (float32, bfloat16, int8), per batch size, side "
                                    "by side", _variants_flags, "llmserve.bench.decode_variants:bench_decode_variants"),
    BenchCommand("moe", "decode tok/s of a mixture-of-experts model (random Mixtral) vs a dense Llama with the same "
                        "active parameters per token, side by side", _moe_flags, "llmserve.bench.moe:bench_moe",
                 engine=None),
    BenchCommand("speculative", "speculative decoding (n-gram drafts, --speculative-tokens K, default 4) vs plain "
                                "decoding: TPOT at batch 1 on a copying and a random workload, throughput at 64 at "
                                "once, side by side", _speculative_flags, "llmserve.bench.speculative:bench_speculative"),
    BenchCommand("structured", "what one json_schema request costs the plain requests batched with it: their TPOT "
                               "in 64 plain vs 63 plain + 1 constrained, side by side", _structured_flags,
                 "llmserve.bench.structured:bench_structured"),
    BenchCommand("quality", "perplexity and next-token agreement with float32, teacher-forced over a fixed text, per "
                            "dtype / quantization", _quality_flags, "llmserve.bench.quality:bench_quality",
                 engine=None),
    BenchCommand("kv-sizing", "the KV cache the worker sizes vs what fits after start-up", _kv_sizing_flags,
                 "llmserve.bench.kv_sizing:bench_kv_sizing", engine=KvSizingSettings),
    BenchCommand("overhead", "the host path per step without a GPU: a cluster over TLS with a simulated device step "
                             "(--simulated-step-ms), decode batches and a mixed scenario, serial vs pipelined loop: "
                             "device-busy fraction and host ms per step by phase", add_overhead_flags,
                 "llmserve.bench.overhead:bench_overhead", engine=None),
    BenchCommand("make-model", "a random-weight Llama HF directory of a realistic shape (no download)",
                 _make_model_flags, "llmserve.bench.random_model:bench_make_model", engine=None),
)


def add_bench_arguments(bench: argparse.ArgumentParser) -> None:
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for command in BENCHES:
        command.add_flags(bench_sub.add_parser(command.name, help=command.help))


def run_bench(args) -> int:
    command = next(c for c in BENCHES if c.name == args.bench_command)
    if command.engine is not None:
        args.engine = resolve(command.engine, args).engine
        runner = args.engine.worker.runner
        args.model, args.dtype, args.kv_cache_memory = args.engine.worker.model, runner.dtype, runner.kv_cache_memory
        args.quantization = runner.quantization
    module, _, function = command.run.partition(":")
    run = getattr(importlib.import_module(module), function)
    # NOTE: as the services do at start-up: what is imported by now (torch, the bench) is
    # frozen out of the collector's reach and young collections are rarer, or the
    # in-process engine's step pays for the collector walking it: at 1,024 decode rows over
    # a simulated 2 ms device, 28-32 against 17 ms of host work a serial step.
    freeze_startup_heap()
    return run(args)


COMMAND = Command("bench", "benchmarks (throughput offline, serve online, routing over replicas, overload, profile a "
                           "step, decode graphs vs eager, decode per weight format, MoE vs dense, speculative "
                           "decoding, quality vs float32, KV sizing, a random model)", None, run_bench,
                  add_bench_arguments)
