"""Token sampling for a batch of rows, each with its own settings (`SamplingRows`, built
from the rows' SamplingParams), on the device the logits are on.

The order, vLLM's (rows that do not use a setting skip it, and a batch where no row
uses one pays nothing for it):

    logits (float32)
      -> structured output: ids a row's grammar forbids set to -inf
      -> logit_bias added                       }
      -> stop ids masked while < min_tokens     }
      -> bad words' ids masked                  } what greedy rows take the argmax of
      -> repetition, frequency, presence        }
      -> temperature -> min_p -> top-k -> top-p -> the exponential race (random rows)

Penalties (vLLM's definitions): a token seen in the prompt or the output so far has its
logit l divided by repetition_penalty r if l > 0, else multiplied by it; then l -=
frequency_penalty * (times in the output) and l -= presence_penalty * (in the output at
all); prompt tokens count for repetition only. Bad words (vLLM's): a one-token
sequence's id is masked always, a longer sequence's last id where the row's output ends
with the rest of it. min_p keeps a token whose probability
after temperature is at least min_p times the most likely token's. Logprobs are of the
raw logits (before all of it, taken first), as vLLM's default.

Random rows use the exponential race: token = argmax(probs / E), E ~ Exp(1) i.i.d.,
which samples from probs. A seeded row draws its E from a generator seeded by
(seed, number of tokens it generated so far), so its token does not depend on the rest
of the batch nor on preemption; unseeded rows share one generator.

Everything stays on the device: the caller reads the sampled ids back once per step
(after the parallel group has shared them). Logprobs, where a row asks for them, are one
more read.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import ClassVar

import numpy as np
import torch

from llmserve.contract.outputs import TokenLogprobs
from llmserve.contract.sampling import SamplingParams
from llmserve.kernels import cpu as cpu_kernels
from llmserve.worker.device import to_device_async

_GREEDY_EPS = 1e-5


def seeded_generator_seed(seed: int, output_index: int) -> int:
    return (seed * 1_000_003 + output_index) % (2**63)


@dataclass(frozen=True)
class TokenBitmask:
    """Structured output: the allowed ids of a step's constrained rows only (a plain row
    batched with them pays nothing for the mask). Built by Grammars.fill_bitmask."""

    rows: torch.Tensor  # [C] long: the constrained rows' indices among the step's S sampled rows
    bits: torch.Tensor  # [C, ceil(V / 32)] int32: a bit per token id rows[i] may sample


@dataclass(frozen=True)
class InFlightIds:
    """The ids a pipelined loop's step in flight sampled, where the history of a row with a
    penalty or a multi-token bad word ends in one of them (its placeholder: the id is on
    the device, not yet on the host). The penalties and the bad words read it there, so
    such a row need not wait for the step's read back."""

    ids: torch.Tensor  # [S'] long on the device: the step in flight's sampled ids
    # row (its index in the step's S sampled rows) -> (the placeholder's position in the
    # row's history, its index in ids)
    holes: dict[int, tuple[int, int]]


