"""int8 projections (`--quantization int8`, W8A8 where the CPU has VNNI, and
`int8-weight-only`): each quantized product against its reference and the float product,
what the loader quantizes, a tiny model's greedy agreement with float32, and the setting's
way to WorkerInfo and the public ModelInfo."""

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
from llmserve.kernels import cpu as cpu_kernels
from llmserve.worker.layers.int8_weight import (
    ACTIVATION_GROUP,
    MAX_KERNEL_ROWS,
    Int8Weight,
    describe_quantization,
    int8_linear_reference,
    int8pack_kernel_applies,
    quantize_rows,
    w8a8_linear_reference,
)
from llmserve.worker.layers.linear import QKVParallelLinear, RowParallelLinear
from llmserve.worker.models.loader import load_model
from tests.tiny_models import make_tiny_model

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


needs_vnni = pytest.mark.skipif(not cpu_kernels.w8a8_supported(),
                                reason="the W8A8 kernel needs a CPU with AVX-512 VNNI (and a compiler)")


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 33])
def test_w8a8_kernel_matches_its_reference(dtype, rows):
    # 80 output channels: one full tile of 3 blocks of 16, then 2 blocks on their own.
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(80, 192, generator=gen) * torch.rand(80, 1, generator=gen)
    x = (torch.randn(rows, 192, generator=gen) * torch.rand(1, 192, generator=gen) * 4).to(dtype)
    x[0, 70] = 300.0  # an outlier: it sets the scale of row 0's second group only
    x[-1, 128:] = 0.0  # a zero group: scale 0, contributes nothing
    q, scale = quantize_rows(w)
    weight = Int8Weight(q, scale, quantize_activations=True)
    assert weight.quantizes_activations and weight.q is None and torch.equal(weight.int8_rows(), q)
    bias = torch.randn(80, generator=gen).to(dtype)
    got = weight.matmul(x, bias)
    want = w8a8_linear_reference(x, q, scale, bias)
    assert got.dtype == dtype and got.shape == (rows, 80)
    # float32: the same integer sums, scaled in another order; bfloat16: y rounded to 8 bits.
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()
    # Each row is quantized and summed on its own, in a fixed order: a row's product does
    # not depend on the rows batched beside it, bit for bit.
    assert torch.equal(got[-1:], weight.matmul(x[-1:], bias)) and torch.equal(got[:1], weight.matmul(x[:1], bias))


@needs_vnni
def test_w8a8_kernel_rounds_activations_half_to_even_like_its_reference():
    # Group 0's max is 127, so its scale is 1 and x * 127 / max = x: the halves are ties.
    x = torch.zeros(3, 2 * ACTIVATION_GROUP)
    x[:, 0] = 127.0
    x[:, 1:9] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5])
    x[1:, ACTIVATION_GROUP:] = torch.linspace(-3.0, 3.0, ACTIVATION_GROUP)  # group 1: its own scale
    q, scale = quantize_rows(torch.eye(2 * ACTIVATION_GROUP)[:32])  # y[:, n] = xq[:, n] (n < 32)
    got = Int8Weight(q, scale, quantize_activations=True).matmul(x)
    want = w8a8_linear_reference(x, q, scale)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    assert got[0, 1:9].round().tolist() == [0.0, 2.0, 2.0, 0.0, -2.0, -2.0, 126.0, -126.0]


def test_w8a8_reference_scales_each_group_of_activations_on_its_own():
    x = torch.zeros(1, 2 * ACTIVATION_GROUP)
    x[0, 0], x[0, 1] = 127.0, 0.4  # group 0: scale 1, so 0.4 rounds to 0
    x[0, ACTIVATION_GROUP] = 0.4  # group 1: its own scale, 0.4 is kept exactly
    eye = torch.eye(2 * ACTIVATION_GROUP)
    q, scale = quantize_rows(eye)
    y = w8a8_linear_reference(x, q, scale)
    assert y[0, 0] == 127.0 and y[0, 1] == 0.0 and y[0, ACTIVATION_GROUP] == pytest.approx(0.4)
    # One scale per row would have rounded group 1's 0.4 away too: that is what groups buy.


def test_w8a8_refuses_what_it_cannot_run():
    assert not Int8Weight(torch.zeros(16, 64, dtype=torch.int8), torch.ones(16)).quantizes_activations
    if cpu_kernels.w8a8_supported():
        weight = Int8Weight(torch.zeros(16, 64, dtype=torch.int8), torch.ones(16), quantize_activations=True)
        with pytest.raises(ValueError, match="float32 or bfloat16"):
            weight.matmul(torch.zeros(1, 64, dtype=torch.float16))
        with pytest.raises(RuntimeError, match="multiple of 64"):
            cpu_kernels.w8a8_pack_weight(torch.zeros(16, 40, dtype=torch.int8))


