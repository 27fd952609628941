"""CUDA graphs of the decode forward, vLLM-style: a warm-up forward, then one graph
captured per decode batch size.

A decode step of B sequences launches a few hundred small kernels (per layer: norms,
projections, rotary, the cache write, attention, the MLP); at small B the GPU idles
between launches. Captured once per batch size of a ladder (1, 2, 4, 8, 16, 24, 32, ...
up to max_num_seqs, the step's sequence cap: 256 or 1,024 by device, see
llmserve/contract/step_budget.py), a step becomes one graph replay: the batch is padded
to the next captured size, its inputs are copied into the graph's static buffers, the
graph runs.

Padding rows write no KV (slot -1: the cache-write kernel skips them) and attend over one
key of block 0 (seq_len 1): finite garbage that nothing reads. Every row's computation is
independent of the others', so the real rows' results are those of an eager step of the
same kernels, up to the GEMM library's choice of kernel for the padded row count and the
decode attention's split count (in a graph it is chosen from the padded batch alone, as
the kernel shares each sequence's keys among the splits whatever its length; an eager
step also caps it by the context length).

Only the model's forward to the final norm is captured; the LM head and sampling run
eagerly on the real rows. The graph needs the Triton attention backend (its metadata is
all device tensors) and one pipeline stage (no send/recv inside graphs).
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from llmserve.worker.attention.triton_backend import TritonAttentionMetadata

logger = logging.getLogger(__name__)


# (from, stride): the ladder's spacing from each size on. Wider apart past 256: a step of
# up to 1,024 sequences (the sequence cap on large cards) pads at most 6% with a stride
# of 32, while 131 graphs at a stride of 8 would double the capture time (profiling
# captures them once more) for no measurable gain.
LADDER_STRIDES = ((8, 8), (256, 16), (512, 32))


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture, up to and including max_num_seqs (the resolved sequence
    cap): 1, 2, 4, multiples of 8 to 256, of 16 to 512, of 32 beyond."""
    sizes = {s for s in (1, 2, 4) if s <= max_num_seqs}
    ends = [start for start, _ in LADDER_STRIDES[1:]] + [max_num_seqs + 1]
    for (start, stride), end in zip(LADDER_STRIDES, ends):
        sizes.update(range(start, min(end, max_num_seqs + 1), stride))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def padded_size(sizes: list[int], batch: int) -> int | None:
    """The smallest captured size that holds `batch` rows (None: run eagerly)."""
    return next((s for s in sizes if s >= batch), None)


class DecodeGraphs:
    """The decode forward of `model` captured for each size in `sizes`, over `kv_caches`
    (the graphs hold their addresses: capture after the cache is allocated, for good)."""

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], sizes: list[int], max_blocks_per_seq: int,
                 block_size: int, device: torch.device):
        self.model, self.kv_caches, self.sizes, self.block_size = model, kv_caches, sizes, block_size
        n = max(sizes)
        # Static inputs: every replay reads these buffers.
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)  # [n]
        self.positions = torch.zeros(n, dtype=torch.long, device=device)  # [n]
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)  # [n]
        self.block_table = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)  # [n, max_blocks]
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)  # [n]
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)  # [n + 1]: one token per row
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # size -> hidden [size, hidden_size], the graph's output
        self.memory_bytes = 0

    def _metadata(self, size: int) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(
            slot_mapping=self.slot_mapping[:size], query_start_loc=list(range(size + 1)), seq_lens=[1] * size,
            block_tables=[], block_size=self.block_size, num_decodes=size,
            decode_block_table=None,
            block_table=self.block_table[:size], seq_lens_t=self.seq_lens[:size],
            cu_seqlens_q=self.cu_seqlens_q[:size + 1], max_prefill_query_len=0,
            # NOTE: 0 = unknown: the split count depends on the batch size alone (see the
            # module docstring).
            max_decode_seq_len=0,
        )

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, self._metadata(size))

    def capture(self, log: bool = True) -> None:
        """Largest size first, all sizes in one memory pool (a smaller graph reuses the
        larger one's activation memory). Each size runs eagerly once first: Triton compiles
        and cuBLAS picks its algorithms outside the capture."""
        t0 = time.perf_counter()
        device = self.input_ids.device
        torch.cuda.synchronize(device)
        # NOTE: torch.cuda.graph empties the allocator's cache as a capture starts: emptied
        # first, so that the profiling forward's cached blocks are not counted against the
        # graphs (an 8B model's 16,384-token forward made the pool read -4,170 MiB).
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(device)
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in sorted(self.sizes, reverse=True):
                self._forward(size)
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                # NOTE: thread-local: a CUDA call another thread makes meanwhile (NCCL's
                # watchdog polling its events, a gRPC thread) cannot invalidate the capture.
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    self.outputs[size] = self._forward(size)
                self.graphs[size] = graph
        torch.cuda.synchronize(device)
        self.memory_bytes = torch.cuda.memory_reserved(device) - before
        (logger.info if log else logger.debug)("captured CUDA graphs of the decode step for %d batch sizes (%s) in %.1f s, %.1f MiB",
                    len(self.sizes), _ladder(self.sizes), time.perf_counter() - t0, self.memory_bytes / 2**20)

    def size_for(self, meta, num_tokens: int) -> int | None:
        """The captured size a step runs at, or None when it must run eagerly: a step with
        prefill rows, or more decode rows than the largest graph."""
        if not isinstance(meta, TritonAttentionMetadata) or meta.num_decodes != num_tokens:
            return None
        if meta.block_table.shape[1] > self.block_table.shape[1]:
            return None
        return padded_size(self.sizes, num_tokens)

    def replay(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: TritonAttentionMetadata) -> torch.Tensor:
        """One decode step of B = len(input_ids) rows through the graph of `size` >= B.
        Returns hidden [B, hidden_size] (a view of the graph's output: read it before the
        next replay)."""
        B, width = input_ids.shape[0], meta.block_table.shape[1]
        self.input_ids[:B].copy_(input_ids)
        self.positions[:B].copy_(positions)
        self.slot_mapping[:B].copy_(meta.slot_mapping)
        self.slot_mapping[B:size].fill_(-1)
        self.block_table[:B, :width].copy_(meta.block_table)
        self.block_table[B:size].zero_()
        self.seq_lens[:B].copy_(meta.seq_lens_t)
        self.seq_lens[B:size].fill_(1)
        self.graphs[size].replay()
        return self.outputs[size][:B]


def _ladder(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 6 else f"{sizes[0]}, {sizes[1]}, ..., {sizes[-1]}"