@dataclass(frozen=True)
class SamplingRows:
    """One step's sampled rows' settings, as the sampler reads them: gathered from the
    worker's SamplingTable (InputBatch.build_inputs), or built by `from_params`. A
    setting the sampler uses is one column here, named as the field; ROW_STATE are the
    rows' state, not settings. On the host; the sampler moves what it needs to the
    logits' device."""

    ROW_STATE: ClassVar[frozenset[str]] = frozenset({"output_index", "token_ids", "num_prompt_tokens",
                                                     "token_bitmask", "in_flight"})

    temperature: torch.Tensor  # [S] float32; <= _GREEDY_EPS: greedy
    top_p: torch.Tensor  # [S] float32; 1: off
    top_k: torch.Tensor  # [S] long; <= 0: off
    seed: list[int | None]  # [S]; None: the sampler's shared generator
    logprobs: list[int | None]  # [S]; None: none; k: the sampled token's and the top k
    output_index: list[int]  # [S]: tokens the row generated before this one (a seeded row's draw)
    min_p: torch.Tensor  # [S] float32; 0: off
    repetition_penalty: torch.Tensor  # [S] float32; 1: off
    frequency_penalty: torch.Tensor  # [S] float32; 0: off
    presence_penalty: torch.Tensor  # [S] float32; 0: off
    logit_bias: list[tuple[tuple[int, float], ...]]  # [S]; (): none
    min_tokens: torch.Tensor  # [S] long
    # [S]: the ids a row under min_tokens must not sample (the scheduler adds the eos ids).
    stop_token_ids: list[tuple[int, ...]]
    bad_words_token_ids: list[tuple[tuple[int, ...], ...]]  # [S]; (): none
    # [S]: prompt + the tokens before this one, and how many of them are the prompt; read
    # for the rows with a penalty or a multi-token bad word only (references to the
    # worker's lists, not copies).
    token_ids: list[Sequence[int]]
    num_prompt_tokens: list[int]
    # The constrained rows' allowed ids (structured output: their grammar matchers',
    # worker/structured_output.py); None: no row is constrained.
    token_bitmask: TokenBitmask | None = None
    # Penalized rows whose history ends in the step in flight's placeholder (None: no row).
    in_flight: InFlightIds | None = None

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], output_index: Sequence[int],
                    token_ids: Sequence[Sequence[int]] | None = None,
                    num_prompt_tokens: Sequence[int] | None = None,
                    token_bitmask: TokenBitmask | None = None) -> SamplingRows:
        """The rows of `params`, in order (a SamplingTable holding just them)."""
        prompt = list(num_prompt_tokens) if num_prompt_tokens is not None else [0] * len(params)
        table = SamplingTable(len(params))
        for row, (p, n) in enumerate(zip(params, prompt)):
            table.write(row, p, n)
        return table.gather(range(len(params)), np.add(output_index, prompt, dtype=np.int64), token_ids,
                            token_bitmask)

    def __len__(self) -> int:
        return len(self.seed)

    def select(self, rows: list[int]) -> SamplingRows:
        """These rows only, in this order."""
        index = torch.tensor(rows, dtype=torch.long)
        picked = {}
        for f in fields(self):
            if f.name in ("token_bitmask", "in_flight"):  # Applied before rows are selected.
                continue
            column = getattr(self, f.name)
            picked[f.name] = column[index] if isinstance(column, torch.Tensor) else [column[i] for i in rows]
        return SamplingRows(**picked)


_FLOAT_SETTINGS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
_LONG_SETTINGS = ("top_k", "min_tokens")


class SamplingTable:
    """The sampling settings of the requests a worker holds, one row each (InputBatch's
    rows), written once when a request arrives: a step's SamplingRows gathers its sampled
    rows' columns (one index per dtype), not each row's SamplingParams again (vLLM V1's
    persistent batch). The worker's one conversion of SamplingParams.

        floats  [6, capacity] float32   row r: temperature, top_p, min_p, the penalties of the request in row r
        longs   [3, capacity] int64     top_k, min_tokens, and its prompt length (row state, fixed per request)
        objects [5, capacity] object    seed, logprobs, logit_bias, stop ids, bad words (Python values)
    """

    FLOATS: ClassVar[tuple[str, ...]] = _FLOAT_SETTINGS
    LONGS: ClassVar[tuple[str, ...]] = _LONG_SETTINGS
    # Every other setting of SamplingRows, kept as the Python values the sampler reads.
    OBJECTS: ClassVar[tuple[str, ...]] = tuple(f.name for f in fields(SamplingRows) if f.name not in
                                               SamplingRows.ROW_STATE | {*_FLOAT_SETTINGS, *_LONG_SETTINGS})

    def __init__(self, capacity: int = 64):
        self._floats = np.zeros((len(self.FLOATS), capacity), np.float32)
        self._longs = np.zeros((len(self.LONGS) + 1, capacity), np.int64)  # (+ the prompt lengths)
        self._objects = np.full((len(self.OBJECTS), capacity), None, dtype=object)

    def write(self, row: int, params: SamplingParams, num_prompt_tokens: int) -> None:
        """Row `row` holds `params`, for a request of this prompt length, from now on
        (the table grown to hold it)."""
        while row >= self._floats.shape[1]:
            self._grow()
        self._floats[:, row] = [getattr(params, name) for name in self.FLOATS]
        self._longs[:, row] = [*(getattr(params, name) for name in self.LONGS), num_prompt_tokens]
        for i, name in enumerate(self.OBJECTS):
            self._objects[i, row] = getattr(params, name)  # (one element: a tuple is stored as it is)

    def gather(self, rows: Sequence[int], num_known: np.ndarray, token_ids: Sequence[Sequence[int]] | None = None,
               token_bitmask: TokenBitmask | None = None, in_flight: InFlightIds | None = None) -> SamplingRows:
        """SamplingRows of these rows, in this order (a row may repeat: a row verifying
        drafts samples at each). num_known: [S] int64, the tokens before each sample
        (prompt, outputs, and a draft row's drafts before it); token_ids: each sample's
        history, read by the sampler for the rows with a penalty or a multi-token bad
        word (None: no row reads it); in_flight: where a penalized row's history ends in
        a placeholder."""
        index = np.asarray(rows, dtype=np.int64)  # [S]
        floats = torch.from_numpy(self._floats[:, index])  # [6, S]: each column a contiguous row of it
        longs = self._longs[:, index]  # [3, S]
        prompt = longs[-1]
        return SamplingRows(
            **dict(zip(self.FLOATS, floats)), **dict(zip(self.LONGS, torch.from_numpy(longs[:-1]))),
            **dict(zip(self.OBJECTS, self._objects[:, index].tolist())),
            output_index=(num_known - prompt).tolist(),
            token_ids=list(token_ids) if token_ids is not None else [()] * len(index),
            num_prompt_tokens=prompt.tolist(), token_bitmask=token_bitmask, in_flight=in_flight)

    def _grow(self) -> None:
        self._floats, self._longs, self._objects = (np.concatenate([t, np.full_like(t, fill)], axis=1) for t, fill in
                                                    ((self._floats, 0), (self._longs, 0), (self._objects, None)))


