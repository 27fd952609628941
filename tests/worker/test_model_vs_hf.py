"""Our Llama/Qwen2 through the paged KV cache vs HF transformers' logits (fp32)."""

from __future__ import annotations

import random

import pytest
import torch

from llmserve.worker.attention import TorchPagedAttention
from llmserve.worker.kv_cache import allocate_kv_caches
from llmserve.worker.models.llama import head_dim_of
from llmserve.worker.models.loader import load_model

from .conftest import hf_model

BLOCK = 4
NUM_BLOCKS = 64
ATOL = 1e-4


class _Seq:
    def __init__(self, tokens: list[int], blocks: list[int]):
        self.tokens, self.blocks, self.computed = tokens, blocks, 0


def _step(model, kv_caches, work: list[tuple[_Seq, int]]) -> list[torch.Tensor]:
    """Run one step over (seq, num_tokens) rows (decode rows first); logits per row [n, V]."""
    ordered = sorted(work, key=lambda w: w[1] != 1)
    ids, pos, slots, qlens, slens, tables = [], [], [], [], [], []
    for s, n in ordered:
        p = list(range(s.computed, s.computed + n))
        ids += s.tokens[s.computed : s.computed + n]
        pos += p
        slots += [s.blocks[i // BLOCK] * BLOCK + i % BLOCK for i in p]
        qlens.append(n)
        slens.append(s.computed + n)
        tables.append(s.blocks)
        s.computed += n
    meta = TorchPagedAttention.build_metadata(qlens, slens, tables, torch.tensor(slots), BLOCK)
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.tensor(pos), kv_caches, meta)
        logits = model.compute_logits(hidden)
    out, start = {}, 0
    for s, n in ordered:
        out[id(s)] = logits[start : start + n]
        start += n
    return [out[id(s)] for s, _ in work]


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    ours = load_model(tiny_model_dir, "float32")
    cfg = ours.config
    caches = lambda: allocate_kv_caches(  # noqa: E731
        cfg.num_hidden_layers, NUM_BLOCKS, BLOCK, cfg.num_key_value_heads, head_dim_of(cfg), torch.float32
    )
    return ours, hf_model(tiny_model_dir), caches


def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0]


def test_concurrent_chunked_prefill_and_decode_match_hf(models):
    ours, hf, caches = models
    kv = caches()
    rng = random.Random(0)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    a = _Seq([rng.randrange(300) for _ in range(13)], [free.pop() for _ in range(8)])
    b = _Seq([rng.randrange(300) for _ in range(22)], [free.pop() for _ in range(10)])
    c = _Seq([rng.randrange(300) for _ in range(1)], [free.pop() for _ in range(5)])
    got = {id(s): [] for s in (a, b, c)}

    def run(work):
        for (s, _), lg in zip(work, _step(ours, kv, work)):
            got[id(s)].append(lg)

    run([(a, 13), (b, 7)])  # a: whole prompt; b: first chunk
    run([(b, 9), (c, 1)])  # b: middle chunk (attends to cached blocks + itself); c: 1-token prompt
    run([(b, 6)])  # b: last chunk
    for _ in range(5):  # decodes: append the greedy token of each sequence
        for s in (a, b, c):
            s.tokens.append(int(got[id(s)][-1][-1].argmax()))
        run([(a, 1), (b, 1), (c, 1)])
    for s in (a, b, c):
        mine = torch.cat(got[id(s)])
        ref = _hf_logits(hf, s.tokens)
        assert mine.shape == ref.shape
        torch.testing.assert_close(mine, ref, atol=ATOL, rtol=0)


def test_mixed_step_decode_plus_chunk_with_long_context(models):
    """A decode row batched with a chunk whose context spans several earlier blocks."""
    ours, hf, caches = models
    kv = caches()
    blocks = list(range(NUM_BLOCKS))[::-1]
    a = _Seq(list(range(3, 40)), blocks[:12])
    b = _Seq(list(range(50, 80)), blocks[12:24])
    la = _step(ours, kv, [(a, 37)])[0]
    lb1 = _step(ours, kv, [(b, 17)])[0]
    a.tokens.append(int(la[-1].argmax()))
    la2, lb2 = _step(ours, kv, [(a, 1), (b, 13)])
    torch.testing.assert_close(torch.cat([la, la2]), _hf_logits(hf, a.tokens), atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat([lb1, lb2]), _hf_logits(hf, b.tokens), atol=ATOL, rtol=0)
