"""Paged attention in plain torch for CPU: decode rows batched into one gather + one
SDPA; prefill/chunk rows one SDPA each. A layer with a sliding window reads only the
blocks its window reaches; one with a soft-cap materializes its scores (SDPA has none).
Where the C++ CPU kernels load, decode rows and prefill rows use them instead (one call
for all rows of a kind, K/V read in place; `prefill_kernel_applies` says which prefill
rows); the torch code stays as their fallback and test reference."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from llmserve.contract.arith import cdiv
from llmserve.kernels import cpu as cpu_kernels
from llmserve.worker.attention.backend import AttentionBackend, AttentionMetadata, PrefillSeq, row_layout


@dataclass
class TorchPagedMetadata(AttentionMetadata):
    """The prefill rows again as the tensors the C++ prefill kernel reads (None without
    prefill rows); their tokens are num_decodes .. num_tokens-1. The decode mask and the
    prefill rows' PrefillSeq are the torch fallbacks' only: built on first use and kept
    for the step's other layers (where the C++ kernels load, never)."""

    prefill_block_table: torch.Tensor | None = None  # [P, max_blocks] long, padded with block 0
    prefill_query_start: torch.Tensor | None = None  # [P + 1] long, from the first prefill token
    prefill_seq_lens: torch.Tensor | None = None  # [P] long
    _decode_mask: torch.Tensor | None = field(default=None, repr=False)
    _prefills: list[PrefillSeq] | None = field(default=None, repr=False)

    @property
    def decode_mask(self) -> torch.Tensor | None:
        """[B, 1, 1, max_blocks * block_size] bool (True = visible); None without decode rows."""
        if self._decode_mask is None and self.num_decodes:
            key_pos = torch.arange(self.decode_block_table.shape[1] * self.block_size, device=self.slot_mapping.device)
            self._decode_mask = (key_pos[None, :] < self.decode_seq_lens[:, None])[:, None, None, :]
        return self._decode_mask

    @property
    def prefills(self) -> list[PrefillSeq]:
        """The prefill rows, one SDPA each (the fallback of the C++ prefill kernel)."""
        if self._prefills is None:
            qsl, dev = self.query_start_loc, self.slot_mapping.device
            self._prefills = [_prefill_seq(qsl[i], qsl[i + 1], self.seq_lens[i], self.block_tables[i], self.block_size,
                                           dev) for i in range(self.num_decodes, len(self.seq_lens))]
        return self._prefills


