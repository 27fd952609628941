"""Token sampling for a batch of rows, each with its own WorkerSamplingParams.

Random rows use the exponential race: token = argmax(probs / E), E ~ Exp(1) i.i.d.,
which samples from probs. A seeded row draws its E from a generator seeded by
(seed, number of tokens it generated so far), so its token does not depend on the rest
of the batch nor on preemption; unseeded rows share one generator.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmserve.contract.outputs import TokenLogprobs
from llmserve.contract.plan import WorkerSamplingParams

_GREEDY_EPS = 1e-5


def seeded_generator_seed(seed: int, output_index: int) -> int:
    return (seed * 1_000_003 + output_index) % (2**63)


class Sampler:
    def __init__(self, seed: int | None = None):
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, params: Sequence[WorkerSamplingParams], output_indices: Sequence[int]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [S, V]; output_indices[i] = tokens row i generated before this one.
        Returns the sampled token ids and per-row logprobs (None where not requested)."""
        logits = logits.float()
        S, V = logits.shape
        # Greedy for every row (random rows overwritten below). NOTE: max(dim) returns the
        # first maximal index like argmax, and on CPU is faster over a large vocabulary.
        tokens = logits.max(dim=-1).indices
        rand_rows = [i for i, p in enumerate(params) if p.temperature > _GREEDY_EPS]
        if rand_rows:
            rows = torch.tensor(rand_rows)
            sub = [params[i] for i in rand_rows]
            probs = _filtered_probs(logits[rows], sub)  # [R, V]
            noise = self._exponential_noise(sub, [output_indices[i] for i in rand_rows], V)
            tokens[rows] = (probs / noise).argmax(dim=-1)
        token_list = tokens.tolist()
        return token_list, _logprobs(logits, params, token_list)

    def _exponential_noise(self, params: list[WorkerSamplingParams], output_indices: list[int], V: int) -> torch.Tensor:
        noise = torch.empty(len(params), V)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            block = torch.empty(len(unseeded), V).exponential_(generator=self.generator)
            noise[torch.tensor(unseeded)] = block
        for i, p in enumerate(params):
            if p.seed is not None:
                g = torch.Generator().manual_seed(seeded_generator_seed(p.seed, output_indices[i]))
                noise[i].exponential_(generator=g)
        return noise.clamp_(min=1e-30)  # NOTE: a 0 draw would make 0/0 = nan win the argmax


def _filtered_probs(logits: torch.Tensor, params: list[WorkerSamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, then top-p; one softmax for all rows. logits: [R, V]."""
    R, V = logits.shape
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    logits = logits / temps[:, None]
    ks = [min(p.top_k, V) if p.top_k > 0 else V for p in params]
    if any(k < V for k in ks):
        top_vals = logits.topk(max(ks), dim=-1).values  # [R, max_k], descending
        kth = top_vals.gather(1, torch.tensor(ks)[:, None] - 1)  # [R, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    top_ps = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    if bool((top_ps < 1.0).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # drop a token when the tokens ranked above it already reach top_p (the top one stays)
        drop_sorted = (mass_before >= top_ps[:, None]) & (top_ps[:, None] < 1.0)
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


def _logprobs(
    logits: torch.Tensor, params: Sequence[WorkerSamplingParams], tokens: list[int]
) -> list[TokenLogprobs | None]:
    """From log_softmax of the raw float32 logits (before temperature / top-k / top-p)."""
    out: list[TokenLogprobs | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return out
    lp = torch.log_softmax(logits[torch.tensor(rows)], dim=-1)  # [L, V]
    max_k = max(max(params[i].logprobs or 0 for i in rows), 0)
    top_vals, top_ids = lp.topk(min(max_k, lp.shape[1]), dim=-1) if max_k else (None, None)
    for j, i in enumerate(rows):
        k = min(params[i].logprobs or 0, lp.shape[1])
        ids = tuple(top_ids[j, :k].tolist()) if k else ()
        vals = tuple(top_vals[j, :k].tolist()) if k else ()
        out[i] = TokenLogprobs(tokens[i], float(lp[j, tokens[i]]), ids, vals)
    return out
