"""The physical ceilings the GPU targets of issue #31 are judged against, from a model's
shape (ModelFlops, ModelBytes) and this card's bf16 matmul peak and memory bandwidth as
measured in the same run (bench/flops.py): no datasheet figure.

Offline workload of N prompts, I tokens in, O tokens out (every prompt its own sequence):

    compute_s = FLOPs(N x (I + O - 1) tokens computed, N x O logits,
                      N x (I + O - 1)(I + O) / 2 causal query-key pairs) / peak
    memory_s  = sum over the O - 1 decode steps j of
                (weights + LM head + K/V of N x (I + j) tokens) / bandwidth
    ceiling_s = max(compute_s, memory_s)        (prefill at the peak, overlapped with
                                                 the decode steps' reads at the bandwidth)
    ceiling output tok/s = N x O / ceiling_s;   share = ceiling_s / measured seconds

memory_s assumes all N sequences decode in one batch (weights read once per step): the
most favourable schedule, so the ceiling is an upper bound on any engine. At 989 TFLOP/s
and 3.35 TB/s it gives ~53k output tok/s for Llama-3.2-1B and ~7.6k for Llama-3.1-8B
at 1,000 x 1,024 / 128 (the issue's figures): both are compute-bound.

Decode step at batch B, context C (pure decode: B tokens computed, B logits):

    floor_s = max((weights + LM head + K/V of B x (C + 1) tokens) / bandwidth,
                  FLOPs(B tokens, B logits, B x (C + 1) pairs) / peak)
    share = floor_s / measured step
"""

from __future__ import annotations

import torch

from llmserve.bench.flops import ModelBytes, ModelFlops

OFFLINE_FORMULA = ("ceiling_s = max(compute_s, memory_s); compute_s = FLOPs(N(I+O-1) tokens, N*O logits, "
                   "N(I+O-1)(I+O)/2 pairs) / peak; memory_s = sum_j=1..O-1 (weights + LM head + KV(N(I+j))) / "
                   "bandwidth; share = ceiling_s / seconds")
DECODE_FORMULA = ("floor_s = max((weights + LM head + KV(B(C+1))) / bandwidth, FLOPs(B tokens, B logits, "
                  "B(C+1) pairs) / peak); share = floor_s / step")


def offline_ceiling(config, dtype: torch.dtype, num_prompts: int, input_len: int, output_len: int, peak: float,
                    bandwidth: float) -> dict:
    """The offline workload's ceiling on this machine (seconds, output tok/s) and its two
    terms; `peak` in FLOP/s, `bandwidth` in bytes/s."""
    flops, model_bytes = ModelFlops.from_config(config), ModelBytes.from_config(config, dtype)
    n, i, o = num_prompts, input_len, output_len
    seq = i + o - 1  # Tokens each sequence computes: the last one sampled is never fed back.
    compute_s = flops.step_flops(n * seq, n * o, n * seq * (seq + 1) // 2) / peak
    memory_s = sum(model_bytes.step_bytes(n, n, n * (i + j - 1)) for j in range(1, o)) / bandwidth
    seconds = max(compute_s, memory_s)
    return {"compute_s": compute_s, "memory_s": memory_s, "seconds": seconds,
            "bound": "compute" if compute_s >= memory_s else "memory",
            "output_tokens_per_s": n * o / seconds, "total_tokens_per_s": n * (i + o) / seconds,
            "formula": OFFLINE_FORMULA}


def decode_floor(config, dtype: torch.dtype, batch: int, context: int, peak: float, bandwidth: float) -> dict:
    """The least time one decode step at `batch` sequences of `context` cached tokens takes
    on this machine, and which term bounds it."""
    flops, model_bytes = ModelFlops.from_config(config), ModelBytes.from_config(config, dtype)
    memory_s = model_bytes.step_bytes(batch, batch, batch * context) / bandwidth
    compute_s = flops.step_flops(batch, batch, batch * (context + 1)) / peak
    return {"memory_s": memory_s, "compute_s": compute_s, "seconds": max(memory_s, compute_s),
            "bound": "compute" if compute_s > memory_s else "memory", "formula": DECODE_FORMULA}
