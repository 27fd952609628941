"""The ModelRunner on the device: weights, KV cache, sampler and step tensors live there;
`--dtype auto` takes the checkpoint's own dtype on CUDA (float32 on the CPU); without a
block count the KV cache is sized from the device's memory after a profiling forward and
the decode graphs' pool."""

from __future__ import annotations

import json
import shutil

import torch

from llmserve.contract.plan import StepPlan
from llmserve.worker import kv_cache as kvc
from llmserve.worker.config import RunnerConfig
from llmserve.worker.cpu_dtype import choose_cpu_dtype
from llmserve.worker.model_runner import ModelRunner
from tests.worker.conftest import PlanDriver

from .conftest import DEVICE, GPU, ON_CUDA

pytestmark = GPU


def test_everything_lives_on_the_device(tiny_llama_dir):
    runner = ModelRunner(tiny_llama_dir, RunnerConfig(device=DEVICE.type, num_kv_blocks=16, swap_space=0,
                                                      max_num_seqs=4))
    assert runner.device.type == DEVICE.type and runner.dtype == torch.float32  # the checkpoint's own
    tensors = [*runner.model.parameters(), *runner.model.buffers(), *runner.kv_caches]
    assert {t.device.type for t in tensors if t.numel()} == {DEVICE.type}
    assert runner.sampler.generator.device.type == DEVICE.type
    assert runner.attention_backend.__name__ == ("TritonPagedAttention" if ON_CUDA else "TorchPagedAttention")
    seen = []
    build_inputs = runner.batch.build_inputs

    def spy(rows, prev_sampled=None):
        inp = build_inputs(rows, prev_sampled)
        seen.append(inp)
        return inp

    runner.batch.build_inputs = spy
    d = PlanDriver(runner, 16, 16)
    d.add("a", list(range(3, 30)))
    d.step({"a": None})
    d.step({"a": 1}, num_steps=3)
    assert len(d.outputs("a")) == 4
    assert all(t.device.type == DEVICE.type for inp in seen
               for t in (inp.input_ids, inp.positions, inp.sample_indices, inp.meta.slot_mapping))


def test_auto_dtype_is_the_checkpoints_own_on_cuda(tiny_llama_dir, tmp_path):
    model_dir = shutil.copytree(tiny_llama_dir, tmp_path / "bf16-checkpoint")
    config = json.loads((model_dir / "config.json").read_text())
    config["dtype"] = "bfloat16"  # what a bfloat16 checkpoint says (its tensors stay float32 here)
    (model_dir / "config.json").write_text(json.dumps(config))
    runner = ModelRunner(model_dir, RunnerConfig(device=DEVICE.type, num_kv_blocks=16, swap_space=0,
                                                 max_num_seqs=4))
    # On the CPU, auto decides from the host's instruction sets (choose_cpu_dtype).
    want = torch.bfloat16 if ON_CUDA else choose_cpu_dtype(torch.bfloat16).dtype
    assert runner.dtype == want and runner.info.dtype == str(want).removeprefix("torch.")
    assert all(c.dtype == want for c in runner.kv_caches)
    assert {p.dtype for p in runner.model.parameters() if p.numel()} == {want}
    assert runner.execute(StepPlan(0)).sampled == []


def test_kv_blocks_from_the_device_memory_budget(tiny_llama_dir, caplog):
    block_bytes = kvc.bytes_per_block(16, 2, 16, 3, torch.float32)
    share, host_budget = 0.05, 8 * 2**20  # on CUDA: 5% of the device; on the CPU: 8 MiB
    settings = RunnerConfig(device=DEVICE.type, swap_space=0, max_num_batched_tokens=64, max_num_seqs=8,
                            gpu_memory_utilization=share, kv_cache_memory=None if ON_CUDA else host_budget)
    with caplog.at_level("INFO"):
        runner = ModelRunner(tiny_llama_dir, settings)
    assert "64-token dummy forward" in caplog.text
    if not ON_CUDA:
        assert runner.num_kv_blocks == host_budget // block_bytes
        return
    total = torch.cuda.mem_get_info(runner.device)[1]
    assert 0 < runner.num_kv_blocks * block_bytes <= share * total
    # The graphs were captured once against a scratch cache to measure them, then for good.
    assert "CUDA graphs of the decode step" in caplog.text and runner.graphs is not None and runner.graphs.sizes == [1, 2, 4, 8]
    d = PlanDriver(runner, 16, runner.num_kv_blocks)
    d.add("a", [5, 6, 7])
    d.step({"a": None})
    d.step({"a": 1}, num_steps=2)
    assert len(d.outputs("a")) == 3
