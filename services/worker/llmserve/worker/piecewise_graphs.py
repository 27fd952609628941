"""Piecewise CUDA graphs: a step that mixes prefill chunks with decodes runs everything
but attention as graph replays (vLLM's piecewise capture).

A whole-forward graph (cuda_graphs.DecodeGraphs) fits decode steps only: attention over
prefill chunks depends on each chunk's length and context, which a graph cannot
capture. Everything else (embedding, norms, projections, RoPE, the cache write, the MLP)
depends on the step's token count T alone. So the forward is cut at each attention, the
pieces between cuts captured per padded token count n (TOKEN_LADDER), and attention runs
eagerly between replays on the real rows with the real step's metadata:

    piece 0:  ids, positions -> embed -> L0.begin -> L0.project -> RoPE + cache write -> q, k, v, residual
              attention L0 (eager, rows [0, T))                                        -> attn_out
    piece i:  attn_out -> L(i-1).o_proj -> L(i-1).end -> Li.begin -> Li.project -> RoPE + cache write
              attention Li (eager)                                                     -> attn_out
    piece L:  attn_out -> L(L-1).o_proj -> L(L-1).end -> final norm                    -> hidden [n, hidden]

The halves are the layers' own (DecoderLayer.begin / Attention.project / DecoderLayer.end),
which the eager forward runs too. Padding rows (T..n-1) write no KV (slot -1: the cache
write skips them) and never reach attention; their attention output rows are whatever an
earlier step left in attn_out (finite), and every op of a piece is row-wise, so they do
not change the real rows.

Steps above the ladder (> 512 tokens: vLLM's default capture ceiling) are compute-bound
and run eagerly. Off CUDA the pieces run as plain calls over the same static buffers
(EagerPieces), so the CPU tests exercise the padding, the buffers and the cuts.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch
from torch import nn

from llmserve.worker.layers.rotary import apply_rotary_qkv, apply_rotary_qkv_and_write_kv, rotary_kv_write_applies

logger = logging.getLogger(__name__)

# Token counts captured: powers of two to 128, then multiples of 64 (a 256-token chunk
# with 63 decodes pads 319 -> 320, not 512), up to min(512, max_num_batched_tokens).
LADDER_CEILING = 512
_POWERS_UP_TO = 128
_STRIDE = 64

State = Any  # what one piece hands the next: (q, k, v, residual, ropes), or hidden [n, hidden]
Piece = Callable[[State], State]


def token_ladder(max_num_batched_tokens: int) -> list[int]:
    """Token counts to capture: 8, 16, 32, 64, 128, 192, ... up to min(512, the step's
    token budget), the cap itself included."""
    cap = min(LADDER_CEILING, max_num_batched_tokens)
    sizes = {s for s in (8, 16, 32, 64, _POWERS_UP_TO) if s <= cap}
    sizes.update(range(_POWERS_UP_TO + _STRIDE, cap + 1, _STRIDE))
    sizes.add(cap)
    return sorted(sizes)


def rotate_and_store(qkv: torch.Tensor, rope, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                     num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RoPE on qkv [n, (H + 2*KVH) * D] and k, v stored at their slots of kv_cache (slot
    -1: stored nowhere) -> q [n, H, D], k, v [n, KVH, D]: the part of rotary_attention
    that depends on the token count only."""
    if rotary_kv_write_applies(qkv, rope, kv_cache):  # CPU: one C++ pass
        return apply_rotary_qkv_and_write_kv(qkv, rope, num_heads, num_kv_heads, head_dim, kv_cache, slot_mapping)
    q, k, v = apply_rotary_qkv(qkv, rope, num_heads, num_kv_heads, head_dim)
    if kv_cache.is_cuda:
        from llmserve.kernels.triton import reshape_and_cache

        reshape_and_cache(k, v, kv_cache, slot_mapping)
    else:
        _, nb, bs, KVH, D = kv_cache.shape
        keep = slot_mapping >= 0  # (a host-side mask: the CPU has nothing to sync)
        flat = kv_cache.view(2, nb * bs, KVH, D)
        flat[0].index_copy_(0, slot_mapping[keep], k[keep])
        flat[1].index_copy_(0, slot_mapping[keep], v[keep])
    return q, k, v


class EagerPieces:
    """The capture backend off CUDA: a "graph" is its piece called again on each run."""

    def capture(self, fn: Piece, state: State) -> tuple[Piece, State]:
        return fn, fn(state)


