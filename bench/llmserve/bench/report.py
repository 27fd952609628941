"""Benchmark results: machine facts, JSON files and a PNG plot."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from llmserve.kernels.cpu.host import cpu_facts


# The CPU flags that decide the products' speed: AVX-512 BF16 (bfloat16 dot products),
# VNNI (int8 dot products, our W8A8 kernel), AMX (tile matrix multiplies).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


def machine_info() -> dict:
    try:
        revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                  cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        revision = ""
    import transformers

    host = cpu_facts()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpu": host.model_name,
        # A virtual machine may name only the vendor ("AMD EPYC"): family and model tell the
        # core generation apart (AMD 25 = Zen 3/4, 26 = Zen 5; Intel 6 model 143 = Sapphire Rapids).
        "cpu_family_model": f"family {host.family} model {host.model}" if host.family is not None else None,
        "cores": os.cpu_count(),
        # The matrix instruction sets decide the bf16 and int8 figures (AMX: bf16 far above
        # float32; AVX-512 BF16 alone: measured below float32 on the same cores).
        "cpu_matrix_isa": [f for f in CPU_FLAGS if f in host.flags],
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cuda_version": torch.version.cuda,
        "gpu_memory_gib": (torch.cuda.get_device_properties(0).total_memory / 2**30
                           if torch.cuda.is_available() else None),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "git_revision": revision,
    }


def host_line(machine: dict) -> str:
    """The CPU a run measured, for the lines it prints: model, cores and CPU_FLAGS present."""
    isa = machine.get("cpu_matrix_isa") or []
    amx = "" if any(f.startswith("amx") for f in isa) else "; no AMX"
    generation = f"{machine['cpu_family_model']}, " if machine.get("cpu_family_model") else ""
    return f"host: {machine['cpu']} ({generation}{machine['cores']} cores): {' '.join(isa) or 'no AVX2'}{amx}"


def write_json(report: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))


def report_dir(output_dir: str | None) -> Path | None:
    """A bench's --output-dir: its folder, or None for '' (and None): no report written,
    in every bench alike (an empty Path is the working directory, where '' used to write)."""
    return Path(output_dir) if output_dir else None


def add_output_dir_flag(parser, what: str = "JSON goes here") -> None:
    """A bench's --output-dir (default bench-results/), where '' writes no report (report_dir)."""
    parser.add_argument("--output-dir", default="bench-results", help=f"{what} ('': none)")


def save_report(report: dict, output_dir: str | None, name: str) -> Path | None:
    """Writes a bench's JSON report to output_dir / name and says so; nothing for ''."""
    folder = report_dir(output_dir)
    if folder is None:
        return None
    path = folder / name
    write_json(report, path)
    print(f"wrote {path}", flush=True)
    return path


def model_label(model_dir: str | Path) -> str:
    """A random model's preset (its random-model.json, from `bench make-model`), else the
    directory's name: what reports call the model."""
    made = Path(model_dir) / "random-model.json"
    return json.loads(made.read_text())["preset"] if made.is_file() else Path(model_dir).name


def median_round(rounds: list[dict], key) -> dict:
    """A copy of the round whose `key(round)` is the median (of an even count, the lower
    middle one): a run that actually happened, not an average of several."""
    ranked = sorted(rounds, key=key)
    return dict(ranked[(len(ranked) - 1) // 2])


# Ours in blues, HF in greys, llama.cpp (one system per GGUF precision) in oranges.
SYSTEM_COLORS = {"engine": "#2b6cb0", "grpc": "#63b3ed", "grpc-insecure": "#90cdf4", "hf": "#a0aec0",
                 "hf-cb": "#718096"}
LLAMA_CPP_COLORS = ("#dd6b20", "#f6ad55", "#c05621", "#fbd38d")


def _run_label(report: dict) -> str:
    """A group's label: the host's CPU and flags, the dtype, the engine's roofline share."""
    machine, engine = report["machine"], report["results"].get("engine", {})
    isa = [f for f in machine.get("cpu_matrix_isa", []) if f.startswith(("amx_bf16", "avx512_bf16", "avx512_vnni"))]
    share = f", {100 * engine['roofline_fraction']:.0f}% of roofline" if "roofline_fraction" in engine else ""
    return f"{machine['cpu'][:28]}\n{' '.join(isa)}\n{report['dtype']}{share}"


def plot_throughput(report: dict, path: str | Path, compare: tuple[dict, ...] = ()) -> None:
    """Grouped bars of output tokens/s: one group per run (this one, then `compare`: earlier
    reports of the same workload, e.g. from another host kind), one bar per system in
    it (engine in process, through gRPC, the baselines), each labelled with its tok/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [report, *({**r, "results": {k: v for k, v in r["results"].items() if "error" not in v}} for r in compare)]
    systems = list(dict.fromkeys(k for r in runs for k in r["results"]))
    width = 0.8 / len(systems)
    llama = [k for k in systems if k not in SYSTEM_COLORS]
    colors = {**SYSTEM_COLORS, **{k: LLAMA_CPP_COLORS[i % len(LLAMA_CPP_COLORS)] for i, k in enumerate(llama)}}
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(runs) + 1.5), 4.2))
    for i, system in enumerate(systems):
        xs = [g + (i - (len(systems) - 1) / 2) * width for g, r in enumerate(runs) if system in r["results"]]
        values = [r["results"][system]["output_tokens_per_s"] for r in runs if system in r["results"]]
        bars = ax.bar(xs, values, width, label=system, color=colors[system])
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(runs)), [_run_label(r) for r in runs], fontsize=7)
    ax.set_ylabel("output tokens / s")
    w = report["workload"]
    ax.set_title(f"{w['name']}: {w['num_requests']} requests, {w['prompt_tokens']} prompt / "
                 f"{w['output_tokens']} output tokens", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_latency(report: dict, path: str | Path) -> None:
    """TTFT / TPOT / ITL / E2E percentiles of an online run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = report["metrics"]
    names = ["ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"]
    stats = ["mean", "median", "p99"]
    fig, axes = plt.subplots(1, len(names), figsize=(11, 3))
    for ax, name in zip(axes, names):
        ax.bar(stats, [metrics[name][s] for s in stats], color=["#a0aec0", "#2b6cb0", "#c53030"])
        ax.set_title(name.replace("_ms", " (ms)"))
    fig.suptitle(f"online: request rate {report['request_rate']}, max concurrency {report['max_concurrency']}",
                 fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