@dataclass(frozen=True)
class PendingLogprobs:
    """The sampled tokens' logprobs of the rows that ask, as tensors not read yet: on the
    device from the sampler, so that a pipelined step reads them back with its ids (the
    worker copies them beside the ids, without a wait: launched_step.HostIds), never
    inside the launch."""

    num_rows: int  # S
    rows: tuple[int, ...] = ()  # [L]: the rows asking
    ks: tuple[int, ...] = ()  # [L]: each one's top k
    # token ids [L] long, their logprobs [L] float32, ranks [L] long, the top ids [L, k]
    # long and logprobs [L, k] float32 (k: the largest asked for); () when no row asks
    tensors: tuple[torch.Tensor, ...] = ()

    def with_tensors(self, tensors: tuple[torch.Tensor, ...]) -> PendingLogprobs:
        """The same logprobs held in `tensors` (their copies on the host)."""
        return replace(self, tensors=tensors)

    def read(self) -> list[TokenLogprobs | None]:
        """[S]: each asking row's TokenLogprobs (its own top k), None for the others."""
        out: list[TokenLogprobs | None] = [None] * self.num_rows
        if self.rows:
            for i, got in zip(self.rows, as_token_logprobs(self.tensors, self.ks)):
                out[i] = got
        return out


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [S] long, on the logits' device
    pending_logprobs: PendingLogprobs  # not read back yet (see PendingLogprobs)

    @property
    def logprobs(self) -> list[TokenLogprobs | None]:
        """[S]; None where a row did not ask (read back now)."""
        return self.pending_logprobs.read()


class Sampler:
    def __init__(self, seed: int | None = None, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: SamplingRows) -> SamplerOutput:
        """logits: [S, V], one row per entry of `rows`. NOTE: float32 logits are adjusted
        in place (logit_bias, min_tokens, penalties): a step's logits are read once."""
        if logits.dtype != torch.float32 and _greedy_as_is(rows):
            # The argmax of bfloat16 logits is their float32 copy's (widening is exact and
            # keeps the order): no [S, V] float32 copy (64 x 49,152: 12 MB written).
            return SamplerOutput(greedy_ids(logits), PendingLogprobs(len(rows)))
        logits = logits.float()
        # Logprobs are of the raw logits: taken before the in-place adjustments.
        raw_logprobs = _raw_logprobs(logits, rows)
        if rows.token_bitmask is not None:  # Structured output: ids the grammars forbid -> -inf.
            _apply_token_bitmask(logits, rows.token_bitmask)
        logits = adjusted_logits(logits, rows)
        S, V = logits.shape
        tokens = greedy_ids(logits)  # Greedy for every row (random rows overwritten below).
        rand_rows = (rows.temperature > _GREEDY_EPS).nonzero()[:, 0].tolist()
        if rand_rows:
            index = to_device_async(torch.tensor(rand_rows), logits.device)
            sub = rows.select(rand_rows)
            probs = _filtered_probs(logits[index], sub)  # [R, V]
            noise = self._exponential_noise(sub, V)
            tokens[index] = (probs / noise).argmax(dim=-1)
        return SamplerOutput(tokens, _logprobs(raw_logprobs, rows, tokens))

    def _exponential_noise(self, rows: SamplingRows, V: int) -> torch.Tensor:
        """E ~ Exp(1): [R, V], a seeded row's from its own (seed, output index) generator."""
        dev = self.device
        noise = torch.empty(len(rows), V, device=dev)
        unseeded = [i for i, seed in enumerate(rows.seed) if seed is None]
        if unseeded:
            block = torch.empty(len(unseeded), V, device=dev).exponential_(generator=self.generator)
            noise[to_device_async(torch.tensor(unseeded), dev)] = block
        for i, seed in enumerate(rows.seed):
            if seed is not None:
                g = torch.Generator(device=dev).manual_seed(seeded_generator_seed(seed, rows.output_index[i]))
                noise[i].exponential_(generator=g)
        return noise.clamp_(min=1e-30)  # NOTE: a 0 draw would make 0/0 = nan win the argmax


