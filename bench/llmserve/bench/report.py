"""Benchmark results: machine facts, JSON files and a PNG plot."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch


def machine_info() -> dict:
    try:
        revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                  cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        revision = ""
    import transformers

    cpu = platform.processor() or platform.machine()
    flags: set[str] = set()
    try:
        first_cpu = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0]
        for line in first_cpu.splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        # The matrix instruction sets decide the bf16 figures (AMX: bf16 far above float32;
        # AVX-512 BF16 alone: measured below float32 on the same cores).
        "cpu_matrix_isa": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile"}),
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


def write_json(report: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))


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


def plot_throughput(report: dict, path: str | Path) -> None:
    """Bar chart of output tokens/s per system, labelled with the ratio to the engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    labels = list(results)
    values = [results[k]["output_tokens_per_s"] for k in labels]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bars = ax.barh(labels, values, color=["#2b6cb0" if k.startswith("engine") or k == "grpc" else "#a0aec0"
                                          for k in labels])
    for bar, value, key in zip(bars, values, labels):
        ratio = results[key].get("engine_over_this_median")
        text = f" {value:.0f}" + (f"  (engine = {ratio:.2f}x this)" if ratio else "")
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, text, va="center")
    ax.set_xlim(0, max(values) * 1.35)
    ax.set_xlabel("output tokens / s")
    w = report["workload"]
    ax.set_title(f"{w['name']}: {w['num_requests']} requests, {w['prompt_tokens']} prompt / "
                 f"{w['output_tokens']} output tokens ({report['dtype']})", fontsize=9)
    ax.invert_yaxis()
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
