"""The worker's Triton attention backend: same contract as the torch one, chosen by the
selector, and end to end through the ModelRunner."""

from __future__ import annotations

import pytest
import torch

from llmserve.worker.attention import TorchPagedAttention, backend_class, install_backend
from llmserve.worker.attention.selector import resolve_backend_name
from llmserve.worker.attention.triton_backend import TritonPagedAttention, decode_num_splits
from tests.kernels.conftest import INTERPRET
from tests.kernels.helpers import rel_err

cpu_only = pytest.mark.skipif(not INTERPRET, reason="runs the CPU model runner under Triton's interpreter")


def _mixed_step(seed=0):
    """Rows: 2 decodes, a chunk after 20 cached tokens, a fresh prefill of 13."""
    g = torch.Generator().manual_seed(seed)
    bs, H, KVH, D, nb = 16, 6, 2, 64, 12
    query_lens, seq_lens = [1, 1, 9, 13], [40, 7, 29, 13]
    tables = [[5, 0, 9], [3], [11, 2], [7]]
    slots = []
    for t, q, L in zip(tables, query_lens, seq_lens):
        slots += [t[p // bs] * bs + p % bs for p in range(L - q, L)]
    T = sum(query_lens)
    kv = torch.randn(2, nb, bs, KVH, D, generator=g)  # the "cached" context is random
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (H, KVH, KVH))
    return (query_lens, seq_lens, tables, torch.tensor(slots), bs), (H, D, KVH), (q, k, v), kv


@pytest.mark.parametrize("window,softcap", [(None, None), (10, 2.5)])
def test_backend_matches_torch_backend(window, softcap, device):
    """The torch backend on the CPU is the oracle; the Triton one runs on `device`. With a
    window of 10 the decode of 40 and the chunk over 20 cached tokens skip whole blocks."""
    (query_lens, seq_lens, tables, slots, bs), heads, (q, k, v), kv = _mixed_step()
    outs, caches = [], []
    for cls, dev in ((TorchPagedAttention, torch.device("cpu")), (TritonPagedAttention, device)):
        cache = kv.clone().to(dev)
        meta = cls.build_metadata(query_lens, seq_lens, tables, slots.to(dev), bs)
        backend = cls(*heads, sliding_window=window, softcap=softcap)
        outs.append(backend.forward(q.to(dev), k.to(dev), v.to(dev), cache, meta).cpu())
        caches.append(cache.cpu())
    assert torch.equal(caches[0], caches[1])
    assert rel_err(outs[1], outs[0]) <= 1e-5


def test_metadata_tensors():
    meta = TritonPagedAttention.build_metadata([1, 1, 9, 13], [40, 7, 29, 13], [[5, 0, 9], [3], [11, 2], [7]],
                                               torch.zeros(24, dtype=torch.long), 16)
    assert meta.num_decodes == 2 and meta.max_prefill_query_len == 13 and meta.max_decode_seq_len == 40
    assert meta.block_table.tolist() == [[5, 0, 9], [3, 0, 0], [11, 2, 0], [7, 0, 0]]
    assert meta.cu_seqlens_q.tolist() == [0, 1, 2, 11, 24] and meta.seq_lens_t.dtype == torch.int32


def test_decode_split_heuristic():
    # 132 SMs (an H100 / H200): about 4 programs (rows x kv heads x splits) per SM.
    assert decode_num_splits(64, 8, 100_000, 132) == 2
    assert decode_num_splits(256, 8, 100_000, 132) == 1  # enough programs already
    assert decode_num_splits(1, 8, 300, 132) == 1  # short context: one split of its keys
    assert decode_num_splits(1, 8, 2048, 132) == 4  # splits of >= 512 keys
    assert decode_num_splits(1, 3, 8192, 132) == 16  # at most 16
    assert decode_num_splits(8, 8, 0, 132) == 9  # unknown length (a CUDA graph): occupancy alone
    assert decode_num_splits(1, 2, 0, 1) == 2  # the interpreter counts as one SM


def test_selector(monkeypatch):
    assert resolve_backend_name("auto", "cpu") == "torch"
    assert resolve_backend_name("auto", "cuda") == "triton"
    assert resolve_backend_name("torch", "cuda") == "torch"
    assert backend_class("torch", torch.device("cpu")) is TorchPagedAttention
    with pytest.raises(ValueError, match="unknown attention backend"):
        backend_class("flash", torch.device("cpu"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        backend_class("triton", torch.device("cpu"))


def test_install_backend_swaps_every_layer():
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = TorchPagedAttention(6, 64, 2, scale=0.3)

    model = torch.nn.Sequential(Layer(), Layer())
    model[1].attn = TorchPagedAttention(6, 64, 2, scale=0.3, sliding_window=8, softcap=30.0)
    assert install_backend(model, TritonPagedAttention) == 2
    assert all(type(m.attn) is TritonPagedAttention and m.attn.scale == 0.3 for m in model)
    assert [(m.attn.sliding_window, m.attn.softcap) for m in model] == [(None, None), (8, 30.0)]


@cpu_only
def test_model_runner_triton_equals_torch(tiny_llama_dir):
    """Chunked prefill, a prefix of cached context, decodes and a mixed step, greedy."""
    from llmserve.worker.model_runner import ModelRunner
    from llmserve.worker.config import RunnerConfig
    from tests.worker.conftest import PlanDriver

    logits, tokens = {}, {}
    for backend in ("torch", "triton"):
        runner = ModelRunner(tiny_llama_dir, RunnerConfig(num_kv_blocks=24, block_size=16, attention_backend=backend, swap_space=0))
        assert runner.batch.attention_backend.__name__ == {"torch": "TorchPagedAttention",
                                                          "triton": "TritonPagedAttention"}[backend]
        seen = []
        model_logits = runner.model.compute_logits

        def record(hidden, f=model_logits, seen=seen):
            out = f(hidden)
            seen.append(out.clone())
            return out

        runner.model.compute_logits = record
        drv = PlanDriver(runner, 16, 24, seed=3)
        drv.add("a", list(range(3, 40)))  # 37 tokens: chunks of 20 + 17
        drv.add("b", list(range(50, 61)))
        drv.step({"a": 20, "b": None})  # chunk of a (no sample), full prefill of b
        drv.step({"a": None, "b": None})  # rest of a after 20 cached tokens + b's first decode
        for _ in range(3):
            drv.step({"a": None, "b": None})  # decodes
        tokens[backend] = (drv.outputs("a"), drv.outputs("b"))
        logits[backend] = torch.cat(seen)
    assert tokens["triton"] == tokens["torch"]
    assert len(tokens["torch"][0]) == 4 and len(tokens["torch"][1]) == 5
    assert rel_err(logits["triton"], logits["torch"]) <= 1e-5