class CudaGraphPieces:
    """The capture backend on CUDA: one graph per piece, all in one memory pool. A replay
    ignores the state it is given: the graph reads the tensors it was captured with,
    which are the previous piece's held outputs, the very objects a run passes along."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Piece, state: State) -> tuple[Piece, State]:
        graph = torch.cuda.CUDAGraph()
        # NOTE: thread-local: a CUDA call another thread makes meanwhile (NCCL's watchdog,
        # a gRPC thread) cannot invalidate the capture.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            outputs = fn(state)

        def replay(_: State) -> State:
            graph.replay()
            return outputs

        return replay, outputs


class PiecewiseGraphs:
    """The forward of `model` (a DecoderModel, one pipeline stage) cut at each attention,
    its pieces captured for each token count in `sizes` over `kv_caches` (the graphs hold
    their addresses: capture after the cache is allocated, for good)."""

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], sizes: list[int], device: torch.device):
        self.model, self.kv_caches, self.sizes = model, kv_caches, sizes
        self.layers = list(model.layers)
        self.backend = CudaGraphPieces() if device.type == "cuda" else EagerPieces()
        n, attn = max(sizes), self.layers[0].self_attn
        dtype = next(model.parameters()).dtype
        # Static inputs: every run reads these buffers.
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)  # [n]
        self.positions = torch.zeros(n, dtype=torch.long, device=device)  # [n]
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)  # [n]
        # Each layer's attention output, written between pieces: [n, H/tp * D]
        self.attn_out = torch.zeros(n, attn.num_heads * attn.head_dim, dtype=dtype, device=device)
        self.pieces: dict[int, list[Piece]] = {}  # size -> its L + 1 pieces, in order
        # NOTE: every piece's outputs stay referenced for as long as the graphs live. The
        # pool hands memory no live tensor holds to the next capture; were a piece's
        # outputs dropped, a later piece (of this size or a smaller one) could be given
        # their memory for its own tensors, and its replay would overwrite q, k, v or the
        # residual stream while the attention after the piece, or the next piece, still
        # has to read them. (The cost: outputs of every size kept, see memory_bytes.)
        self.outputs: dict[int, list[State]] = {}
        self.memory_bytes = 0

    def _piece_fns(self, size: int) -> list[Piece]:
        last = len(self.layers)
        return [lambda _: self._first(size)] + [
            (lambda state, i=i: self._middle(i, state, size)) for i in range(1, last)
        ] + [lambda state: self._last(state, size)]

    def _first(self, size: int) -> State:
        ropes = self.model.ropes(self.positions[:size])
        return self._open_layer(0, self.model.embed(self.input_ids[:size]), None, ropes, size)

    def _middle(self, i: int, state: State, size: int) -> State:
        """Closes layer i - 1 (its attention output in attn_out), opens layer i."""
        *_, residual, ropes = state
        hidden, residual = self._close_layer(i - 1, residual, size)
        return self._open_layer(i, hidden, residual, ropes, size)

    def _last(self, state: State, size: int) -> torch.Tensor:
        *_, residual, _ = state
        hidden, residual = self._close_layer(len(self.layers) - 1, residual, size)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden  # [n, hidden]

    def _open_layer(self, i: int, hidden, residual, ropes, size: int) -> State:
        layer = self.layers[i]
        hidden, residual = layer.begin(hidden, residual)
        attn = layer.self_attn
        q, k, v = rotate_and_store(attn.project(hidden), ropes[layer.rope], self.kv_caches[i],
                                   self.slot_mapping[:size], attn.num_heads, attn.num_kv_heads, attn.head_dim)
        return q, k, v, residual, ropes

    def _close_layer(self, i: int, residual: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[i]
        return layer.end(layer.self_attn.o_proj(self.attn_out[:size]), residual)

    def capture(self, log: bool = True) -> None:
        """Largest size first, all pieces of all sizes in one memory pool. On CUDA each
        size's pieces run eagerly once first (Triton compiles and cuBLAS picks its
        algorithms outside the capture); the slots are -1 throughout: nothing is stored."""
        t0 = time.perf_counter()
        device = self.input_ids.device
        on_cuda = device.type == "cuda"
        if on_cuda:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()  # (as DecodeGraphs.capture: a capture empties it anyway)
            before = torch.cuda.memory_reserved(device)
        with torch.inference_mode():
            for size in sorted(self.sizes, reverse=True):
                fns = self._piece_fns(size)
                if on_cuda:
                    state = None
                    for fn in fns:
                        state = fn(state)
                    torch.cuda.synchronize(device)
                state, pieces, outputs = None, [], []
                for fn in fns:
                    piece, state = self.backend.capture(fn, state)
                    pieces.append(piece)
                    outputs.append(state)
                self.pieces[size], self.outputs[size] = pieces, outputs
        if on_cuda:
            torch.cuda.synchronize(device)
            self.memory_bytes = torch.cuda.memory_reserved(device) - before
        (logger.info if log else logger.debug)(
            "captured piecewise CUDA graphs of mixed steps for %d token counts (%s), %d pieces each, in %.1f s, "
            "%.1f MiB", len(self.sizes), ", ".join(map(str, self.sizes)), len(self.layers) + 1,
            time.perf_counter() - t0, self.memory_bytes / 2**20)

    def size_for(self, num_tokens: int) -> int | None:
        """The captured token count a step of num_tokens runs at (None: eagerly)."""
        return next((s for s in self.sizes if s >= num_tokens), None)

    def run(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """One step of T = len(input_ids) tokens through the pieces of `size` >= T, the
        attention of each layer run eagerly on rows [0, T) with `meta`. Returns hidden
        [T, hidden_size] (a view of the last piece's output: read it before the next run)."""
        T = input_ids.shape[0]
        self.input_ids[:T].copy_(input_ids)
        self.positions[:T].copy_(positions)
        self.slot_mapping[:T].copy_(meta.slot_mapping)
        self.slot_mapping[T:size].fill_(-1)
        pieces = self.pieces[size]
        state = pieces[0](None)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, self.kv_caches)):
            q, k, v = state[0][:T], state[1][:T], state[2][:T]  # the keys are in the cache already
            o = layer.self_attn.attn.forward(q, k, v, kv_cache, meta, kv_stored=True)  # [T, H/tp, D]
            self.attn_out[:T].copy_(o.view(T, -1))
            state = pieces[i + 1](state)
        return state[:T]