@pytest.mark.parametrize("quantization", ["int8", "int8-weight-only"])
def test_loader_quantizes_exactly_the_projections(tiny_llama_dir, quantization):
    model = load_model(tiny_llama_dir, "bfloat16", quantization=quantization)
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
    assert torch.equal(qkv.int8.int8_rows()[rows], k_q) and torch.equal(qkv.weight_scale[rows], k_scale)
    assert qkv.int8 is not None and qkv.packed is None
    # W8A8 exactly where asked for and runnable (the tiny model's shapes fit the kernel).
    w8a8 = quantization == "int8" and cpu_kernels.w8a8_supported()
    assert all(m.int8.quantizes_activations == w8a8 for m in model.modules() if getattr(m, "int8", None))
    # The head's 300 rows are no multiple of 16: it keeps its float copy (next test: one that fits).
    assert model.lm_head.int8 is None and model.lm_head.w_packed is not None
    layers = 4 * model.config.num_hidden_layers
    assert describe_quantization(model, quantization) == (
        f"{quantization} (W8A8 in {layers if w8a8 else 0} of {layers} projections, weight-only in the rest)")


@needs_vnni
def test_w8a8_lm_head_multiplies_by_int8_rows_of_the_tied_embedding(tmp_path):
    model_dir = make_tiny_model(tmp_path, "llama", True, seed=3, vocab_size=320)
    model = load_model(model_dir, "bfloat16", quantization="int8")
    head, embed = model.lm_head, model.model.embed_tokens
    assert head.int8 is not None and head.w_packed is None and head.w_t.numel() == 0
    q, scale = quantize_rows(embed.weight)
    assert torch.equal(head.int8.int8_rows(), q) and torch.equal(head.int8.scale, scale)
    assert embed.weight.dtype == torch.bfloat16  # the embedding still reads the float rows
    hidden = torch.randn(5, 64).bfloat16()
    assert torch.allclose(model.compute_logits(hidden).float(), w8a8_linear_reference(hidden, q, scale).float(),
                          rtol=1e-2, atol=1e-2)
    projections = 4 * model.config.num_hidden_layers + 1
    assert describe_quantization(model, "int8") == (
        f"int8 (W8A8 in {projections} of {projections} projections, weight-only in the rest)")
    weight_only = load_model(model_dir, "bfloat16", quantization="int8-weight-only")
    assert weight_only.lm_head.int8 is None and weight_only.lm_head.w_packed is not None


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


@needs_vnni
def test_row_parallel_ranks_run_w8a8_on_their_own_columns():
    # in 128 split over 2 ranks: each rank quantizes its 64 columns of W and of x (one
    # activation group), and its partial product is W8A8 of those; the all-reduce sums them.
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(32, 128, generator=gen), torch.randn(3, 128, generator=gen)
    for rank in (0, 1):
        row = RowParallelLinear(128, 32, tp=GroupHandle.detached(2, rank), quantization="int8")
        row.weight_loader(row.weight, w)
        row.process_weights_after_loading()
        assert row.int8.quantizes_activations and row.weight.numel() == 0  # the packed copy is the weight
        columns = slice(64 * rank, 64 * (rank + 1))
        q, scale = quantize_rows(w[:, columns])
        torch.testing.assert_close(row.matmul(x[:, columns], None), w8a8_linear_reference(x[:, columns], q, scale),
                                   rtol=1e-5, atol=1e-5)


def test_tiny_model_greedy_agrees_with_float32(tiny_llama_dir):
    tokens = [random.Random(0).randrange(300) for _ in range(96)]
    reference = teacher_forced_logits(load_model(tiny_llama_dir, "float32"), tokens, chunk=16)
    # weight-only: the dequantized product (float32), then torch's int8 kernel (16-row
    # chunks); int8: the W8A8 kernel where the CPU has VNNI.
    for dtype, quantization in (("float32", "int8-weight-only"), ("bfloat16", "int8-weight-only"),
                                ("float32", "int8"), ("bfloat16", "int8")):
        model = load_model(tiny_llama_dir, dtype, quantization=quantization)
        logits = teacher_forced_logits(model, tokens, chunk=16)
        assert agreement(logits, reference) >= 0.9, (dtype, quantization)
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
    assert "--quantization {none,int8,int8-weight-only}" in capsys.readouterr().out
