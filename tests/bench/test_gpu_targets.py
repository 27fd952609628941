"""Issue #31's GPU figures, run here on the CPU: the physical ceilings' arithmetic, the
8B-shaped random model, `bench offline` and `bench decode-floor` in process on a tiny
model, and gpu_check.sh's dry run of its new steps (`bench loops` included) end to end."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from llmserve.bench.ceiling import decode_floor, offline_ceiling
from llmserve.bench.random_model import PRESETS, make_random_model, parameter_shapes, shard_names
from llmserve.worker.config import RunnerConfig

REPO = Path(__file__).resolve().parents[2]
H100 = {"peak": 989e12, "bandwidth": 3.35e12}  # The datasheet figures the issue's ceilings use.


def _config(preset: str):
    from transformers import LlamaConfig

    return LlamaConfig(**PRESETS[preset])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_random_model(tmp_path_factory.mktemp("random-tiny"), "tiny", seed=5)


def test_the_ceilings_are_the_issue_s_at_the_datasheet_figures():
    one_b = offline_ceiling(_config("llama-1b"), torch.bfloat16, 1000, 1024, 128, **H100)
    eight_b = offline_ceiling(_config("llama-8b"), torch.bfloat16, 1000, 1024, 128, **H100)
    # ~53k and ~7.6k output tok/s (issue #31); both compute-bound.
    assert round(one_b["output_tokens_per_s"]) == 52_875 and one_b["bound"] == "compute"
    assert round(eight_b["output_tokens_per_s"]) == 7_650 and eight_b["bound"] == "compute"
    assert one_b["seconds"] == max(one_b["compute_s"], one_b["memory_s"]) and one_b["memory_s"] > 1.0
    assert eight_b["total_tokens_per_s"] == pytest.approx(eight_b["output_tokens_per_s"] * (1024 + 128) / 128)


def test_the_decode_floor_at_batch_1_is_the_weights_and_the_kv_read_once():
    floor = decode_floor(_config("llama-1b"), torch.bfloat16, 1, 1024, **H100)
    # Every parameter but the norm gains (the tied head is read as the LM head), and the K/V
    # of 1,025 tokens: 16 layers x K and V x 8 heads x 64 x 2 bytes each.
    weights = 1_235_814_400 - 2048 * 33
    assert floor["memory_s"] == pytest.approx((2 * weights + 16 * 2 * 8 * 64 * 2 * 1025) / 3.35e12)
    assert floor["bound"] == "memory" and floor["seconds"] == floor["memory_s"]
    assert decode_floor(_config("llama-1b"), torch.bfloat16, 256, 1024, 1e12, 3.35e12)["bound"] == "compute"


def test_the_8b_preset_has_llama_3_1_8b_s_parameter_count_and_an_untied_head():
    shapes = parameter_shapes(_config("llama-8b"))
    assert shapes["lm_head.weight"] == (128256, 4096)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (1024, 4096)
    assert sum(math.prod(s) for s in shapes.values()) == 8_030_261_248


def test_shards_cut_between_tensors_and_a_large_tensor_stands_alone():
    shapes = {"a": (4,), "b": (4,), "c": (10,), "d": (2,)}
    assert shard_names(shapes, 2, shard_bytes=16) == [["a", "b"], ["c"], ["d"]]
    assert shard_names(shapes, 2, shard_bytes=2**20) == [["a", "b", "c", "d"]]


def test_a_sharded_untied_random_model_loads_in_hf_and_in_our_runner(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmserve.worker.model_runner import ModelRunner

    made = make_random_model(tmp_path, "tiny-untied", seed=1, shard_bytes=64 * 1024)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert made["files"] == len(files) > 1 and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == made["bytes"] == 2 * made["parameters"]
    with safe_open(str(tmp_path / index["weight_map"]["lm_head.weight"]), "pt") as f:
        head = f.get_tensor("lm_head.weight")
    assert head.dtype == torch.bfloat16 and abs(head.float().std().item() - 0.02) < 0.003  # Drawn in bf16.
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert torch.equal(hf.lm_head.weight, head.float())
    assert not torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)
    runner = ModelRunner(tmp_path, RunnerConfig(device="cpu", dtype="float32", num_kv_blocks=8, swap_space=0))
    assert runner.config.tie_word_embeddings is False
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)  # For the router: one word per id.
    assert tokenizer.decode([5, 17]) == "<t5> <t17>" and tokenizer.eos_token_id == 2


def test_offline_runs_each_sampling_mode_against_the_ceiling(tiny_model):
    from llmserve.bench.offline import OfflineWorkload, measure_offline
    from llmserve.scheduler.config import SchedulerConfig

    saved = []
    body = measure_offline(Path(tiny_model["dir"]), RunnerConfig(device="cpu", dtype="float32",
                                                                 kv_cache_memory=8 * 2**20, swap_space=0),
                           SchedulerConfig(), OfflineWorkload(4, 20, 3), ["greedy", "sampled"], warmup=1,
                           save=lambda b: saved.append(sorted(b["results"])), calibrate_s=0.05)
    assert saved == [["greedy"], ["greedy", "sampled"]]  # Written after each mode.
    assert body["workload"] == {"num_prompts": 4, "input_len": 20, "output_len": 3, "seed": 0, "warmup_prompts": 1}
    for r in body["results"].values():
        assert r["output_tokens"] == 12 and r["num_steps"] >= 3 and r["num_preemptions"] == 0
        assert r["share_of_ceiling"] == pytest.approx(body["ceiling"]["seconds"] / r["seconds"])
        assert r["total_tokens_per_s"] == pytest.approx(r["output_tokens_per_s"] * (20 + 3) / 3)
        assert r["requests_per_s"] == pytest.approx(4 / r["seconds"])


def test_decode_floor_times_each_batch_against_its_floor(tiny_model):
    from llmserve.bench.decode_floor import WARMUP_STEPS, measure_decode_floor

    result = measure_decode_floor(tiny_model["dir"], RunnerConfig(device="cpu", dtype="float32"), [1, 3],
                                  context=16, steps=2, calibrate_s=0.05)
    assert sorted(result["batches"]) == [1, 3] and not result["uses_graphs"]
    for batch, row in result["batches"].items():
        # The prompt, then one token computed per warm-up step and per timed step before the middle one.
        assert row["mean_context"] == 16 + WARMUP_STEPS + 1
        assert row["tok_per_s"] == pytest.approx(batch * 1000 / row["step_ms"])
        assert row["share_of_floor"] == pytest.approx(row["floor_ms"] / row["step_ms"])
    assert result["loop"] == "serial" and all("serial_step_ms" not in row for row in result["batches"].values())
    # The pipelined loop (CUDA's, by device), with the serial loop's step timed beside it.
    piped = measure_decode_floor(tiny_model["dir"], RunnerConfig(device="cpu", dtype="float32"), [2], context=16,
                                 steps=2, calibrate_s=0.05, pipelined=True)
    assert piped["loop"] == "pipelined" and piped["batches"][2]["serial_step_ms"] > 0


@pytest.mark.slow
def test_gpu_check_dry_run_of_the_issue_31_steps(tmp_path):
    """The script's new steps on the CPU, as a GPU session runs them: tiny models, few
    prompts, two clusters for the loops; the targets SKIP, nothing FAILs."""
    steps = ["offline-1b", "decode-floor-1b", "loops", "offline-8b", "decode-floor-8b"]
    env = {**os.environ, "OUT": str(tmp_path / "out"), "LLMSERVE_GPU_CHECK_SCRATCH": str(tmp_path / "scratch")}
    r = subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh"), "--device", "cpu", "--install", "none",
                        "--python", sys.executable, "--only", ",".join(steps)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    ran = dict(line.split("\t")[:2] for line in (tmp_path / "out/steps.tsv").read_text().splitlines())
    assert all(ran[s] == "0" for s in [*steps, "make-model", "make-model-8b"]) and ran["gpu-tests"] == "only"
    rows = {row["check"]: row["result"] for row in json.loads((tmp_path / "out/summary.json").read_text())}
    assert rows["offline tiny, 6 x 24/4, sampled >= 50% of the ceiling"] == "SKIP"
    assert rows["offline tiny-untied, 6 x 24/4, greedy >= 50% of the ceiling"] == "SKIP"
    assert rows["decode tiny-untied, context 24, batch 1 >= 60% of the floor"] == "SKIP"
    assert rows["pipelined loop over serial, batch 4"] == "INFO"
    assert "FAIL" not in rows.values()


@pytest.mark.slow
def test_gpu_check_runs_the_cpu_kernel_tests_apart_and_packs_its_results(tmp_path):
    """host-cpu: the CPU kernels' tests in a pytest of their own, judged from their JUnit
    report; --pack: a device call brings back at most 8 files, so everything but the
    summary leaves in one archive."""
    # (Six of the step's tests, by pytest's own variable: the step's wiring is what is tested.)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "LLMSERVE_GPU_CHECK_SCRATCH": str(tmp_path / "scratch"),
           "PYTEST_ADDOPTS": "-k 'float32_products_match_float64 and shape0'"}
    r = subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh"), "--device", "cpu", "--install", "none",
                        "--python", sys.executable, "--only", "host-cpu", "--pack"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["gpu-check.tar.gz", "summary.json", "summary.md"]
    with tarfile.open(out / "gpu-check.tar.gz") as tar:
        names = {name.removeprefix("./") for name in tar.getnames()}
        steps = tar.extractfile("./steps.tsv").read().decode()
    assert {"steps.tsv", "environment.txt", "host-cpu.xml", "logs/host-cpu.log"} <= names
    assert "host-cpu\t0\t" in steps and "gpu-tests\tonly\t0" in steps
    rows = {row["check"]: row for row in json.loads((out / "summary.json").read_text())}
    host = rows["CPU kernel tests on the host's CPU"]
    passed, _, failed, _, skipped, _ = host["figure"].split()
    # Passed where this CPU has AVX-512 F, skipped where not; counted from the JUnit report.
    assert host["result"] == "PASS" and int(failed) == 0 and int(passed) + int(skipped) == 6, host


def test_decode_floor_refuses_a_context_the_model_cannot_hold(tiny_model):
    # The tiny model holds 1,024 tokens: a 1,024-token context leaves no room to decode,
    # which divided by zero running sequences before.
    from llmserve.bench.decode_floor import measure_decode_floor

    with pytest.raises(ValueError, match="a context of 1024 tokens and .* more to generate exceed the model's "
                                         "1024-token length"):
        measure_decode_floor(tiny_model["dir"], RunnerConfig(device="cpu", dtype="float32"), [1], context=1024,
                             steps=2, calibrate_s=0.05)


def test_save_report_writes_into_its_folder_and_nothing_for_an_empty_one(tmp_path, monkeypatch, capsys):
    from llmserve.bench.report import save_report

    monkeypatch.chdir(tmp_path)
    assert save_report({"a": 1}, "", "r.json") is None and save_report({"a": 1}, None, "r.json") is None
    assert list(tmp_path.iterdir()) == []  # '' used to mean the working directory for most benches
    path = save_report({"a": 1}, str(tmp_path / "out"), "r.json")
    assert path == tmp_path / "out" / "r.json" and json.loads(path.read_text()) == {"a": 1}
    assert capsys.readouterr().out == f"wrote {path}\n"


def test_a_bench_given_an_empty_output_dir_writes_nothing(tiny_model, tmp_path):
    r = subprocess.run([sys.executable, "-m", "llmserve.cli", "--log-level", "WARNING", "bench", "decode-floor",
                        "--model", tiny_model["dir"], "--device", "cpu", "--dtype", "float32", "--batch", "1",
                        "--context", "16", "--steps", "2", "--calibrate-s", "0.05", "--output-dir", ""],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "of floor" in r.stdout and "wrote" not in r.stdout
    assert list(tmp_path.iterdir()) == []
