"""The worker's settings (flags, LLMSERVE_* variables and config-file keys alike).

`RunnerConfig` is what the model runner needs to load a model and size its KV cache;
the in-process engine and the benchmarks use it as it is. `WorkerConfig` adds the
service around it: addresses, the parallel group, operations.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.contract.grpc_server import ServerOptions, service_command
from llmserve.contract.security import SecurityOptions
from llmserve.contract.step_budget import by_device_help
from llmserve.settings import format_bytes, group, parse_bytes, positive_int, setting

from llmserve.worker.device import DEVICES, DTYPE_NAMES
from llmserve.worker.layers.int8_weight import QUANTIZATIONS

# auto: the model's own dtype on CUDA; on the CPU a bfloat16 checkpoint's bfloat16 where
# the CPU multiplies it fast (worker/cpu_dtype.py), else float32, and a quantized GGUF's the
# fastest of int8 W8A8, bfloat16, float32; float16 runs on CUDA only.
DTYPES = ("auto", *DTYPE_NAMES)


def parse_swap_space(text: str) -> int:
    """Bytes: a plain number is GiB (vLLM's --swap-space), else a size such as 512MiB."""
    try:
        return int(float(text) * 2**30)
    except ValueError:
        return parse_bytes(text)


@dataclass(frozen=True)
class RunnerConfig:
    device: str = setting("auto", choices=DEVICES, help="where the model and its KV cache live "
                                                        "(auto: CUDA when this process sees a GPU)")
    dtype: str = setting("auto", choices=DTYPES, help="weights, activations and KV cache dtype (auto: the "
                                                      "model's own on CUDA; on the CPU, a bfloat16 checkpoint's "
                                                      "bfloat16 where the CPU has AMX or AVX-512 BF16 and "
                                                      "measures it faster, else float32; a quantized GGUF's "
                                                      "(the embedded model's Q4_1): int8 W8A8, bfloat16 or "
                                                      "float32, whichever the CPU measures fastest; the reason "
                                                      "is logged)")
    quantization: str = setting("none", choices=QUANTIZATIONS,
                                help="int8: int8 weights (symmetric, one scale per output row) for the "
                                     "layers' linear projections, quantized at load from the same checkpoint, "
                                     "and activations quantized per 64 columns on the fly where the CPU has "
                                     "AVX-512 VNNI (W8A8, the LM head too; else weight-only); int8-weight-only: "
                                     "never quantize activations; embeddings and norms always keep --dtype, the "
                                     "LM head unless W8A8 runs")
    max_model_len: int | None = setting(None, help="cap on prompt + completion tokens", unset="the model's own")
    attention_backend: str = setting("auto", choices=("auto", "torch", "triton"),
                                     help="paged attention kernels (auto: triton on CUDA, torch on CPU)")
    block_size: int = setting(16, parse=positive_int, help="tokens per KV cache block")
    kv_cache_memory: int | None = setting(None, parse=parse_bytes, show=format_bytes,
                                          help="bytes for the KV cache, e.g. 2GiB", unset="10% of available RAM")
    num_kv_blocks: int | None = setting(None, parse=positive_int, help="exact KV block count (overrides the budget)")
    swap_space: int = setting(4 * 2**30, parse=parse_swap_space, show=format_bytes,
                              help="host memory for swapped-out KV blocks: GiB, or a size such as 512MiB")
    gpu_memory_utilization: float = setting(0.9, help="on GPU: share of device memory for weights, activations "
                                                      "and the KV cache")
    enforce_eager: bool = setting(False, help="on CUDA: run every step eagerly, without CUDA graphs "
                                              "(whole-forward ones for decode steps, piecewise ones for mixed steps)")
    # None: by device, the scheduler's rule (contract/step_budget.py), so both size one step alike.
    max_num_seqs: int | None = setting(None, parse=positive_int, unset=by_device_help("max_num_seqs"),
                                       help="largest decode batch captured as a CUDA graph (the scheduler's step "
                                            "limit)")
    max_num_batched_tokens: int | None = setting(None, parse=positive_int,
                                                 unset=by_device_help("max_num_batched_tokens"),
                                                 help="tokens of the profiling forward that sizes the KV cache "
                                                      "(the scheduler's step budget)")


@dataclass(frozen=True)
class WorkerConfig:
    model: str = setting("default", help="local HF model directory, or a GGUF file (or a directory holding one); "
                                         "'default' = the embedded SmolLM2-135M-Instruct")
    served_model_name: str | None = setting(None, help="the name clients pass as `model`",
                                            unset="the directory's name")
    runner: RunnerConfig = group(RunnerConfig)
    scheduler_address: str = setting("localhost:50052", flag="scheduler", help="scheduler address to register with")
    server: ServerOptions = group(lambda: ServerOptions(port=50053))
    security: SecurityOptions = group(SecurityOptions)
    advertise_host: str = setting("localhost", help="host name the scheduler dials back")
    register_timeout_s: float = setting(120.0, flag="register-timeout",
                                        help="seconds to keep trying to register with the scheduler")
    tp_size: int = setting(1, parse=positive_int, help="tensor-parallel ranks (attention heads split)")
    pp_size: int = setting(1, parse=positive_int, help="pipeline stages (layers split)")
    rank: int | None = setting(None, help="this worker's rank in the group, pp_rank * tp_size + tp_rank",
                               unset="$RANK")
    dist_init: str | None = setting(None, help="rendezvous tcp://HOST:PORT, served by rank 0",
                                    unset="$MASTER_ADDR:$MASTER_PORT")
    dist_timeout_s: float = setting(60.0, flag="dist-timeout",
                                    help="seconds to wait for every rank to join, and for any collective")
    simulated_step_ms: float = setting(0.0, help="benchmarks of the host path (`llmserve bench overhead`): load no "
                                                 "weights, run each step's input preparation, then sleep this many "
                                                 "ms for the device and return deterministic tokens; 0 = the model")


COMMAND = service_command("worker", "model shard + KV cache; executes step plans", WorkerConfig,
                          "llmserve.worker.service:serve")
