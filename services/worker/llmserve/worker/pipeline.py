"""One step's forward on one rank of a TP x PP group (SPMD: every rank runs the same
plan, so every rank knows T, the step's token count, and S, its sampled rows).

    first stage:  input_ids ─▶ layers ─▶ send(hidden, residual) ─▶
    middle stage: recv ─▶ layers ─▶ send ─▶
    last stage:   recv ─▶ layers ─▶ norm ─▶ LM head (all-gather over TP) ─▶ logits [S, V]

Sampling happens on the driver (last stage, TP rank 0) only; the driver then broadcasts
the sampled ids (a device tensor: NCCL on GPUs) so each rank's request states stay
identical.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.worker.distributed import ParallelState


def forward_step(model: nn.Module, parallel: ParallelState, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[torch.Tensor], meta, logit_indices: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of the step. Returns logits [L, vocab] at the L token indices
    `logit_indices` (the sampled ones, and any prompt logprobs positions) on every
    last-stage rank (None elsewhere, or when there are none)."""
    intermediate = None
    if not parallel.is_first_stage:
        p = next(model.parameters())
        intermediate = parallel.recv_from_prev_stage(input_ids.shape[0], model.config.hidden_size, p.dtype, p.device)
    out = model(input_ids, positions, kv_caches, meta, intermediate)
    if not parallel.is_last_stage:
        parallel.send_to_next_stage(*out)
        return None
    if logit_indices.numel() == 0:
        return None
    return model.compute_logits(out[logit_indices])  # [L, vocab]
