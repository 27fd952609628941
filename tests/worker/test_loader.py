"""Loader errors, dtype selection, rotary configuration."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmserve.contract.startup_errors import StartupError
from llmserve.worker.distributed import GroupHandle
from llmserve.worker.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from llmserve.worker.layers.rotary import RotaryEmbedding, rope_parameters
from llmserve.worker.models.loader import load_model
from llmserve.worker.models.registry import model_class


def _copy_with(src, dst, edit):
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})
    return dst


def test_missing_and_unexpected_weights(tiny_llama_dir, tmp_path):
    missing = _copy_with(tiny_llama_dir, tmp_path / "m",
                         lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing.*layers\.1\.self_attn\.qkv_proj"):
        load_model(missing)
    extra = _copy_with(tiny_llama_dir, tmp_path / "x", lambda t: t.update({"model.foo.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match="unexpected.*model.foo.weight"):
        load_model(extra)


def test_untied_checkpoint_without_lm_head_is_an_error(tiny_llama_dir, tmp_path):
    d = shutil.copytree(tiny_llama_dir, tmp_path / "u")
    cfg = json.loads((d / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_model(d)


def test_unknown_architecture():
    with pytest.raises(StartupError, match=r"^unsupported model architecture GPT2LMHeadModel$") as info:
        model_class(SimpleNamespace(architectures=["GPT2LMHeadModel"]))
    assert "LlamaForCausalLM" in info.value.fix  # The fix names what does run.


def test_bfloat16_close_to_float32(tiny_llama_dir):
    from llmserve.worker.attention import TorchPagedAttention
    from llmserve.worker.layers.packed_weight import bfloat16_gemm, float32_gemm, mkl_packing_available

    outs = []
    for dtype in ("float32", "bfloat16"):
        m = load_model(tiny_llama_dir, dtype)
        # On CPU every product runs on a packed weight in the layout timed fastest on this
        # machine, and the layers' dense copies are released. (The tiny head's 300 rows
        # are no multiple of our kernels' 16-channel blocks: a library takes it, oneDNN
        # for bfloat16, MKL where torch has it for float32.)
        kind = {"float32": float32_gemm(), "bfloat16": bfloat16_gemm()}[dtype]
        qkv = m.model.layers[0].self_attn.qkv_proj
        assert qkv.packed.kind == kind
        library = "mkl" if dtype == "float32" and mkl_packing_available() else "onednn"
        assert m.lm_head.w_packed.kind == (library if kind == "tiles" else kind)
        assert m.lm_head.w_packed.dtype == qkv.packed.dtype == getattr(torch, dtype)
        assert qkv.weight.numel() == 0 and m.lm_head.w_t.numel() == 0
        cfg = m.config
        kv = [torch.zeros(2, 4, 16, 2, 16, dtype=getattr(torch, dtype)) for _ in range(cfg.num_hidden_layers)]
        meta = TorchPagedAttention.build_metadata([10], [10], [[2]], torch.arange(32, 42), 16)
        with torch.inference_mode():
            outs.append(m.compute_logits(m(torch.arange(3, 13), torch.arange(10), kv, meta)).float())
    assert outs[1].dtype == torch.float32
    assert (outs[0] - outs[1]).abs().max() < 0.15 * outs[0].abs().max()


def test_rope_parameters_and_errors():
    old = SimpleNamespace(rope_theta=5e5, rope_scaling=None)
    assert rope_parameters(old) == {"rope_theta": 5e5, "rope_type": "default"}
    new = SimpleNamespace(rope_parameters={"rope_theta": 1e5, "rope_type": "default"})
    assert rope_parameters(new)["rope_theta"] == 1e5
    with pytest.raises(ValueError, match="unsupported rope_type 'mrope'"):
        RotaryEmbedding(64, 128, {"rope_type": "mrope", "rope_theta": 1e4})


def test_tp_weight_loaders_narrow_to_rank_shard():
    # 4 q heads, 2 kv heads, head_dim 2, on rank 1 of 2: q heads 2-3, kv head 1
    full_q, full_k = torch.arange(8.0).view(8, 1), torch.arange(100.0, 104.0).view(4, 1)
    qkv = QKVParallelLinear(1, 2, 4, 2, tp=GroupHandle.detached(2, 1))
    qkv.weight_loader(qkv.weight, full_q, "q")
    qkv.weight_loader(qkv.weight, full_k, "k")
    qkv.weight_loader(qkv.weight, full_k + 10, "v")
    assert qkv.weight.flatten().tolist() == [4, 5, 6, 7, 102, 103, 112, 113]
    # 1 kv head, tp 2: the kv head is replicated on both ranks
    rep = QKVParallelLinear(1, 2, 4, 1, tp=GroupHandle.detached(2, 1))
    rep.weight_loader(rep.weight, full_k[:2], "k")
    assert rep.weight[4:6].flatten().tolist() == [100, 101]
    gu = MergedColumnParallelLinear(1, [4, 4], tp=GroupHandle.detached(2, 1))
    gu.weight_loader(gu.weight, torch.arange(4.0).view(4, 1), 0)
    gu.weight_loader(gu.weight, torch.arange(10.0, 14.0).view(4, 1), 1)
    assert gu.weight.flatten().tolist() == [2, 3, 12, 13]
    row = RowParallelLinear(4, 1, tp=GroupHandle.detached(2, 1))
    row.weight_loader(row.weight, torch.arange(4.0).view(1, 4))
    assert row.weight.flatten().tolist() == [2, 3]
