"""Weight-only int8 (`--quantization int8`): the quantized product against its reference
and the float product, what the loader quantizes, a tiny model's greedy agreement with
float32, and the setting's way to WorkerInfo and the public ModelInfo."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from llmserve.bench.quality import agreement, teacher_forced_logits
from llmserve.contract.wire import worker_info_from_pb, worker_info_to_pb
from llmserve.worker.distributed import GroupHandle
from llmserve.worker.layers.int8_weight import (
    MAX_KERNEL_ROWS,
    Int8Weight,
    int8_linear_reference,
    int8pack_kernel_applies,
    quantize_rows,
)
from llmserve.worker.layers.linear import QKVParallelLinear, RowParallelLinear
from llmserve.worker.models.loader import load_model

PROJECTIONS = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")


def test_quantize_rows_is_symmetric_per_row():
    w = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [3.0, 1.5, -0.03]])
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert scale.tolist() == pytest.approx([1.0 / 127, 1.0, 3.0 / 127])  # a zero row: scale 1, q 0
    assert q[0].tolist() == [64, -127, 32] and q[1].tolist() == [0, 0, 0] and q[2, 0] == 127


@pytest.mark.parametrize("dtype, rows", [(torch.bfloat16, 1), (torch.bfloat16, 16), (torch.bfloat16, 100),
                                         (torch.float32, 4)])
def test_int8_product_matches_reference_and_float(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 160, generator=gen) * torch.rand(96, 1, generator=gen)  # rows of varied range
    x = torch.randn(rows, 160, generator=gen)
    q, scale = quantize_rows(w)
    # The kernel (decode-sized bfloat16 batches) or the dequantized product (prefill, float32).
    assert int8pack_kernel_applies(x.to(dtype)) == (dtype == torch.bfloat16 and rows <= MAX_KERNEL_ROWS)
    got = Int8Weight(q, scale).matmul(x.to(dtype)).float()
    want = int8_linear_reference(x, q, scale)  # float32
    # bfloat16: x and the scales rounded to 8 bits of mantissa, sums in float32.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got - want).abs().max() <= tol * want.abs().max()
    # Against the float weight: each weight is off by at most scale/2, so each output by
    # at most sum_k |x_k| * scale_row / 2.
    bound = x.abs().sum(-1, keepdim=True) * scale[None, :] / 2 + 1e-4  # [rows, out]
    assert ((want - F.linear(x, w)).abs() <= bound).all()
    assert (got - F.linear(x, w)).abs().max() <= 0.05 * F.linear(x, w).abs().max()


def test_loader_quantizes_exactly_the_projections(tiny_llama_dir):
    model = load_model(tiny_llama_dir, "bfloat16", quantization="int8")
    int8 = {n for n, p in model.named_parameters() if p.dtype == torch.int8}
    assert int8 == {n for n, _ in model.named_parameters() if n.endswith(PROJECTIONS)}
    assert len(int8) == 4 * model.config.num_hidden_layers
    # Embeddings (and the tied LM head), norms: the model dtype.
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.lm_head.weight.dtype == torch.bfloat16 and model.model.norm.weight.dtype == torch.bfloat16
    # The fused qkv rows hold each checkpoint tensor quantized on its own.
    ckpt = load_file(tiny_llama_dir / "model.safetensors")
    qkv = model.model.layers[1].self_attn.qkv_proj
    k_q, k_scale = quantize_rows(ckpt["model.layers.1.self_attn.k_proj.weight"])
    rows = slice(qkv.q_size, qkv.q_size + qkv.kv_size)
    assert torch.equal(qkv.weight[rows], k_q) and torch.equal(qkv.weight_scale[rows], k_scale)
    assert qkv.int8 is not None and qkv.packed is None


def test_tensor_parallel_ranks_quantize_their_own_shard():
    # 4 q heads, 2 kv heads, head_dim 2, hidden 3, on rank 1 of 2: q rows 4-7, kv head 1.
    gen = torch.Generator().manual_seed(0)
    full_q, full_k, full_v = (torch.randn(n, 3, generator=gen) for n in (8, 4, 4))
    qkv = QKVParallelLinear(3, 2, 4, 2, tp=GroupHandle.detached(2, 1), quantization="int8")
    for shard, full in (("q", full_q), ("k", full_k), ("v", full_v)):
        qkv.weight_loader(qkv.weight, full, shard)
    want_q, want_scale = quantize_rows(torch.cat([full_q[4:8], full_k[2:4], full_v[2:4]]))
    assert torch.equal(qkv.weight, want_q) and torch.equal(qkv.weight_scale, want_scale)
    # Row-parallel: rank 1 keeps columns 2-3; its scales come from those columns alone.
    w = torch.tensor([[100.0, -50.0, 1.0, 0.5], [3.0, 2.0, -0.2, 0.1]])
    row = RowParallelLinear(4, 2, tp=GroupHandle.detached(2, 1), quantization="int8")
    row.weight_loader(row.weight, w)
    assert row.weight_scale.tolist() == pytest.approx([1.0 / 127, 0.2 / 127])


def test_tiny_model_greedy_agrees_with_float32(tiny_llama_dir):
    tokens = [random.Random(0).randrange(300) for _ in range(96)]
    reference = teacher_forced_logits(load_model(tiny_llama_dir, "float32"), tokens, chunk=16)
    for dtype in ("float32", "bfloat16"):  # the dequantized product, then the int8 kernel (16-row chunks)
        logits = teacher_forced_logits(load_model(tiny_llama_dir, dtype, quantization="int8"), tokens, chunk=16)
        assert agreement(logits, reference) >= 0.9, dtype
        assert (logits - reference).abs().max() < 0.05 * reference.abs().max()  # measured: 1.2-1.7%


def test_runner_reports_quantization_through_worker_info_and_model_info(tiny_llama_dir):
    from llmserve.router.service import _model_info
    from llmserve.worker.config import RunnerConfig
    from llmserve.worker.model_runner import ModelRunner

    runner = ModelRunner(tiny_llama_dir, RunnerConfig(num_kv_blocks=16, swap_space=0, quantization="int8"))
    assert runner.dtype == torch.bfloat16  # --dtype auto on the CPU, with int8 weights
    info = worker_info_from_pb(worker_info_to_pb(runner.info))
    assert info.quantization == "int8" and info.dtype == "bfloat16"
    served = SimpleNamespace(name="tiny", max_model_len=info.max_model_len, vocab_size=info.vocab_size)
    public = _model_info(served, info, info.num_kv_blocks, SimpleNamespace(eos_token_ids=[2]))
    assert public.quantization == "int8" and public.dtype == "bfloat16"


def test_the_setting_parses_and_is_documented(capsys):
    from llmserve.cli import build_parser, load_commands
    from llmserve.settings import resolve

    args = build_parser().parse_args(["worker", "--quantization", "int8"])
    assert resolve(load_commands()["worker"].config, args).runner.quantization == "int8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--quantization", "int4"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--help"])
    assert "--quantization {none,int8}" in capsys.readouterr().out
