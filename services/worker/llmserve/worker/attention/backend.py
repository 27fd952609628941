"""The attention backend interface and the per-step metadata all layers share.

KV cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim]  (0 = K, 1 = V)
Token slot: slot = block_id * block_size + position % block_size, with
block_id = block_table[position // block_size].

Flattened step batch (T tokens, N sequences), sequence i owns tokens
query_start_loc[i] : query_start_loc[i+1] and has seq_lens[i] tokens of context
including this step's. Decode rows (1 query token) come first, prefill/chunk rows after:

  tokens:  | d0 | d1 | d2 | p0 p0 p0 p0 | p1 p1 p1 |
             <- num_decodes ->  <- prefills ---------->
"""

from __future__ import annotations

import abc
import itertools
from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSeq:
    """One prefill or chunk row, with everything its attention needs precomputed."""

    token_start: int
    token_end: int
    context_len: int  # Tokens cached before this step (keys the chunk also sees).
    seq_len: int
    block_ids: torch.Tensor  # [ceil(seq_len / block_size)] long
    mask: torch.Tensor | None  # [q_len, seq_len] bool (True = visible); None = plain causal
    # window W -> (first key position read, [q_len, seq_len - first] mask), built by the
    # first windowed layer of the step and reused by the others.
    windowed: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict, repr=False)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long
    query_start_loc: list[int]  # [N + 1]
    seq_lens: list[int]  # [N]
    block_tables: list[list[int]]  # [N][num_blocks_i]
    block_size: int
    num_decodes: int  # Rows 0..num_decodes-1 are decodes; their tokens are 0..num_decodes-1.
    # Decode rows, batched: one gather of [B, max_blocks] blocks and one masked SDPA.
    decode_block_table: torch.Tensor | None  # [B, max_blocks] long, padded with block 0
    decode_seq_lens: torch.Tensor | None = None  # [B] long: context length of each decode row
    # window W -> the decode rows' window blocks ([B, n] long) and mask ([B, 1, 1, n * block_size]
    # bool), built by the first windowed layer of the step (torch gather path only).
    decode_windows: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]


def row_layout(query_lens: list[int]) -> tuple[list[int], int]:
    """(query_start_loc [N + 1], number of leading decode rows) for a step whose rows are
    ordered decodes (1 query token) first, as the input batch builds them."""
    qsl = [0, *itertools.accumulate(query_lens)]
    num_decodes = len(query_lens)
    if qsl[-1] != num_decodes or 0 in query_lens:  # (else every row is one token: no scan)
        num_decodes = next(i for i, n in enumerate(query_lens) if n != 1)
    return qsl, num_decodes


class AttentionBackend(abc.ABC):
    """Per-layer attention over the paged cache. Metadata is built once per step by
    `build_metadata` and passed to every layer."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float | None = None,
                 sliding_window: int | None = None, softcap: float | None = None):
        """sliding_window W: a query at position p sees keys at (p - W, p] only (HF's
        semantics), and no kernel reads a block wholly before that: the scheduler may
        already have freed it. softcap c: scores become c * tanh(scores / c) before the
        mask and softmax (Gemma 2). None = off for both."""
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        if softcap is not None and softcap <= 0:
            raise ValueError(f"softcap must be > 0, got {softcap}")
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale if scale is not None else head_dim**-0.5
        self.sliding_window, self.softcap = sliding_window, softcap

    @classmethod
    def check_block_size(cls, block_size: int) -> None:
        """Raises ValueError when this backend's kernels cannot run blocks of this size."""
        if block_size < 1:
            raise ValueError(f"block size must be >= 1, got {block_size}")

    @staticmethod
    @abc.abstractmethod
    def build_metadata(
        query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
        slot_mapping: torch.Tensor, block_size: int, padded_tables: torch.Tensor | None = None,
    ) -> AttentionMetadata:
        """Rows must be ordered decodes (query_len == 1) first. padded_tables: the same
        tables as [N, max_blocks] int32 on slot_mapping's device, zero-padded (the input
        batch keeps them as a tensor; built from block_tables when None)."""

    @abc.abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        """q [T,H,D], k/v [T,KVH,D]: store k/v in their slots (unless the caller already
        did: kv_stored, the fused CPU rotary + cache write), attend causally -> [T,H,D]."""