class TorchPagedAttention(AttentionBackend):
    @staticmethod
    def build_metadata(query_lens, seq_lens, block_tables, slot_mapping, block_size,
                       padded_tables=None) -> AttentionMetadata:
        """Tensors land on slot_mapping's device."""
        dev = slot_mapping.device
        qsl, num_decodes = row_layout(query_lens)
        lens = torch.from_numpy(np.array(seq_lens, dtype=np.int64)).to(dev)  # [N]
        meta = TorchPagedMetadata(slot_mapping=slot_mapping, query_start_loc=qsl, seq_lens=list(seq_lens),
                                  block_tables=block_tables, block_size=block_size, num_decodes=num_decodes,
                                  decode_block_table=None)
        if num_decodes:
            meta.decode_block_table = _padded_table(block_tables[:num_decodes], seq_lens[:num_decodes], block_size,
                                                    dev, None if padded_tables is None else padded_tables[:num_decodes])
            meta.decode_seq_lens = lens[:num_decodes]
        if num_decodes < len(query_lens):
            padded = None if padded_tables is None else padded_tables[num_decodes:]
            meta.prefill_block_table = _padded_table(block_tables[num_decodes:], seq_lens[num_decodes:], block_size,
                                                     dev, padded)
            meta.prefill_query_start = torch.tensor([n - num_decodes for n in qsl[num_decodes:]], dtype=torch.long,
                                                    device=dev)
            meta.prefill_seq_lens = lens[num_decodes:]
        return meta

    def forward(self, q, k, v, kv_cache, meta: TorchPagedMetadata, kv_stored: bool = False) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, KVH, D]; kv_cache: [2, num_blocks, block_size, KVH, D]
        if not kv_stored:
            _write_kv(k, v, kv_cache, meta.slot_mapping)
        B = meta.num_decodes
        if B and B == q.shape[0]:  # decode rows only: their output is the whole output
            return self._decode(q, kv_cache, meta)
        out = torch.empty_like(q)
        if B:
            out[:B] = self._decode(q[:B], kv_cache, meta)
        if self.prefill_kernel_applies(q.dtype, kv_cache.device):
            # All prefill rows in one call, K/V read in place (this step's keys are stored above).
            out[B:] = cpu_kernels.paged_attention_prefill(q[B:], kv_cache, meta.prefill_block_table,
                                                          meta.prefill_query_start, meta.prefill_seq_lens,
                                                          self.scale, self.sliding_window, self.softcap)
            return out
        for p in meta.prefills:
            out[p.token_start : p.token_end] = self._prefill(q, k, v, kv_cache, p)
        return out

    def prefill_kernel_applies(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether the prefill rows take the C++ flash kernel rather than one SDPA each
        (chosen by measurement on a Zen 4, one layer of SmolLM2-135M: docs/benchmarks.md).
        float32: always, 2-7x faster than SDPA. bfloat16: where its products are AVX-512
        BF16 dot products (head_dim a multiple of 32), 4-8x faster. Its float32 loops (other
        head sizes, CPUs without AVX-512 BF16) measured 2-3x faster than SDPA too, but SDPA
        stays there: it rounds exactly as HF's bfloat16 forward does, and the tiny
        head_dim-16 mixture-of-experts test models flip expert choices on the kernel's
        different (equally accurate) rounding, which their HF comparisons cannot tell from
        a bug."""
        if device.type != "cpu" or not cpu_kernels.load():
            return False
        if dtype == torch.bfloat16:
            return self.head_dim % 32 == 0 and cpu_kernels.prefill_bf16_dot_supported()
        return dtype == torch.float32

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # q: [B, H, D] -> [B, H, D]
        if kv_cache.device.type == "cpu" and cpu_kernels.load():
            # Reads K/V blocks in place: the decode is memory-bound, and the gather below
            # copies every block before attention reads it again.
            return cpu_kernels.paged_attention_decode(q, kv_cache, meta.decode_block_table, meta.decode_seq_lens,
                                                      self.scale, self.sliding_window, self.softcap)
        return self._decode_gather(q, kv_cache, meta)

    def _decode_gather(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The plain-torch path: gather each row's blocks, one masked SDPA for all rows."""
        B, H, D = q.shape
        KVH, g = self.num_kv_heads, H // self.num_kv_heads
        table, mask = meta.decode_block_table, meta.decode_mask
        if self.sliding_window is not None:  # only the blocks the window reaches
            W = self.sliding_window
            if W not in meta.decode_windows:
                meta.decode_windows[W] = _decode_window(table, meta.decode_seq_lens, W, meta.block_size)
            table, mask = meta.decode_windows[W]
        kv = kv_cache[:, table]  # [2, B, n_blocks, bs, KVH, D]
        kv = kv.view(2, B, -1, KVH, D).transpose(2, 3)  # [2, B, KVH, L, D]
        # NOTE: GQA without copying K/V: the g query heads sharing a kv head become the
        # "query length" axis (query head h uses kv head h // g, as HF's repeat_kv).
        qg = q.view(B, KVH, g, D)
        o = _attention(qg, kv[0], kv[1], mask, self.scale, self.softcap)
        return o.reshape(B, H, D)

    def _prefill(self, q, k, v, kv_cache, p: PrefillSeq) -> torch.Tensor:
        s, e = p.token_start, p.token_end
        first, mask = 0, p.mask
        if self.sliding_window is not None and p.seq_len > self.sliding_window:
            W = self.sliding_window
            if W not in p.windowed:
                p.windowed[W] = _prefill_window(p, W, kv_cache.shape[2])
            first, mask = p.windowed[W]
        if p.context_len == 0:  # keys are exactly this step's tokens: skip the gather
            kk, vv = k[s:e], v[s:e]  # [q_len, KVH, D]
        else:  # the blocks from the one holding key `first` on (earlier ones may be freed)
            bs = kv_cache.shape[2]
            kv = kv_cache[:, p.block_ids[first // bs :]].flatten(1, 2)[:, : p.seq_len - first]  # [2, keys, KVH, D]
            kk, vv = kv[0], kv[1]
        qq = q[s:e].transpose(0, 1)[None]  # [1, H, q_len, D]
        o = _attention(qq, kk.transpose(0, 1)[None], vv.transpose(0, 1)[None], mask, self.scale, self.softcap)
        return o[0].transpose(0, 1)  # [q_len, H, D]


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
               softcap: float | None) -> torch.Tensor:
    """q: [..., Hq, n, D]; k, v: [..., Hk, L, D], Hq a multiple of Hk (query head h reads
    kv head h // (Hq / Hk)); mask broadcast to [..., Hq, n, L] bool (True = visible), None =
    causal with the queries the last n keys. -> [..., Hq, n, D]"""
    if softcap is None:
        # NOTE: 4-D inputs ([1, heads, len, D]) take the fused CPU flash kernel; 3-D ones
        # fall back to a slower unfused path. enable_gqa spares expanding K/V to every
        # query head, at no loss of speed.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=q.shape[-3] != k.shape[-3])
    # SDPA has no soft-cap: the scores are materialized, in float32.
    g = q.shape[-3] // k.shape[-3]
    kf, vf = k.float().repeat_interleave(g, dim=-3), v.float().repeat_interleave(g, dim=-3)
    scores = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale  # [..., Hq, n, L]
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        n, L = q.shape[-2], k.shape[-2]
        mask = torch.arange(L, device=q.device)[None, :] <= torch.arange(L - n, L, device=q.device)[:, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1), vf).to(q.dtype)


def _decode_window(table: torch.Tensor, seq_lens: torch.Tensor, window: int,
                   block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode rows' blocks from the one holding their first visible key (position
    len - W) on: table [B, n] long, mask [B, 1, 1, n * block_size] bool.

      len 11, W 6, block 4:  | 0 1 2 3 | 4 5 6 7 | 8 9 10 . |
                                         ^ first block read (1); keys 5..10 visible
    """
    n = min(table.shape[1], cdiv(window - 1, block_size) + 1)  # blocks W consecutive keys can span
    first_block = (seq_lens - window).clamp(min=0) // block_size  # [B]
    idx = first_block[:, None] + torch.arange(n, device=table.device)[None, :]  # [B, n]
    key_pos = (idx[:, :, None] * block_size + torch.arange(block_size, device=table.device)).flatten(1)
    mask = (key_pos < seq_lens[:, None]) & (key_pos >= seq_lens[:, None] - window)  # [B, n * block_size]
    # NOTE: idx past a row's last block re-reads that block (masked): every block read is
    # the row's own and in its window, so holds finite values (a masked NaN still poisons SDPA).
    idx = torch.minimum(idx, ((seq_lens - 1) // block_size)[:, None])
    return table.gather(1, idx), mask[:, None, None, :]


def _prefill_window(p: PrefillSeq, window: int, block_size: int) -> tuple[int, torch.Tensor]:
    """(first key position the chunk reads, mask [q_len, seq_len - first]): query at
    position qp sees keys kp with qp - W < kp <= qp. A cached context is read from the block
    holding the first query's first key; this step's own keys are all read."""
    q_len = p.token_end - p.token_start
    first = (max(0, p.context_len + 1 - window) // block_size) * block_size if p.context_len else 0
    dev = p.block_ids.device
    key_pos = torch.arange(first, p.seq_len, device=dev)[None, :]
    q_pos = torch.arange(p.seq_len - q_len, p.seq_len, device=dev)[:, None]
    return first, (key_pos <= q_pos) & (key_pos > q_pos - window)


def _write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    _, nb, bs, KVH, D = kv_cache.shape
    flat = kv_cache.view(2, nb * bs, KVH, D)
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def _padded_table(tables: list[list[int]], seq_lens: list[int], block_size: int, device: torch.device,
                  padded: torch.Tensor | None = None) -> torch.Tensor:
    """The rows' blocks as [B, max_blocks] long, padded with block 0."""
    max_blocks = cdiv(max(seq_lens), block_size)
    if padded is not None:  # [B, >= max_blocks] int32, kept by the input batch
        return padded[:, :max_blocks].long()
    rows = [t[:max_blocks] + [0] * (max_blocks - min(len(t), max_blocks)) for t in tables]
    return torch.tensor(rows, dtype=torch.long, device=device)


def _prefill_seq(start: int, end: int, seq_len: int, table: list[int], block_size: int,
                 device: torch.device) -> PrefillSeq:
    q_len = end - start
    ctx = seq_len - q_len
    mask = None
    if ctx:
        # query i (position ctx+i) sees keys at positions <= ctx+i
        mask = torch.arange(seq_len, device=device)[None, :] <= (ctx + torch.arange(q_len, device=device))[:, None]
    n_blocks = cdiv(seq_len, block_size)
    return PrefillSeq(start, end, ctx, seq_len, torch.tensor(table[:n_blocks], dtype=torch.long, device=device), mask)
