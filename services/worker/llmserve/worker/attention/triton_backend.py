"""Paged attention through the Triton kernels (llmserve.kernels): the GPU path.

Same contract as TorchPagedAttention: forward(q, k, v, kv_cache, meta) writes k/v into
their slots, then attends causally (within the layer's window, soft-capped if set). Per
layer: one cache-write launch, one decode launch (+ one reduction when split), one varlen
launch for every prefill/chunk row.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from llmserve.contract.arith import cdiv
from llmserve.worker.attention.backend import AttentionBackend, AttentionMetadata, row_layout
from llmserve.worker.device import to_device_async

# NOTE: flash-decoding pays when (decode rows x kv heads) programs leave the GPU's SMs
# short of work: each program walks its share of a sequence's keys serially, one
# latency-bound round trip per 64-key tile. Split until there are about
# _PROGRAMS_PER_SM programs per SM. An eager step (lengths known) also keeps each split
# at least _SPLIT_MIN_TOKENS keys long: there the reduction's launch costs ~40 us of host
# time, which a short context's attention does not win back (a graph replays it for free).
_PROGRAMS_PER_SM = 4
_SPLIT_MIN_TOKENS = 512
_SPLIT_MAX = 16


@functools.lru_cache(maxsize=None)
def multiprocessor_count(device: torch.device) -> int:
    """SMs of a CUDA device; 1 elsewhere (Triton's interpreter on the CPU)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_num_splits(num_decodes: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Splits of the decode attention kernel. max_seq_len 0 means unknown (a CUDA graph
    serves every context length: the kernel divides each sequence's keys among the splits)."""
    programs = num_decodes * num_kv_heads
    splits = min(_SPLIT_MAX, cdiv(_PROGRAMS_PER_SM * num_sms, programs))
    if max_seq_len:
        splits = min(splits, max_seq_len // _SPLIT_MIN_TOKENS)
    return max(1, splits)


@dataclass(kw_only=True)  # kw_only: the base may grow fields with defaults
class TritonAttentionMetadata(AttentionMetadata):
    """The base fields (torch-only ones left empty) plus device tensors for the kernels."""

    block_table: torch.Tensor  # [N, max_blocks] int32, rows padded with block 0
    seq_lens_t: torch.Tensor  # [N] int32
    cu_seqlens_q: torch.Tensor  # [N + 1] int32 (absolute token offsets)
    max_prefill_query_len: int  # over rows num_decodes..N-1 (0 if none)
    max_decode_seq_len: int  # over rows 0..num_decodes-1 (0 if none, or unknown: in a CUDA graph)


class TritonPagedAttention(AttentionBackend):
    @classmethod
    def check_block_size(cls, block_size: int) -> None:
        # The prefill kernel's tl.dot tiles a block's keys: a power of two, at least 16.
        if block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"--block-size {block_size}: the triton attention backend needs a power of two "
                             ">= 16 (16, 32, ...)")

    @staticmethod
    def build_metadata(query_lens, seq_lens, block_tables, slot_mapping, block_size,
                       padded_tables=None) -> TritonAttentionMetadata:
        """Tensors land on slot_mapping's device. Rows must be ordered decodes first."""
        dev = slot_mapping.device
        qsl, num_decodes = row_layout(query_lens)
        if any(n < 1 for n in query_lens[num_decodes:]):
            raise ValueError(f"query lengths must be >= 1: {query_lens}")
        max_blocks = max((cdiv(n, block_size) for n in seq_lens), default=0)
        if padded_tables is not None:  # [N, >= max_blocks] int32, kept by the input batch
            block_table = padded_tables[:, :max_blocks].contiguous()
        else:
            rows = [t[:max_blocks] + [0] * (max_blocks - min(len(t), max_blocks)) for t in block_tables]
            block_table = torch.tensor(rows, dtype=torch.int32, device=dev).view(len(seq_lens), max_blocks)
        return TritonAttentionMetadata(
            slot_mapping=slot_mapping, query_start_loc=qsl, seq_lens=list(seq_lens), block_tables=block_tables,
            block_size=block_size, num_decodes=num_decodes,
            decode_block_table=None,
            block_table=block_table,
            seq_lens_t=to_device_async(torch.tensor(seq_lens, dtype=torch.int32), dev),
            cu_seqlens_q=to_device_async(torch.tensor(qsl, dtype=torch.int32), dev),
            max_prefill_query_len=max(query_lens[num_decodes:], default=0),
            max_decode_seq_len=max(seq_lens[:num_decodes], default=0),
        )

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, kv_stored: bool = False) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, KVH, D]; kv_cache: [2, num_blocks, block_size, KVH, D]
        from llmserve.kernels.triton import paged_attention_decode, paged_attention_varlen, reshape_and_cache

        if not isinstance(meta, TritonAttentionMetadata):
            raise TypeError("TritonPagedAttention needs metadata from TritonPagedAttention.build_metadata")
        if not kv_stored:
            reshape_and_cache(k, v, kv_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        B, N = meta.num_decodes, len(meta.seq_lens)
        if B:
            keys = meta.max_decode_seq_len  # the most keys a row reads: at most the window (0 = unknown)
            if self.sliding_window is not None and keys:
                keys = min(keys, self.sliding_window)
            splits = decode_num_splits(B, self.num_kv_heads, keys, multiprocessor_count(q.device))
            paged_attention_decode(q[:B], kv_cache, meta.block_table[:B], meta.seq_lens_t[:B], self.scale,
                                   num_splits=splits, out=out[:B], window=self.sliding_window, softcap=self.softcap)
        if N > B:
            paged_attention_varlen(q, kv_cache, meta.block_table[B:], meta.seq_lens_t[B:], meta.cu_seqlens_q[B:],
                                   meta.max_prefill_query_len, self.scale, out=out, window=self.sliding_window,
                                   softcap=self.softcap)
        return out
