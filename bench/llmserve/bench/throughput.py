"""`llmserve bench throughput`: one workload through the in-process engine, and in the
same run (so ratios are side by side) optionally through a local three-process
cluster over gRPC, through HF transformers and through llama.cpp's llama-server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmserve.bench import llama_cpp
from llmserve.bench.cli import GRPC_SECURITY
from llmserve.bench.clock import now
from llmserve.bench.flops import ModelBytes, ModelFlops, measure_matmul_peak, measure_memory_bandwidth
from llmserve.bench.report import host_line, machine_info, median_round, plot_throughput, report_dir, write_json
from llmserve.bench.step_records import RecordingEngine
from llmserve.bench.workloads import BenchRequest, summary, workload_from_args
from llmserve.worker.config import RunnerConfig
from llmserve.worker.device import dtype_name
from llmserve.worker.model_runner import ModelRunner, device_facts
from llmserve.contract.sampling import SamplingParams
from llmserve.contract.step_budget import device_defaults


def _sampling(r: BenchRequest) -> SamplingParams:
    return SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)


def _time_weighted(steps, value) -> float:
    total = sum(s.seconds for s in steps if s.allocated_slots)
    return sum(s.seconds * value(s) for s in steps if s.allocated_slots) / total if total else 0.0


def run_in_process(engine: RecordingEngine, requests: list[BenchRequest]) -> dict:
    # Warm-up: first calls pay for lazy initialisation inside torch.
    engine.run([("warmup", requests[0].prompt_token_ids[:16], SamplingParams(max_tokens=2, temperature=0.0))])
    engine.steps.clear()
    device = engine.runner.device
    start = now(device)
    done = engine.run([(f"r{i}", r.prompt_token_ids, _sampling(r)) for i, r in enumerate(requests)])
    seconds = now(device) - start
    steps = engine.steps
    out_tokens = sum(len(c.output_token_ids) for c in done.values())
    flops = ModelFlops.from_config(engine.runner.config)
    model_flops = sum(flops.step_flops(s.num_scheduled_tokens, s.num_sampled, s.attention_pairs) for s in steps)
    block_size = engine.scheduler.kv.block_size
    return {
        "seconds": seconds,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / seconds,
        "total_tokens_per_s": (out_tokens + sum(len(r.prompt_token_ids) for r in requests)) / seconds,
        "num_steps": len(steps),
        "computed_tokens": sum(s.num_scheduled_tokens for s in steps),
        # Time-weighted: at each step, slots holding live tokens / slots in allocated blocks.
        "kv_utilisation": _time_weighted(steps, lambda s: s.live_tokens / s.allocated_slots),
        # Its ceiling at this block size: live tokens / slots of the blocks holding them
        # (only the unfilled tail of each sequence's last block is lost).
        "kv_utilisation_bound": _time_weighted(steps, lambda s: s.live_tokens / max(s.live_block_slots, 1)),
        "peak_blocks_in_use": max(s.allocated_slots for s in steps) // block_size,
        "num_preemptions": engine.scheduler.stats().num_preemptions,
        "prefix_cache_hit_rate": engine.scheduler.stats().prefix_cache_hit_rate,
        "model_tflop": model_flops / 1e12,
        "achieved_gflop_per_s": model_flops / seconds / 1e9,
        "outputs": {rid: c.output_token_ids for rid, c in done.items()},
    }


def compile_pass(engine: RecordingEngine, requests: list[BenchRequest], scheduling) -> RecordingEngine:
    """One untimed pass of the whole workload, then an engine with a fresh scheduler on
    the same runner (no prefix-cache hits on the pass's prompts).

    NOTE: on CUDA, Triton compiles a kernel variant the first time a launch shows it a
    new specialization (an integer argument that is 1, or divisible by 16, ...): a second
    or so each, which inside a timed run would be charged to the engine. One untimed pass
    of the same workload meets them all. The CPU has no JIT: bench_throughput skips it there."""
    engine.run([(f"warm{i}", r.prompt_token_ids, _sampling(r)) for i, r in enumerate(requests)])
    engine.runner.reset_requests()
    return RecordingEngine(engine.runner, scheduling)


def roofline(engine: RecordingEngine, peak_flops: float, bandwidth: float, dtype: torch.dtype, result: dict,
             quantization: str = "none") -> dict:
    """The run's roofline floor: per step max(FLOPs / peak, bytes / bandwidth), summed
    (int8 weights counted at one byte each); and its layer-by-layer floor, the products'
    and attention's bounds added (flops.py)."""
    flops = ModelFlops.from_config(engine.runner.config)
    model_bytes = ModelBytes.from_config(engine.runner.config, dtype, quantization)
    floor = serial = 0.0
    for s in engine.steps:
        product_flops = flops.product_flops(s.num_scheduled_tokens, s.num_sampled)
        attention_flops = flops.attention_flops(s.attention_pairs)
        weight_bytes = model_bytes.weight_bytes(s.num_sampled)
        kv_bytes = model_bytes.kv_bytes(s.num_scheduled_tokens, s.kv_tokens_read)
        floor += max((product_flops + attention_flops) / peak_flops, (weight_bytes + kv_bytes) / bandwidth)
        serial += (max(product_flops / peak_flops, weight_bytes / bandwidth)
                   + max(attention_flops / peak_flops, kv_bytes / bandwidth))
    return {
        "roofline_floor_seconds": floor,
        "roofline_fraction": floor / result["seconds"],  # 1.0 = as fast as this machine allows
        "mfu_at_roofline": result["model_tflop"] * 1e12 / (floor * peak_flops),
        "layerwise_floor_seconds": serial,
        "layerwise_fraction": serial / result["seconds"],
    }


def cluster_spec(model_dir: Path, args, insecure: bool = False):
    """A local cluster configured like the in-process engine of the same run (mutual TLS
    and an API key unless `insecure`)."""
    from llmserve.launcher.cluster import ClusterSpec, free_port

    return ClusterSpec(model_dir=model_dir, scheduler=args.engine.scheduler, worker=args.engine.worker,
                       router_port=free_port(), scheduler_port=free_port(), worker_port=free_port(),
                       log_level="WARNING", insecure=insecure)


class GrpcClusters:
    """The run's local clusters, one per security mode, each started at its first round
    and kept for the rest: a round's requests carry a cache salt of their own, so no round
    finds what an earlier one left in the prefix cache (as a fresh cluster would not), and
    the run pays one cluster start per mode (~10 s each on 2 cores), not one per round."""

    def __init__(self, model_dir: Path, args):
        self.model_dir, self.args = model_dir, args
        self._open: dict[bool, Any] = {}
        self._stack = contextlib.ExitStack()

    def get(self, insecure: bool):
        from llmserve.launcher.cluster import LocalCluster

        if insecure not in self._open:
            self._open[insecure] = self._stack.enter_context(LocalCluster(cluster_spec(self.model_dir, self.args,
                                                                                       insecure)))
        return self._open[insecure]

    def __enter__(self) -> GrpcClusters:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


def run_through_grpc(cluster, requests: list[BenchRequest], cache_salt: str) -> dict:
    """One round of the workload through a running cluster, its requests salted with
    `cache_salt` (each round its own: see GrpcClusters)."""

    cached = {}  # Request id -> prompt tokens it found in the prefix cache.

    async def one(client, rid: str, r: BenchRequest) -> tuple[str, list[int]]:
        ids = []
        async for delta in client.generate(token_ids=r.prompt_token_ids, max_tokens=r.output_len,
                                           temperature=0.0, ignore_eos=True, cache_salt=cache_salt):
            ids += delta.token_ids
            if delta.usage is not None:
                cached[rid] = delta.usage["cached_tokens"]
        return rid, ids

    async def run_all() -> tuple[float, dict]:
        async with cluster.client() as client:
            await one(client, "warmup", BenchRequest(requests[0].prompt_token_ids[:16], 2))
            start = time.perf_counter()
            results = await asyncio.gather(*(one(client, f"r{i}", r) for i, r in enumerate(requests)))
            return time.perf_counter() - start, dict(results)

    seconds, outputs = asyncio.run(run_all())
    out_tokens = sum(len(v) for v in outputs.values())
    return {"seconds": seconds, "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / seconds,
            "outputs": outputs, "cached_prompt_tokens": sum(cached.get(rid, 0) for rid in outputs)}


def _same_outputs(a: dict, b: dict) -> float:
    """Fraction of requests whose greedy tokens are identical."""
    return sum(a[k] == b.get(k) for k in a) / max(len(a), 1)


def _run_baseline(baseline: str, model_dir: Path, requests: list[BenchRequest], args, dtype: torch.dtype,
                  device: torch.device) -> dict:
    from llmserve.bench import hf_baseline

    if quant := llama_cpp.quant_of(baseline):
        # By device (None): the sequence cap our engine got on this run's device.
        seats = args.engine.scheduling.max_num_seqs or device_defaults(*device_facts(device))[1]
        settings = llama_cpp.server_settings(requests, max_slots=seats, threads=torch.get_num_threads())
        return llama_cpp.run_llama_cpp(llama_cpp.LlamaCppBuild(Path(args.llama_cpp_dir)), model_dir.name, quant,
                                       requests, settings)
    if baseline == "hf":
        return hf_baseline.run_hf_static(model_dir, requests, batch_size=args.hf_batch_size, dtype=dtype,
                                         device=device)
    try:
        return hf_baseline.run_hf_continuous(model_dir, requests, dtype=dtype, device=device)
    except Exception as err:  # Transformers' CB is young; report rather than lose the run.
        return {"error": f"{type(err).__name__}: {err}"}


# A baseline's paired ratios: the engine's, and each gRPC system's of the same round
# (what the targets compare: our stack over gRPC against llama.cpp); with labels.
RATIOS = {"engine_over_this": "engine/this", "grpc_over_this": "gRPC/this",
          "grpc_plaintext_over_this": "gRPC plaintext/this"}
_GRPC_RATIO = {"grpc": "grpc_over_this", "grpc-insecure": "grpc_plaintext_over_this"}


def _summarize_rounds(rounds: list[dict]) -> dict:
    """The round with the median throughput, carrying every round's figure."""
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return rounds[0]
    chosen = median_round(ok, key=lambda r: r["output_tokens_per_s"])
    chosen["rounds_output_tokens_per_s"] = [r["output_tokens_per_s"] for r in ok]
    if all("cached_prompt_tokens" in r for r in ok):
        chosen["rounds_cached_prompt_tokens"] = [r["cached_prompt_tokens"] for r in ok]
    for ratio in RATIOS:
        if ratio in chosen:
            chosen[f"rounds_{ratio}"] = [r[ratio] for r in ok if ratio in r]
            chosen[f"{ratio}_median"] = statistics.median(chosen[f"rounds_{ratio}"])
    return chosen


def _label(system: str, hf_batch_size: int) -> str:
    if quant := llama_cpp.quant_of(system):
        return llama_cpp.label(quant)
    return {"engine": "llmserve in-process", "grpc": "llmserve through gRPC (TLS)",
            "grpc-insecure": "llmserve through gRPC, plaintext", "hf-cb": "HF continuous batching",
            "hf": f"HF generate, static batch {hf_batch_size}"}[system]


def _baseline_systems(args, llama_cpp_quants: list[str]) -> list[str]:
    """--baseline's systems in order, llama-cpp as one system per GGUF precision."""
    systems = []
    for baseline in dict.fromkeys(args.baseline):
        systems += [llama_cpp.system_name(q) for q in llama_cpp_quants] if baseline == "llama-cpp" else [baseline]
    return systems


def _grpc_systems(args, round_index: int) -> list[str]:
    """The gRPC systems of a round: TLS, plaintext or both (in turns first, so that
    neither always runs on the machine the other just warmed)."""
    if not args.through_grpc:
        return []
    systems = ["grpc-insecure" if insecure else "grpc" for insecure in GRPC_SECURITY[args.grpc_security]]
    return systems if round_index % 2 == 0 else systems[::-1]


def _tls_cost(rounds: dict[str, list[dict]]) -> list[float]:
    """Per round: plaintext tokens/s over TLS tokens/s (1.05 = TLS costs 5%)."""
    pairs = zip(rounds.get("grpc", []), rounds.get("grpc-insecure", []))
    return [b["output_tokens_per_s"] / a["output_tokens_per_s"] for a, b in pairs if "error" not in a and "error" not in b]


def engine_device_and_precision(model_dir: Path, runner: RunnerConfig) -> tuple[torch.device, torch.dtype, str]:
    """Where the engine's runner will compute, in which dtype and with which quantization
    (the runner's own rules: auto = CUDA when there is one; its model's own dtype there; on
    the CPU, device.dtype_choice, which may choose int8 for a checkpoint stored quantized)."""
    from llmserve.gguf_checkpoint import quantized_weight_type
    from llmserve.worker.device import dtype_choice, resolve_device
    from llmserve.worker.models.loader import load_config

    device = resolve_device(runner.device)
    choice = dtype_choice(runner.dtype, device, load_config(model_dir), runner.quantization,
                          quantized_weight_type(model_dir))
    return device, choice.dtype, choice.quantization or runner.quantization


@dataclass
class _Run:
    """One `bench throughput` run: its workload, where the engine computes, and this
    machine's measured ceilings (for MFU and the roofline floor)."""

    args: Any
    model_dir: Path
    requests: list[BenchRequest]
    device: torch.device
    torch_dtype: torch.dtype
    quantization: str
    llama_cpp_quants: list[str]
    peak: float = 0.0  # FLOP/s of a matmul in torch_dtype (int8's under W8A8): the best probe's
    bandwidth: float = 0.0  # bytes/s, the best probe's
    probes: list = field(default_factory=list)  # (FLOP/s, bytes/s) of each probe

    def probe(self) -> None:
        """Measures the device's matmul peak and memory bandwidth now, keeping the best of
        all probes so far.

        NOTE: probed before the rounds and again after them, the best kept: on a shared
        2-core host one probe read 815-1,153 GFLOP/s in 6 of 16 runs where the others read
        2,035-2,355 (a neighbour on a core during its 1.5 s), and a floor from it made the
        same engine read 62-75% of its roofline instead of 40-51%."""
        sample = (measure_matmul_peak(self.torch_dtype, device=self.device, quantization=self.quantization),
                  measure_memory_bandwidth(device=self.device))
        self.probes.append(sample)
        self.peak, self.bandwidth = max(self.peak, sample[0]), max(self.bandwidth, sample[1])

    @property
    def dtype(self) -> str:
        return dtype_name(self.torch_dtype)


def bench_throughput(args) -> int:
    from llmserve.model_store import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    requests = workload_from_args(args, model_dir)
    device, torch_dtype, quantization = engine_device_and_precision(model_dir, args.engine.worker.runner)
    quants = llama_cpp.chosen_quants(args, dtype_name(torch_dtype), args.engine.worker.runner.quantization)
    # Before the engine's minutes: a baseline that cannot run says so now.
    llama_cpp.LlamaCppBuild(Path(args.llama_cpp_dir)).check(model_dir.name, quants)
    run = _Run(args, model_dir, requests, device, torch_dtype, quantization, quants)
    report = {"kind": "throughput", "workload": {"name": args.workload, **summary(requests)},
              "machine": machine_info(), "device": str(device), "dtype": run.dtype,
              "quantization": quantization, "command": " ".join(args.argv),
              "rounds": args.repeat, "results": {}}
    weights = "" if quantization == "none" else f" ({quantization} weights)"
    print(f"workload {args.workload}: {summary(requests)}; {run.dtype}{weights} on {device}; "
          f"{host_line(report['machine'])}", flush=True)
    # NOTE: first measured before the engine takes its share of the device's memory.
    run.probe()
    rounds, block_size = _run_rounds(run)
    report["matmul_peak_gflop_per_s"] = run.peak / 1e9
    report["memory_bandwidth_gb_per_s"] = run.bandwidth / 1e9
    report["probes"] = [{"matmul_peak_gflop_per_s": f / 1e9, "memory_bandwidth_gb_per_s": b / 1e9}
                        for f, b in run.probes]
    report["results"] = {system: _summarize_rounds(runs) for system, runs in rounds.items()}
    if tls_cost := _tls_cost(rounds):
        report["tls_cost_rounds"] = tls_cost  # Plaintext over TLS throughput, paired by round.
        print(f"TLS cost: plaintext / TLS throughput {statistics.median(tls_cost):.3f}x (rounds: "
              f"{', '.join(f'{c:.3f}' for c in tls_cost)})", flush=True)
    _print_summary(run, report["results"], block_size)
    print(host_line(report["machine"]), flush=True)
    compare = tuple(json.loads(Path(p).read_text()) for p in args.compare)
    if (out := report_dir(args.output_dir)) is not None:
        _write_report(report, out, args.workload, run.dtype, compare)
    failed = [system for system, runs in rounds.items() if any("error" in r for r in runs)]
    if failed:  # The others' figures stand (written above); a script must still see the failure.
        print(f"bench throughput: {', '.join(failed)} failed (see above)", flush=True)
        return 1
    return 0


def _run_rounds(run: _Run) -> tuple[dict[str, list[dict]], int]:
    """--repeat rounds of every system: system -> its runs, and the engine's block size.

    NOTE: rounds interleave the systems (engine, gRPC, baselines, engine, ...) so a change
    in the machine's load during the run lands on all of them, not on one."""
    scheduling = run.args.engine.scheduling
    engine = RecordingEngine(ModelRunner(run.model_dir, run.args.engine.worker.runner), scheduling)
    if run.device.type == "cuda":
        engine = compile_pass(engine, run.requests, scheduling)
    block_size = engine.scheduler.kv.block_size
    rounds: dict[str, list[dict]] = {}
    engine_rounds: list[tuple[dict, RecordingEngine]] = []  # (result, its steps): their floors at the end
    with GrpcClusters(run.model_dir, run.args) as clusters:
        for round_index in range(run.args.repeat):
            if round_index:  # A fresh scheduler: no prefix-cache hits on the previous round's prompts.
                engine = RecordingEngine(engine.runner, scheduling)
            result = run_in_process(engine, run.requests)
            engine_rounds.append((result, engine))
            rounds.setdefault("engine", []).append(result)
            _print_row(f"[{round_index + 1}] {_label('engine', run.args.hf_batch_size)}", result)
            this_round: dict[str, dict] = {}
            for system in _grpc_systems(run.args, round_index) + _baseline_systems(run.args, run.llama_cpp_quants):
                if system.startswith("grpc"):
                    this_round[system] = run_through_grpc(clusters.get(system == "grpc-insecure"), run.requests,
                                                          cache_salt=f"bench-throughput-round-{round_index}")
                else:
                    this_round[system] = _run_baseline(system, run.model_dir, run.requests, run.args,
                                                       run.torch_dtype, run.device)
                _pair_with_round(system, result, this_round)
                rounds.setdefault(system, []).append(this_round[system])
                if "error" in this_round[system]:
                    print(f"[{round_index + 1}] {system}: failed: {this_round[system]['error']}", flush=True)
                else:
                    _print_row(f"[{round_index + 1}] {_label(system, run.args.hf_batch_size)}", this_round[system])
    run.probe()
    for result, recorded in engine_rounds:
        result["mfu"] = result["achieved_gflop_per_s"] * 1e9 / run.peak
        result.update(roofline(recorded, run.peak, run.bandwidth, run.torch_dtype, result, run.quantization))
    return rounds, block_size


def _pair_with_round(system: str, engine_result: dict, this_round: dict[str, dict]) -> None:
    """Adds to a system's run (this_round[system]) its ratios to this round's engine run
    (and to this round's gRPC runs, for a baseline)."""
    result = this_round[system]
    if "error" in result:
        return
    if "outputs" in result:  # Token ids (llama-server streams text only).
        result["same_tokens_as_engine"] = _same_outputs(engine_result["outputs"], result["outputs"])
    # Paired with this round's engine run: the host's drift between rounds
    # cancels out of the ratio, not out of a ratio of two medians.
    result["engine_over_this"] = engine_result["output_tokens_per_s"] / result["output_tokens_per_s"]
    if not system.startswith("grpc"):  # gRPC ran first in the round: pair it too.
        for grpc_system, ratio in _GRPC_RATIO.items():
            grpc_run = this_round.get(grpc_system)
            if grpc_run is not None and "error" not in grpc_run:
                result[ratio] = grpc_run["output_tokens_per_s"] / result["output_tokens_per_s"]


def _print_summary(run: _Run, results: dict[str, dict], block_size: int) -> None:
    """The medians of several rounds, and the engine's MFU and roofline figures."""
    if run.args.repeat > 1:
        print(f"medians of {run.args.repeat} rounds:", flush=True)
        for system, result in results.items():
            if "error" not in result:
                _print_row(_label(system, run.args.hf_batch_size), result)
    engine = results["engine"]
    products = "int8 W8A8" if run.quantization == "int8" else run.dtype
    probes = " / ".join(f"{f / 1e9:.0f}" for f, _ in run.probes)
    print(f"matmul peak ({products} on {run.device}): {run.peak / 1e9:.0f} GFLOP/s (best of the probes before / "
          f"after the rounds: {probes}); engine achieved "
          f"{engine['achieved_gflop_per_s']:.0f} GFLOP/s = MFU {100 * engine['mfu']:.0f}%", flush=True)
    print(f"roofline (memory {run.bandwidth / 1e9:.0f} GB/s): floor {engine['roofline_floor_seconds']:.1f} s, "
          f"engine at {100 * engine['roofline_fraction']:.0f}% of it (layer by layer: floor "
          f"{engine['layerwise_floor_seconds']:.1f} s, {100 * engine['layerwise_fraction']:.0f}%); MFU at the floor "
          f"{100 * engine['mfu_at_roofline']:.0f}%; KV utilisation bound at block size {block_size}: "
          f"{100 * engine['kv_utilisation_bound']:.1f}%", flush=True)


def _write_report(report: dict, out: Path, workload: str, dtype: str, compare: tuple[dict, ...] = ()) -> None:
    """JSON (without the token ids) and a PNG of the systems that ran, beside the runs of
    `compare` (earlier reports: other hosts, other dtypes)."""
    for r in report["results"].values():
        r.pop("outputs", None)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    write_json(report, out / f"throughput-{workload}-{dtype}-{stamp}.json")
    plot_throughput({**report, "results": {k: v for k, v in report["results"].items() if "error" not in v}},
                    out / f"throughput-{workload}-{dtype}-{stamp}.png", compare)
    print(f"wrote {out}/throughput-{workload}-{dtype}-{stamp}.{{json,png}}", flush=True)


def _print_row(label: str, result: dict) -> None:
    """One system's figures; a system compared with the engine (a single round, or the
    median of several with every round's paired ratio) also prints that ratio."""
    line = f"{label:<34} {result['output_tokens']:>6} tokens in {result['seconds']:7.1f} s = " \
           f"{result['output_tokens_per_s']:7.1f} output tok/s"
    ratios = []
    for name, ratio_label in RATIOS.items():
        if name in result:
            ratio = result.get(f"{name}_median", result[name])
            rounds = ", ".join(f"{r:.2f}" for r in result.get(f"rounds_{name}", []))
            ratios.append(f"{ratio_label} {ratio:.2f}x" + (f" (median of rounds {rounds})" if rounds else ""))
    if "same_tokens_as_engine" in result:
        ratios.append(f"same tokens {100 * result['same_tokens_as_engine']:.0f}%")
    if ratios:
        line += "  " + ", ".join(ratios)
    if "kv_utilisation" in result:
        line += f"  KV utilisation {100 * result['kv_utilisation']:.1f}%, peak blocks {result['peak_blocks_in_use']}"
    print(line, flush=True)
