"""Vocabulary-parallel token embedding and LM head.

Each rank owns a contiguous slice of vocab rows [rank*shard, (rank+1)*shard); the last
shard is zero-padded when vocab_size is not divisible by tp_size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.contract.arith import cdiv
from llmserve.worker.distributed import SINGLE, GroupHandle
from llmserve.worker.layers.int8_weight import Int8Weight, quantize_rows, w8a8_applies
from llmserve.worker.layers.packed_weight import PackedWeight


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: GroupHandle = SINGLE):
        super().__init__()
        self.tp = tp
        self.vocab_size, self.tp_size, self.tp_rank = vocab_size, tp.size, tp.rank
        self.shard_size = cdiv(vocab_size, tp.size)
        self.vocab_start = tp.rank * self.shard_size
        # weight: [shard_size, hidden]
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[0] != self.vocab_size or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"embedding: checkpoint {tuple(loaded.shape)} != vocab {self.vocab_size} x {param.shape[1]}")
        n = max(0, min(self.shard_size, self.vocab_size - self.vocab_start))
        param.data.zero_()
        param.data[:n].copy_(loaded.narrow(0, self.vocab_start, n))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, hidden]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        # Each token's row lives on exactly one rank; the others contribute zeros.
        return self.tp.all_reduce(out.masked_fill(outside[:, None], 0.0))


class ParallelLMHead(VocabParallelEmbedding):
    """logits = hidden @ W.T through a second copy of W laid out for the product:
      - on CPU (float32, bfloat16): W packed for its GEMM library (see packed_weight.py).
        The head is a [rows <= batch] x [hidden, vocab] product bound by streaming W,
        which the library streams faster in its own layout than `hidden @ w_t` does.
      - elsewhere on CPU: w_t, a contiguous [hidden, vocab] copy (NOTE: on CPU, F.linear
        against W itself is slower for a head this wide).
      - on CUDA: W itself through F.linear (cuBLAS takes the transposed operand at full
        speed; a copy would cost another vocab x hidden of device memory).
      - `quantization="int8"` where the W8A8 kernel runs (int8_weight.py): W quantized
        per row to int8, the hidden states per 64 columns. The head streams vocab x hidden
        weights for a few rows, so int8's half of bfloat16's bytes is half the time; it
        costs SmolLM2-135M 0.6% perplexity on top of the layers' 1.0% (docs/benchmarks.md).
        The embedding keeps reading the float weight.

    Tied embeddings: pass `tied_to=embed_tokens`; the weight is then the embedding's own
    Parameter. Call `process_weights_after_loading()` after loading to refresh the copy.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: GroupHandle = SINGLE,
                 tied_to: VocabParallelEmbedding | None = None, quantization: str = "none"):
        super().__init__(vocab_size, hidden_size, tp)
        self.quantization = quantization
        self.shares_embedding_weight = tied_to is not None  # the embedding still reads it
        if tied_to is not None:
            self.weight = tied_to.weight
        self.register_buffer("w_t", torch.empty(0), persistent=False)
        self.w_packed: PackedWeight | None = None  # [shard_size, hidden], packed
        self.int8: Int8Weight | None = None  # [shard_size, hidden] as W8A8 int8, with quantization="int8"

    @property
    def _has_product_copy(self) -> bool:
        """True once process_weights_after_loading made the copy the head multiplies by."""
        return self.w_packed is not None or self.w_t.numel() > 0 or self.int8 is not None

    def process_weights_after_loading(self) -> None:
        if self._has_product_copy or self.weight.device.type != "cpu":
            return
        w = self.weight.detach()
        self.int8 = self._w8a8_copy(w)
        if self.int8 is None:
            self.w_packed = PackedWeight.pack(w)
            self.w_t = torch.empty(0) if self.w_packed is not None else w.t().contiguous()
        if not self.shares_embedding_weight:
            # An untied head multiplies only through its copy: holding the dense weight too
            # would cost another vocab x hidden (2 GB for a 128k x 4096 float32 head).
            self.weight.data = torch.empty(0, dtype=w.dtype, device=w.device)

    def _w8a8_copy(self, w: torch.Tensor) -> Int8Weight | None:
        """W [shard_size, hidden] as W8A8 int8 rows, with quantization="int8" where the kernel runs."""
        if not w8a8_applies(w, self.quantization):
            return None
        q, scale = quantize_rows(w)
        return Int8Weight(q, scale, quantize_activations=True)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, hidden] -> logits [S, vocab] on every TP rank (shards all-gathered,
        # padding cut off), so sampling on TP rank 0 sees the whole vocabulary.
        if self.weight.device.type != "cpu":
            logits = F.linear(hidden, self.weight)  # [S, shard_size]
        else:
            if not self._has_product_copy:
                self.process_weights_after_loading()
            if self.int8 is not None:
                logits = self.int8.matmul(hidden)
            elif self.w_packed is not None:
                logits = self.w_packed.matmul(hidden)
            else:
                logits = hidden @ self.w_t
        logits = self.tp.all_gather(logits, dim=-1)  # [S, tp * shard_size]
        return logits[:, : self.vocab_size]
