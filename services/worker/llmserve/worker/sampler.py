"""Token sampling for a batch of rows, each with its own settings (`SamplingRows`, built
from the rows' SamplingParams), on the device the logits are on.

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
from llmserve.contract.sampling import SamplingParams

_GREEDY_EPS = 1e-5


def seeded_generator_seed(seed: int, output_index: int) -> int:
    return (seed * 1_000_003 + output_index) % (2**63)


@dataclass(frozen=True)
class SamplingRows:
    """One step's sampled rows' settings, as the sampler reads them: the worker's one
    conversion of SamplingParams (`from_params`, called by InputBatch.build_inputs). A
    setting the sampler uses is one column here. On the host; the sampler moves what
    it needs to the logits' device."""

    temperature: torch.Tensor  # [S] float32; <= _GREEDY_EPS: greedy
    top_p: torch.Tensor  # [S] float32; 1: off
    top_k: torch.Tensor  # [S] long; <= 0: off
    seed: list[int | None]  # [S]; None: the sampler's shared generator
    logprobs: list[int | None]  # [S]; None: none; k: the sampled token's and the top k
    output_index: list[int]  # [S]: tokens the row generated before this one (a seeded row's draw)

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], output_index: Sequence[int]) -> SamplingRows:
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long),
            seed=[p.seed for p in params],
            logprobs=[p.logprobs for p in params],
            output_index=list(output_index),
        )

    def __len__(self) -> int:
        return len(self.seed)

    def select(self, rows: list[int]) -> SamplingRows:
        """These rows only, in this order."""
        index = torch.tensor(rows, dtype=torch.long)
        return SamplingRows(self.temperature[index], self.top_p[index], self.top_k[index],
                            [self.seed[i] for i in rows], [self.logprobs[i] for i in rows],
                            [self.output_index[i] for i in rows])


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

    def __call__(self, logits: torch.Tensor, rows: SamplingRows) -> SamplerOutput:
        """logits: [S, V], one row per entry of `rows`."""
        logits = logits.float()
        S, V = logits.shape
        # Greedy for every row (random rows overwritten below). NOTE: max(dim) returns the
        # first maximal index like argmax, and on CPU is faster over a large vocabulary.
        tokens = logits.max(dim=-1).indices
        rand_rows = (rows.temperature > _GREEDY_EPS).nonzero()[:, 0].tolist()
        if rand_rows:
            index = torch.tensor(rand_rows, device=logits.device)
            sub = rows.select(rand_rows)
            probs = _filtered_probs(logits[index], sub)  # [R, V]
            noise = self._exponential_noise(sub, V)
            tokens[index] = (probs / noise).argmax(dim=-1)
        return SamplerOutput(tokens, _logprobs(logits, rows, tokens))

    def _exponential_noise(self, rows: SamplingRows, V: int) -> torch.Tensor:
        """E ~ Exp(1): [R, V], a seeded row's from its own (seed, output index) generator."""
        dev = self.device
        noise = torch.empty(len(rows), V, device=dev)
        unseeded = [i for i, seed in enumerate(rows.seed) if seed is None]
        if unseeded:
            block = torch.empty(len(unseeded), V, device=dev).exponential_(generator=self.generator)
            noise[torch.tensor(unseeded, device=dev)] = block
        for i, seed in enumerate(rows.seed):
            if seed is not None:
                g = torch.Generator(device=dev).manual_seed(seeded_generator_seed(seed, rows.output_index[i]))
                noise[i].exponential_(generator=g)
        return noise.clamp_(min=1e-30)  # NOTE: a 0 draw would make 0/0 = nan win the argmax


def _filtered_probs(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """Temperature, then top-k, then top-p; one softmax for all rows. logits: [R, V]."""
    R, V = logits.shape
    dev = logits.device
    logits = logits / rows.temperature.to(dev)[:, None]
    ks = torch.where(rows.top_k > 0, rows.top_k.clamp(max=V), V)  # [R] long, V: off
    cut_k = bool((ks < V).any())
    cut_p = bool((rows.top_p < 1.0).any())
    if dev.type == "cuda" and (cut_k or cut_p):
        # Sort-free Triton filter: one program per row, no per-row host sync.
        from llmserve.kernels.triton import top_k_top_p_filter

        return top_k_top_p_filter(logits, ks.to(dev, torch.int32), rows.top_p.to(dev)).softmax(dim=-1)
    if cut_k:
        top_vals = logits.topk(int(ks.max()), dim=-1).values  # [R, max_k], descending
        kth = top_vals.gather(1, ks.to(dev)[:, None] - 1)  # [R, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cut_p:
        p_col = rows.top_p.to(dev)[:, None]  # [R, 1]
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


def _logprobs(logits: torch.Tensor, rows: SamplingRows, tokens: torch.Tensor) -> list[TokenLogprobs | None]:
    """From log_softmax of the raw float32 logits (before temperature / top-k / top-p).
    tokens: [S] long, the sampled ids (on the logits' device)."""
    asked = rows.logprobs
    out: list[TokenLogprobs | None] = [None] * len(asked)
    rows_asking = [i for i, k in enumerate(asked) if k is not None]
    if not rows_asking:
        return out
    dev = logits.device
    index = torch.tensor(rows_asking, device=dev)
    lp = torch.log_softmax(logits[index], dim=-1)  # [L, V]
    chosen_ids = tokens[index]  # [L]
    chosen = lp.gather(1, chosen_ids[:, None])[:, 0]  # [L]
    max_k = min(max(max(asked[i] or 0 for i in rows_asking), 0), lp.shape[1])
    # One read back of everything the rows asked for.
    if max_k:
        top_vals, top_ids = lp.topk(max_k, dim=-1)
        chosen_ids, chosen, top_vals, top_ids = (t.cpu() for t in (chosen_ids, chosen, top_vals, top_ids))
    else:
        chosen_ids, chosen = chosen_ids.cpu(), chosen.cpu()
    for j, i in enumerate(rows_asking):
        k = min(asked[i] or 0, lp.shape[1])
        ids = tuple(top_ids[j, :k].tolist()) if k else ()
        vals = tuple(top_vals[j, :k].tolist()) if k else ()
        out[i] = TokenLogprobs(int(chosen_ids[j]), float(chosen[j]), ids, vals)
    return out
