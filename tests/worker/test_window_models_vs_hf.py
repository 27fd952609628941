"""Qwen3, windowed Mistral, Gemma 2 and Gemma 3 (text) against HF transformers, from tiny
random checkpoints with every feature on (tests/tiny_models.make_tiny_window_model):
QK-norm, soft-caps, query_pre_attn_scalar, sandwich norms, windowed and full layers, a
RoPE base per layer type. Window 8, block size 4, prompts longer than 3 windows.

  - greedy tokens through the ModelRunner (chunked prefill, decodes batched with chunks)
    equal HF `generate`'s in float32; in bfloat16 each of our tokens is HF's own choice
    under teacher forcing (HF scores the prompt and our tokens in one forward), or within
    BF16_TIE of it (the rule of test_bf16_vs_hf.py: bf16 resolves logits of 4-8 to 1/32,
    two summation orders can swap near-tied candidates, and HF's incremental `generate`
    itself disagrees with its full forward there);
  - logits of every position through the paged cache (chunks over cached context, a
    prefix-cache hit, mixed decode + chunk steps) within tolerance of HF's full forward;
    for Mistral (every layer windowed) every block that has left all windows is filled
    with NaN first: no kernel may read it (the scheduler may already have reused it).
"""

from __future__ import annotations

import random

import pytest
import torch

from llmserve.contract.sampling import SamplingParams
from llmserve.worker.config import RunnerConfig
from llmserve.worker.kv_cache import allocate_kv_caches
from llmserve.worker.model_runner import ModelRunner
from llmserve.worker.models.decoder import head_dim_of, sliding_windows
from llmserve.worker.models.loader import load_model
from tests.tiny_models import TINY_WINDOW, make_tiny_window_model

from .conftest import PlanDriver
from .test_model_vs_hf import BLOCK, _Seq, _step

KINDS = ["qwen3", "mistral", "gemma2", "gemma3"]
GEN = 32
NUM_BLOCKS = 96
PROMPT_LENS = {"a": 3 * TINY_WINDOW + 5, "b": 4 * TINY_WINDOW + 3, "c": 3 * TINY_WINDOW + 1}
LOGIT_ATOL = {torch.float32: 1e-4, torch.bfloat16: 0.25}  # bf16: 8 ulps at logits of 4-8
LOGIT_MEAN_ERR = {torch.float32: 1e-5, torch.bfloat16: 0.03}  # bf16: ~2 ulps
BF16_TIE = 0.125


@pytest.fixture(scope="module", params=KINDS)
def model_dir(request, tmp_path_factory):
    return make_tiny_window_model(tmp_path_factory.mktemp(request.param), request.param)


def _prompts(seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {rid: [rng.randrange(3, 300) for _ in range(n)] for rid, n in PROMPT_LENS.items()}


def _hf(model_dir, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=GEN, min_new_tokens=GEN, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_runner_greedy_matches_hf_generate(model_dir, dtype):
    prompts = _prompts()
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    runner = ModelRunner(model_dir, RunnerConfig(dtype=name, block_size=BLOCK, num_kv_blocks=NUM_BLOCKS,
                                                 swap_space=0))
    assert runner.max_model_len == 256  # a window no longer caps the context (Mistral's did)
    d = PlanDriver(runner, BLOCK, NUM_BLOCKS)
    for rid, p in prompts.items():
        d.add(rid, p, SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True))
    d.step({"a": 11, "b": 13})  # first chunks
    d.step({"a": None, "b": 13})  # a's rest (sampled), b's middle chunk
    d.step({"a": 1, "b": None, "c": 10})  # a decodes beside b's last chunk and c's first
    d.step({"a": 1, "b": 1, "c": None})
    while any(len(d.outputs(r)) < GEN for r in prompts):
        d.step({r: 1 for r in prompts if len(d.outputs(r)) < GEN})
    hf = _hf(model_dir, dtype)
    if dtype == torch.float32:
        for rid, p in prompts.items():
            assert d.outputs(rid) == _hf_greedy(hf, p), rid
        return
    steps = exact = 0
    for rid, p in prompts.items():
        got = d.outputs(rid)
        with torch.inference_mode():  # HF's logits at the positions that predicted each of our tokens
            logits = hf(torch.tensor([p + got[:-1]])).logits[0, len(p) - 1 :].float()
        gaps = logits.max(dim=-1).values - logits[torch.arange(GEN), torch.tensor(got)]
        assert gaps.max() <= BF16_TIE, f"{rid}: token {int(gaps.argmax())} is {gaps.max():.3f} below HF's choice"
        steps, exact = steps + GEN, exact + int((gaps == 0).sum())
    assert exact >= 0.9 * steps  # ties are rare: the comparison is real


def _poison_out_of_window(kv_caches, seqs: list[_Seq], window: int) -> None:
    """NaN into every block no sequence can see again: wholly before the window of its next
    query (a block shared by a prefix hit stays while any holder still sees it)."""
    needed = set()
    for s in seqs:
        first_key = max(0, s.computed - window + 1)  # what its next query sees, scheduled now or later
        for i, b in enumerate(s.blocks):
            if (i + 1) * BLOCK > first_key:
                needed.add(b)
    stale = [b for s in seqs for b in s.blocks if b not in needed]
    for kv in kv_caches:
        kv[:, stale] = float("nan")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paged_logits_match_hf_forward(model_dir, dtype):
    ours = load_model(model_dir, dtype)
    cfg = ours.config
    kv = allocate_kv_caches(cfg.num_hidden_layers, NUM_BLOCKS, BLOCK, cfg.num_key_value_heads, head_dim_of(cfg),
                            dtype)
    windows = sliding_windows(cfg)
    all_windowed = all(w is not None for w in windows)
    free = list(range(NUM_BLOCKS))
    random.Random(1).shuffle(free)
    prompts = _prompts(seed=2)
    a = _Seq(prompts["a"], [free.pop() for _ in range(20)])
    # b shares a's first 4 blocks (16 tokens): a prefix-cache hit, its first chunk reads them.
    b = _Seq(prompts["a"][:16] + prompts["b"], a.blocks[:4] + [free.pop() for _ in range(20)])
    got: dict[int, list[torch.Tensor]] = {id(a): [], id(b): []}

    def run(work):
        if all_windowed:
            _poison_out_of_window(kv, [a, b], windows[0])
        for (s, _), lg in zip(work, _step(ours, kv, work)):
            got[id(s)].append(lg.float())

    run([(a, 9)])
    run([(a, 9)])  # a chunk over 9 cached tokens
    b.computed = 16  # prefix hit: a's blocks hold b's first 16 tokens
    got[id(b)].append(torch.full((16, cfg.vocab_size), float("nan")))  # (not computed: not compared)
    run([(a, len(a.tokens) - 18), (b, 10)])
    run([(b, len(b.tokens) - 26)])
    for _ in range(12):  # decodes: the greedy token of each
        for s in (a, b):
            s.tokens.append(int(got[id(s)][-1][-1].argmax()))
        run([(a, 1), (b, 1)])
    hf = _hf(model_dir, dtype)
    for s in (a, b):
        mine = torch.cat(got[id(s)])
        with torch.inference_mode():
            ref = hf(torch.tensor([s.tokens])).logits[0].float()
        keep = slice(16, None) if s is b else slice(None)
        assert not mine[keep].isnan().any()
        torch.testing.assert_close(mine[keep], ref[keep], atol=LOGIT_ATOL[dtype], rtol=0)
        assert (mine[keep] - ref[keep]).abs().mean() <= LOGIT_MEAN_ERR[dtype]
