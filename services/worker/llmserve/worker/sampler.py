"""Token sampling for a batch of rows, each with its own WorkerSamplingParams, on the
device the logits are on.

Random rows use the exponential race: token = argmax(probs / E), E ~ Exp(1) i.i.d.,
which samples from probs. A seeded row draws its E from a generator seeded by
(seed, number of tokens it generated so far), so its token does not depend on the rest
of the batch nor on preemption; unseeded rows share one generator.

Everything stays on the device: the caller reads the sampled ids back once per step
(after the parallel group has shared them). Logprobs, where a row asks for them, are one
more read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llmserve.contract.outputs import TokenLogprobs
from llmserve.contract.plan import WorkerSamplingParams

_GREEDY_EPS = 1e-5


def seeded_generator_seed(seed: int, output_index: int) -> int:
    return (seed * 1_000_003 + output_index) % (2**63)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [S] long, on the logits' device
    logprobs: list[TokenLogprobs | None]  # [S]; None where a row did not ask


class Sampler:
    def __init__(self, seed: int | None = None, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, params: Sequence[WorkerSamplingParams], output_indices: Sequence[int]
    ) -> SamplerOutput:
        """logits: [S, V]; output_indices[i] = tokens row i generated before this one."""
        logits = logits.float()
        S, V = logits.shape
        # Greedy for every row (random rows overwritten below). NOTE: max(dim) returns the
        # first maximal index like argmax, and on CPU is faster over a large vocabulary.
        tokens = logits.max(dim=-1).indices
        rand_rows = [i for i, p in enumerate(params) if p.temperature > _GREEDY_EPS]
        if rand_rows:
            rows = torch.tensor(rand_rows, device=logits.device)
            sub = [params[i] for i in rand_rows]
            probs = _filtered_probs(logits[rows], sub)  # [R, V]
            noise = self._exponential_noise(sub, [output_indices[i] for i in rand_rows], V)
            tokens[rows] = (probs / noise).argmax(dim=-1)
        return SamplerOutput(tokens, _logprobs(logits, params, tokens))

    def _exponential_noise(self, params: list[WorkerSamplingParams], output_indices: list[int], V: int) -> torch.Tensor:
        dev = self.device
        noise = torch.empty(len(params), V, device=dev)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            block = torch.empty(len(unseeded), V, device=dev).exponential_(generator=self.generator)
            noise[torch.tensor(unseeded, device=dev)] = block
        for i, p in enumerate(params):
            if p.seed is not None:
                g = torch.Generator(device=dev).manual_seed(seeded_generator_seed(p.seed, output_indices[i]))
                noise[i].exponential_(generator=g)
        return noise.clamp_(min=1e-30)  # NOTE: a 0 draw would make 0/0 = nan win the argmax


def _filtered_probs(logits: torch.Tensor, params: list[WorkerSamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, then top-p; one softmax for all rows. logits: [R, V]."""
    R, V = logits.shape
    dev = logits.device
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
    logits = logits / temps[:, None]
    ks = [min(p.top_k, V) if p.top_k > 0 else V for p in params]
    top_ps = [p.top_p for p in params]
    if dev.type == "cuda" and (any(k < V for k in ks) or any(p < 1.0 for p in top_ps)):
        # Sort-free Triton filter: one program per row, no per-row host sync.
        from llmserve.kernels.triton import top_k_top_p_filter

        return top_k_top_p_filter(logits, torch.tensor(ks, dtype=torch.int32, device=dev),
                                  torch.tensor(top_ps, dtype=torch.float32, device=dev)).softmax(dim=-1)
    if any(k < V for k in ks):
        top_vals = logits.topk(max(ks), dim=-1).values  # [R, max_k], descending
        kth = top_vals.gather(1, torch.tensor(ks, device=dev)[:, None] - 1)  # [R, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p < 1.0 for p in top_ps):
        p_col = torch.tensor(top_ps, dtype=torch.float32, device=dev)[:, None]  # [R, 1]
        sorted_logits = logits.sort(dim=-1, descending=True).values
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # drop a token when the tokens ranked above it already reach top_p (the top one stays)
        drop_sorted = (mass_before >= p_col) & (p_col < 1.0)
        drop_sorted[:, 0] = False
        # Then keep every token tied with the last one kept: the cut does not depend on how
        # the sort ordered equal logits (the Triton filter's rule too).
        last_kept = sorted_logits.masked_fill(drop_sorted, float("inf")).min(dim=-1, keepdim=True).values  # [R, 1]
        logits = logits.masked_fill(logits < last_kept, float("-inf"))
    return logits.softmax(dim=-1)


def _logprobs(
    logits: torch.Tensor, params: Sequence[WorkerSamplingParams], tokens: torch.Tensor
) -> list[TokenLogprobs | None]:
    """From log_softmax of the raw float32 logits (before temperature / top-k / top-p).
    tokens: [S] long, the sampled ids (on the logits' device)."""
    out: list[TokenLogprobs | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return out
    dev = logits.device
    index = torch.tensor(rows, device=dev)
    lp = torch.log_softmax(logits[index], dim=-1)  # [L, V]
    chosen_ids = tokens[index]  # [L]
    chosen = lp.gather(1, chosen_ids[:, None])[:, 0]  # [L]
    max_k = min(max(max(params[i].logprobs or 0 for i in rows), 0), lp.shape[1])
    # One read back of everything the rows asked for.
    if max_k:
        top_vals, top_ids = lp.topk(max_k, dim=-1)
        chosen_ids, chosen, top_vals, top_ids = (t.cpu() for t in (chosen_ids, chosen, top_vals, top_ids))
    else:
        chosen_ids, chosen = chosen_ids.cpu(), chosen.cpu()
    for j, i in enumerate(rows):
        k = min(params[i].logprobs or 0, lp.shape[1])
        ids = tuple(top_ids[j, :k].tolist()) if k else ()
        vals = tuple(top_vals[j, :k].tolist()) if k else ()
        out[i] = TokenLogprobs(int(chosen_ids[j]), float(chosen[j]), ids, vals)
    return out