def _greedy_as_is(rows: SamplingRows) -> bool:
    """True when every row samples the raw logits' argmax: greedy, no logprobs, no grammar,
    and nothing adjusted_logits would change."""
    # NOTE: the settings are host tensors over the sampling table's numpy arrays, asked as
    # numpy (here, _penalized, _min_tokens_bans): a torch dispatch per comparison cost more
    # than the checks (on every step's host path; docs/benchmarks.md, "Design measurements
    # quoted from the code").
    return (rows.token_bitmask is None and bool((rows.temperature.numpy() <= _GREEDY_EPS).all())
            and all(k is None for k in rows.logprobs) and not _adjusts_logits(rows))


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """logits [S, V] -> [S] long: each row's first largest logit's id. On the CPU (float32,
    bfloat16) one C++ pass over each row (torch's max(dim) took ~0.77 ms for 64 x 49,152
    logits on a 2-core EPYC, ~3% of a batch-64 decode step); elsewhere max(dim), which
    returns the first maximal index like argmax and ran faster than it."""
    if logits.stride(-1) == 1 and cpu_kernels.usable_for(logits):
        return cpu_kernels.argmax_rows(logits)
    return logits.max(dim=-1).indices


def _filtered_probs(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """Temperature, then min-p, then top-k, then top-p; one softmax for all rows. logits: [R, V]."""
    R, V = logits.shape
    dev = logits.device
    logits = logits / to_device_async(rows.temperature, dev)[:, None]
    if bool((rows.min_p > 0).any()):
        # probs >= min_p * max prob, as logits: l >= max l + log(min_p) (log 0 = -inf: off).
        floor = logits.max(dim=-1, keepdim=True).values + to_device_async(rows.min_p, dev)[:, None].log()  # [R, 1]
        logits = logits.masked_fill(logits < floor, float("-inf"))
    ks = torch.where(rows.top_k > 0, rows.top_k.clamp(max=V), V)  # [R] long, V: off
    cut_k = bool((ks < V).any())
    cut_p = bool((rows.top_p < 1.0).any())
    if dev.type == "cuda" and (cut_k or cut_p):
        # Sort-free Triton filter: one program per row, no per-row host sync.
        from llmserve.kernels.triton import top_k_top_p_filter

        return top_k_top_p_filter(logits, to_device_async(ks.int(), dev),
                                  to_device_async(rows.top_p, dev)).softmax(dim=-1)
    if cut_k:
        top_vals = logits.topk(int(ks.max()), dim=-1).values  # [R, max_k], descending
        kth = top_vals.gather(1, to_device_async(ks, dev)[:, None] - 1)  # [R, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cut_p:
        p_col = to_device_async(rows.top_p, dev)[:, None]  # [R, 1]
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


def _apply_token_bitmask(logits: torch.Tensor, bitmask: TokenBitmask) -> None:
    """logits ([S, V] float32) -inf where a constrained row's bits have a 0, in place:
    xgrammar's kernel (CUDA on the GPU, its CPU one here) on the C constrained rows only,
    gathered and written back; the other S - C rows are not read."""
    import xgrammar as xgr

    dev = logits.device
    rows = bitmask.rows.to(dev, non_blocking=True)  # [C]
    constrained = logits.index_select(0, rows)  # [C, V]
    xgr.apply_token_bitmask_inplace(constrained, bitmask.bits.to(dev, non_blocking=True))
    logits.index_copy_(0, rows, constrained)


def adjusted_logits(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """logit_bias, the min_tokens and bad words masks and the penalties, IN PLACE on
    logits ([S, V] float32) where a row uses one; returns logits. Each touches only its
    rows' (row, id) entries: O(entries), never a [S, V] pass."""
    bias = _bias_entries(rows)
    masked = _masked_entries(rows)
    penalized = np.flatnonzero(_penalized(rows)).tolist()
    V = logits.shape[1]
    flat_logits = logits.view(-1)
    if bias is not None:
        flat, values = (to_device_async(t, logits.device) for t in bias)
        flat_logits.index_add_(0, _flat_index(flat, V), values)
    if masked is not None:
        flat_logits.index_fill_(0, _flat_index(to_device_async(masked, logits.device), V), float("-inf"))
    if (pending := _bad_words_in_flight(rows)) is not None:
        _ban_where_in_flight(flat_logits, V, rows.in_flight, *pending)
    if penalized:
        _apply_penalties(flat_logits, V, rows, penalized)
    return logits


def _adjusts_logits(rows: SamplingRows) -> bool:
    """Whether adjusted_logits changes any row: the same four adjustments, each asked
    without building its entries."""
    return (any(rows.logit_bias) or any(rows.bad_words_token_ids) or bool(_min_tokens_bans(rows))
            or bool(_penalized(rows).any()))


def _penalized(rows: SamplingRows) -> np.ndarray:
    """[S] bool: the rows with a repetition, frequency or presence penalty (numpy, over the
    settings' host arrays: see _greedy_as_is)."""
    return ((rows.repetition_penalty.numpy() != 1) | (rows.frequency_penalty.numpy() != 0)
            | (rows.presence_penalty.numpy() != 0))


def _flat_index(pairs: torch.Tensor, V: int) -> torch.Tensor:
    """[2, N] (row, token id) -> [N] indices into a [S, V] tensor's flat view."""
    return pairs[0] * V + pairs[1]


@functools.lru_cache(maxsize=4096)
def _bias_tensors(bias: tuple[tuple[int, float], ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's logit_bias as ([N] ids long, [N] values float32), built once per bias."""
    return torch.tensor([t for t, _ in bias], dtype=torch.long), torch.tensor([b for _, b in bias])


def _bias_entries(rows: SamplingRows) -> tuple[torch.Tensor, torch.Tensor] | None:
    """([2, N] (row, id), [N] bias) over the rows with a logit_bias, or None."""
    biased = [i for i, bias in enumerate(rows.logit_bias) if bias]
    if not biased:
        return None
    ids, values = zip(*(_bias_tensors(rows.logit_bias[i]) for i in biased))
    counts = torch.tensor([len(t) for t in ids])
    row = torch.tensor(biased).repeat_interleave(counts)
    return torch.stack([row, torch.cat(ids)]), torch.cat(values)


def _masked_entries(rows: SamplingRows) -> torch.Tensor | None:
    """[2, N] (row, id) to set to -inf: the min_tokens and bad words masks, or None."""
    banned = {**_min_tokens_bans(rows)}
    for i, ids in _bad_words_bans(rows).items():
        banned[i] = banned.get(i, ()) + ids
    if not banned:
        return None
    counts = torch.tensor([len(ids) for ids in banned.values()])
    ids = torch.tensor(list(itertools.chain.from_iterable(banned.values())), dtype=torch.long)
    return torch.stack([torch.tensor(list(banned)).repeat_interleave(counts), ids])


def _min_tokens_bans(rows: SamplingRows) -> dict[int, tuple[int, ...]]:
    """row -> its stop ids, for the rows with fewer than min_tokens outputs."""
    if not bool((rows.min_tokens.numpy() > 0).any()):
        return {}
    under = (rows.min_tokens > torch.tensor(rows.output_index)).nonzero()[:, 0].tolist()
    return {i: rows.stop_token_ids[i] for i in under if rows.stop_token_ids[i]}


def _bad_words_bans(rows: SamplingRows) -> dict[int, tuple[int, ...]]:
    """row -> the ids its bad words ban at this step whatever is in flight (_ban_condition
    _ALWAYS); the bans that hang on an id in flight are _bad_words_in_flight's."""
    bans = {}
    for i, sequences in enumerate(rows.bad_words_token_ids):
        if not sequences:
            continue
        history, num_prompt, hole = rows.token_ids[i], rows.num_prompt_tokens[i], _hole_position(rows, i)
        ids = tuple(seq[-1] for seq in sequences if _ban_condition(seq, history, num_prompt, hole) == _ALWAYS)
        if ids:
            bans[i] = ids
    return bans


_ALWAYS = -1  # _ban_condition: the ban holds whatever is in flight (no token id is negative).


def _ban_condition(seq: tuple[int, ...], history: Sequence[int], num_prompt: int, hole: int) -> int | None:
    """Whether bad word `seq` bans its last id at this step: a one-token word always, a
    longer one where the output (never the prompt) ends with the rest of it. _ALWAYS, None
    (no ban), or, where the placeholder at `hole` (-1: none) lies among those last ids,
    the id the token in flight must be for the ban to hold."""
    if len(seq) == 1:
        return _ALWAYS
    start = len(history) - len(seq) + 1  # The output's last len(seq) - 1 ids: history[start:].
    if start < num_prompt:
        return None
    if hole < start:
        return _ALWAYS if tuple(history[start:]) == seq[:-1] else None
    known = (k for k in range(start, len(history)) if k != hole)
    return seq[hole - start] if all(history[k] == seq[k - start] for k in known) else None


def _hole_position(rows: SamplingRows, i: int) -> int:
    """Where row i's history holds a placeholder of the step in flight (-1: nowhere)."""
    hole = rows.in_flight.holes.get(i) if rows.in_flight is not None else None
    return hole[0] if hole is not None else -1


def _bad_words_in_flight(rows: SamplingRows) -> tuple[list[int], list[int], list[int], list[int]] | None:
    """The bans that hang on an id in flight (_ban_condition's id to be), as lists ([N]
    row, [N] id banned, [N] index in rows.in_flight.ids, [N] the id in flight must be for
    the ban to hold), or None when there are none."""
    if rows.in_flight is None:
        return None
    found: tuple[list[int], ...] = ([], [], [], [])
    for i, (position, index) in rows.in_flight.holes.items():
        history, num_prompt = rows.token_ids[i], rows.num_prompt_tokens[i]
        for seq in rows.bad_words_token_ids[i]:
            must_be = _ban_condition(seq, history, num_prompt, position)
            if must_be is not None and must_be != _ALWAYS:
                for column, value in zip(found, (i, seq[-1], index, must_be)):
                    column.append(value)
    return found if found[0] else None


def _ban_where_in_flight(flat_logits: torch.Tensor, V: int, in_flight: InFlightIds, row: list[int],
                         banned: list[int], index: list[int], must_be: list[int]) -> None:
    """-inf at each (row, banned id) whose id in flight is must_be, in place on a [S, V]
    tensor's flat view, with no host sync: -inf is added where the ban holds, 0 where it
    does not (an entry named twice adds twice: -inf stays -inf)."""
    dev = flat_logits.device
    ids = in_flight.ids.index_select(0, to_device_async(torch.tensor(index, dtype=torch.long), in_flight.ids.device))
    holds = ids.to(dev) == to_device_async(torch.tensor(must_be, dtype=torch.long), dev)
    add = torch.where(holds, float("-inf"), 0.0).to(flat_logits.dtype)
    flat = to_device_async(torch.tensor(row, dtype=torch.long) * V + torch.tensor(banned, dtype=torch.long), dev)
    flat_logits.index_add_(0, flat, add)


def _apply_penalties(flat_logits: torch.Tensor, V: int, rows: SamplingRows, penalized: list[int]) -> None:
    """In place on a [S, V] tensor's flat view, at the (row, id) entries of the
    `penalized` rows' histories only: repetition where an id is in the prompt or the
    output, then frequency and presence where it is in the output (each distinct output
    id with its count), as the module's docstring defines them. An entry written twice
    is written with the same value (computed from the logits before the write).

    A history may end in a placeholder (rows.in_flight: a pipelined loop's step in flight
    sampled that id, still on the device): that entry is read there, and joins the host's
    entries so that every logit gets the value a read-back history would give it, bit for
    bit (the same counts, the same float32 operations), without waiting for the step.

    NOTE: the entries' indices are built on the host with numpy (from the rows' int64
    histories, RequestState.host_ids), and the logits are read and written with
    index_select / index_copy_, not advanced indexing (`t[index]`: ~7.7 ms a gather of
    131k entries on the CPU, against ~0.6). The distinct output ids are counted by a host
    sort (np.unique: 1-6 ms at 64 x 2,048 or 256 x 1,024 ids, where torch's sort and
    searchsorted took 16-53 ms on the 2-core Intel Xeon, AMX host)."""
    dev = flat_logits.device
    known, holes = _known_history(rows, penalized)
    # [N] ids: a row's history is an int64 array where InputBatch keeps one (RequestState.host_ids).
    lengths = np.array([len(h) for h in known], dtype=np.int64)  # [P]
    ids = np.concatenate(known) if known else np.zeros(0, np.int64)
    rows_of = np.asarray(penalized, dtype=np.int64)  # [P]: each penalized row's row in [S]
    local_row = np.repeat(np.arange(len(penalized)), lengths)  # [N]: the entry's row in [P]
    row = rows_of[local_row]  # [N]: its row in [S]
    # An entry is an output token where its position in the row is past the prompt.
    output_start = np.cumsum(lengths) - lengths + np.array([rows.num_prompt_tokens[i] for i in penalized], np.int64)
    output = np.flatnonzero(np.arange(len(ids)) >= output_start[local_row])  # [O] entry indices
    # [H]: each hole's (row in [S], flat index of its id) on the device (an output token)
    hole_row, hole_flat = _hole_entries(rows.in_flight, holes, V, dev)
    flat = to_device_async(torch.from_numpy(row * V + ids), dev)  # [N]
    rep = rows.repetition_penalty
    if bool((rep[penalized] != 1).any()):
        entries = torch.cat([flat, hole_flat]) if holes else flat  # [N + H]
        seen = flat_logits.index_select(0, entries)
        entry_rows = torch.from_numpy(row)
        if holes:
            entry_rows = torch.cat([entry_rows, hole_row])
        factor = to_device_async(rep.index_select(0, entry_rows), dev)  # [N + H]
        flat_logits.index_copy_(0, entries, torch.where(seen > 0, seen / factor, seen * factor))
    freq, presence = rows.frequency_penalty, rows.presence_penalty
    if bool((freq[penalized] != 0).any() or (presence[penalized] != 0).any()):
        # Each (row, id) of the outputs once, with its count: a sort on the host, where a
        # [P, V] count (zeroed, scattered into) took 22 ms a step at 256 rows on the CPU.
        keys, counts = np.unique(local_row[output] * V + ids[output], return_counts=True)  # [U] each, sorted
        out_row = torch.from_numpy(rows_of[keys // V])  # [U]: its row in [S]
        # [U], ascending as keys are: rows_of ascends (penalized lists rows in order)
        out_flat = to_device_async(out_row * V + torch.from_numpy(keys % V), dev)
        count = to_device_async(torch.from_numpy(counts).float(), dev)  # [U]
        if holes:
            out_row, out_flat, count = _count_holes(out_row, out_flat, count, hole_row, hole_flat)
        penalty = (to_device_async(freq.index_select(0, out_row), dev) * count
                   + to_device_async(presence.index_select(0, out_row), dev))
        flat_logits.index_copy_(0, out_flat, flat_logits.index_select(0, out_flat) - penalty)


def _known_history(rows: SamplingRows, penalized: list[int]) -> tuple[list[np.ndarray], list[int]]:
    """The penalized rows' histories ([P] int64 arrays) without their placeholder, and
    the rows (in [S]) that had one (rows.in_flight.holes)."""
    history = [np.asarray(rows.token_ids[i], dtype=np.int64) for i in penalized]
    in_flight = rows.in_flight
    holes = []
    for k, i in enumerate(penalized):
        hole = in_flight.holes.get(i) if in_flight is not None else None
        if hole is not None:
            h, position = history[k], hole[0]
            history[k] = h[:position] if position == len(h) - 1 else np.delete(h, position)  # (a view: it is last)
            holes.append(i)
    return history, holes


def _hole_entries(in_flight: InFlightIds | None, holes: list[int], V: int,
                  dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """([H] row in [S] on the host, [H] flat index row * V + id on the device) of the
    holes' ids, gathered on the device from the step in flight's ids."""
    if not holes:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long, device=dev)
    hole_row = torch.tensor(holes, dtype=torch.long)
    src = to_device_async(torch.tensor([in_flight.holes[i][1] for i in holes], dtype=torch.long), in_flight.ids.device)
    ids = in_flight.ids.index_select(0, src).to(dev)
    return hole_row, to_device_async(hole_row, dev) * V + ids


def _count_holes(out_row: torch.Tensor, out_flat: torch.Tensor, count: torch.Tensor, hole_row: torch.Tensor,
                 hole_flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The host's distinct output entries ([U] row on the host, flat index on the device,
    ascending, count float32 on the device) with the holes' ids counted in, there: a
    hole whose (row, id) is a host entry adds 1 to that entry's count and is written again
    with it (the same value); any other is an entry of its own with count 1. Returns
    [U + H] rows (host), flat indices and counts (device), without a read back."""
    hole_count = torch.ones(hole_flat.shape, dtype=count.dtype, device=hole_flat.device)
    if out_flat.numel():
        at = torch.searchsorted(out_flat, hole_flat).clamp_(max=out_flat.numel() - 1)  # [H]
        found = out_flat.index_select(0, at) == hole_flat  # [H]
        count = count.index_add(0, at, found.float())  # NOTE: one hole a row: at most one add an entry
        hole_count = torch.where(found, count.index_select(0, at), hole_count)
    return torch.cat([out_row, hole_row]), torch.cat([out_flat, hole_flat]), torch.cat([count, hole_count])


def _raw_logprobs(logits: torch.Tensor, rows: SamplingRows) -> tuple[list[int], torch.Tensor] | None:
    """(the rows asking for logprobs, their log_softmax [L, V]) of the raw float32 logits
    (before any adjustment, temperature, top-k, top-p), or None if no row asks."""
    rows_asking = [i for i, k in enumerate(rows.logprobs) if k is not None]
    if not rows_asking:
        return None
    index = to_device_async(torch.tensor(rows_asking), logits.device)
    return rows_asking, torch.log_softmax(logits.index_select(0, index), dim=-1)


def _logprobs(raw: tuple[list[int], torch.Tensor] | None, rows: SamplingRows, tokens: torch.Tensor) -> PendingLogprobs:
    """The asking rows' logprobs (`raw`: _raw_logprobs's) of the sampled ids and their top
    k, on the device. tokens: [S] long, the sampled ids (on the logits' device)."""
    asked = rows.logprobs
    if raw is None:
        return PendingLogprobs(len(asked))
    rows_asking, lp = raw
    chosen_ids = tokens.index_select(0, to_device_async(torch.tensor(rows_asking), lp.device))  # [L]
    ks = tuple(min(asked[i] or 0, lp.shape[1]) for i in rows_asking)
    return PendingLogprobs(len(asked), tuple(rows_asking), ks, _logprob_tensors(lp, chosen_ids, max(ks)))


def _logprob_tensors(lp: torch.Tensor, token_ids: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """lp: [N, V] log_softmax rows; token_ids: [N] long (same device) -> (token ids [N],
    their logprobs [N], ranks [N] (1 + how many ids are more likely), the rows' top k ids
    and logprobs [N, k]), on that device."""
    chosen = lp.gather(1, token_ids[:, None])  # [N, 1]
    ranks = (lp > chosen).sum(dim=-1) + 1  # [N]
    k = min(k, lp.shape[1])
    top_vals, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], token_ids[:, None][:, :0])  # [N, k]
    return token_ids, chosen[:, 0], ranks, top_ids, top_vals


def as_token_logprobs(tensors: tuple[torch.Tensor, ...], ks: Sequence[int]) -> list[TokenLogprobs]:
    """_logprob_tensors' tensors, read (one .tolist() each), as TokenLogprobs [N], row i
    with its top ks[i] (the tensors hold the largest k asked for)."""
    ids, values, ranks, top_ids, top_vals = (t.tolist() for t in tensors)
    return [TokenLogprobs(t, v, tuple(ti[:k]), tuple(tv[:k]), r)
            for t, v, r, ti, tv, k in zip(ids, values, ranks, top_ids, top_vals, ks)]


PROMPT_LOGPROBS_SLICE = 1024  # Positions per float32 log_softmax: bounds its [slice, V] copy.


def prompt_logprob_tensors(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """Prompt logprobs as _logprob_tensors' tensors on the logits' device, not read back:
    logits [P, V] at P prompt positions, token_ids [P] long (on the host) the prompt tokens
    that follow each; log_softmax in float32 (raw logits, as the sampled tokens'),
    PROMPT_LOGPROBS_SLICE positions at a time."""
    token_ids = to_device_async(token_ids, logits.device)
    parts = [_logprob_tensors(torch.log_softmax(logits[start : start + PROMPT_LOGPROBS_SLICE].float(), dim=-1),
                              token_ids[start : start + PROMPT_LOGPROBS_SLICE], k)
             for start in range(0, logits.shape[0], PROMPT_LOGPROBS_SLICE)]
    return tuple(torch.cat(column) for column in zip(*parts))

