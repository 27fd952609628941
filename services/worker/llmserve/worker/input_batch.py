"""The worker's persistent request states, and the ONE place a step plan becomes tensors
(the sampling settings included: SamplingParams -> a row of SamplingTable -> a step's
SamplingRows)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from llmserve.contract.arith import cdiv
from llmserve.contract.plan import StepPlan
from llmserve.contract.sampling import SamplingParams
from llmserve.worker.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from llmserve.worker.block_table import BlockTables
from llmserve.worker.sampler import InFlightIds, SamplingRows, SamplingTable, TokenBitmask
from llmserve.worker.structured_output import Grammars, RowGrammar

# A token sampled by a step launched and not read back yet: its id is still on the
# device (ModelRunner.launch appends it; finish writes the id over it).
PLACEHOLDER = -1


@dataclass(eq=False)
class Placeholder:
    """Where a launched step's sampled id goes: `position` of `state.token_ids`, holding
    PLACEHOLDER until the step is read back, and `index` in the step's sampled ids [S]."""

    state: RequestState
    position: int
    index: int


@dataclass
class RequestState:
    seq_id: int
    token_ids: list[int]  # prompt + every token generated so far (including this worker's samples)
    num_prompt_tokens: int
    sampling: SamplingParams  # As the plan sent it (this sample's seed); written to InputBatch.sampling.
    block_ids: list[int]
    num_computed_tokens: int
    # Speculative decoding: this step's drafts, computed after token_ids' last token (set
    # by each plan that schedules the request).
    draft_token_ids: list[int] = field(default_factory=list)
    row: int = -1  # Its row of InputBatch.block_tables (block_ids, kept there as a tensor too).
    # Structured output: the sample's grammar matcher (None: unconstrained).
    grammar: RowGrammar | None = None
    # Its placeholder sampled by the last step launched, while that step is not read back
    # (a row the next step schedules takes the id from that step's device tensor).
    placeholder: Placeholder | None = field(default=None, repr=False, compare=False)
    # Its sampling needs the row's last token on the host (a grammar advances by it):
    # decided once at arrival, not per step (sampling and grammar never change). Penalties
    # and multi-token bad words do not: they read a placeholder's id on the device
    # (InFlightIds).
    needs_last_id_on_host: bool = field(init=False, repr=False, compare=False)
    # Its sampler reads its history (SamplingParams.needs_history), and whether it reads
    # an id in flight there (a penalty, a multi-token bad word): decided once at arrival
    # too (read for every row of every step).
    reads_history: bool = field(init=False, repr=False, compare=False)
    penalized: bool = field(init=False, repr=False, compare=False)
    reads_in_flight: bool = field(init=False, repr=False, compare=False)

    # host_ids' int64 copy of token_ids (capacity grown by doubling) and how many leading
    # ids of it are final (a placeholder's position and after are copied again).
    _ids: np.ndarray = field(init=False, repr=False, compare=False)
    _ids_final: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.needs_last_id_on_host = self.grammar is not None
        self.reads_history = self.sampling.needs_history
        self.penalized = self.sampling.penalized
        self.reads_in_flight = self.penalized or self.sampling.matches_bad_word_prefixes
        self._ids = np.empty(0, dtype=np.int64)

    def host_ids(self) -> np.ndarray:
        """token_ids as int64 [len] (a view, valid until the next call), for the sampler's
        histories: only the ids appended since the last call are copied (token_ids only
        grows, and changes only where a placeholder gets its id), not the whole list each
        step: at 64 rows x 2,048 ids, converting the lists took ~5 ms a step."""
        n = len(self.token_ids)
        if n > len(self._ids):
            grown = np.empty(max(n, 2 * len(self._ids), 64), dtype=np.int64)
            grown[: self._ids_final] = self._ids[: self._ids_final]
            self._ids = grown
        if self._ids_final < n:
            new = self.token_ids[self._ids_final : n]
            self._ids[self._ids_final : n] = new
            self._ids_final = self._ids_final + new.index(PLACEHOLDER) if PLACEHOLDER in new else n
        return self._ids[:n]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # [S] long: token index whose logits are sampled
    sample_states: list[RequestState]  # [S]
    # [S]: which of its row's sampled positions each is: 0, or 0..drafts for a row that
    # verifies drafts (its state then appears 1 + drafts times in a row in sample_states).
    sample_offsets: list[int]
    sampling: SamplingRows  # [S] rows: the sampled rows' settings, what the sampler reads
    # [S + P] long: the token indices whose logits are computed, the S sampled ones first
    # (sample_indices is its head), then the P positions of prompt logprobs.
    logit_indices: torch.Tensor
    prompt_rows: list[PromptRows] = field(default_factory=list)  # Their rows, in order.


@dataclass
class PromptRows:
    """A row asking for prompt logprobs: this step's logits at its positions start - 1 ..
    start + count - 2 give the logprobs of its prompt tokens start .. start + count - 1."""

    state: RequestState
    start: int  # >= 1
    count: int

    @property
    def targets(self) -> list[int]:
        return self.state.token_ids[self.start : self.start + self.count]


class InputBatch:
    """The requests a worker holds (seq id -> RequestState), kept across steps: a plan adds
    the new ones in full, extends the cached ones by their deltas and drops the finished;
    `build_inputs` turns the scheduled rows into the step's tensors."""

    def __init__(self, block_size: int, num_blocks: int, max_model_len: int,
                 attention_backend: type[AttentionBackend] = TorchPagedAttention,
                 device: torch.device | str = "cpu", grammars: Grammars | None = None):
        self.block_size, self.num_blocks, self.max_model_len = block_size, num_blocks, max_model_len
        self.attention_backend = attention_backend  # builds the per-step metadata its layers need
        self.device = torch.device(device)  # where the step's tensors go (the model's device)
        self.states: dict[int, RequestState] = {}
        self.grammars = grammars  # Compiles constrained samples' grammars (None: none may come).
        # Every state's block_ids, by row; a step's gather staged in pinned memory on CUDA.
        self.block_tables = BlockTables(max_model_len, block_size, staged=self.device.type == "cuda")
        self.sampling = SamplingTable()  # Every state's settings, by row (the rows of block_tables)

    def clear(self) -> None:
        """Forget every request (a new scheduler stream resends them in full)."""
        self.states.clear()
        self.block_tables.clear()

    def _forget(self, seq_id: int) -> None:
        st = self.states.pop(seq_id, None)
        if st is not None:
            self.block_tables.drop(st.row)

    # ---- plan -> state -------------------------------------------------------------
    def apply_plan(self, plan: StepPlan) -> list[tuple[RequestState, int]]:
        """Validate the whole plan, then update states. Returns (state, num_scheduled) per
        scheduled request in plan order. Raises ValueError on an inconsistent plan,
        leaving the states untouched."""
        cached = self._validate(plan)
        grammars = self._grammars(plan)  # Before any state changes: compiling may fail.
        for rid in plan.finished_seq_ids:
            self._forget(rid)
        rows = []
        for r in plan.new_requests:
            self._forget(r.seq_id)  # (a full resend replaces what the worker held)
            st = RequestState(r.seq_id, list(r.token_ids), r.num_prompt_tokens, r.sampling,
                              list(r.block_ids), r.num_computed_tokens, list(r.draft_token_ids),
                              row=self.block_tables.add(r.block_ids), grammar=grammars.get(r.seq_id))
            self.sampling.write(st.row, r.sampling, r.num_prompt_tokens)
            self.states[r.seq_id] = st
            rows.append((st, r.num_scheduled_tokens))
        for c, st in zip(plan.cached_requests, cached):
            if c.new_block_ids:  # NOTE: most decode rows get no new block in a step
                st.block_ids.extend(c.new_block_ids)
                self.block_tables.extend(st.row, c.new_block_ids)
            st.num_computed_tokens = c.num_computed_tokens
            if c.draft_token_ids or st.draft_token_ids:
                st.draft_token_ids = list(c.draft_token_ids)
            rows.append((st, c.num_scheduled_tokens))
        return rows

    def _grammars(self, plan: StepPlan) -> dict[int, RowGrammar]:
        """The new constrained samples' matchers, each having accepted the outputs the plan
        resends (a preempted sample resumes its grammar where it was)."""
        constrained = [r for r in plan.new_requests if r.sampling.structured_output is not None]
        if constrained and self.grammars is None:
            raise ValueError(f"request {constrained[0].seq_id}: structured output, but this worker has no grammars")
        return {r.seq_id: self.grammars.matcher_for(r.sampling.structured_output, r.token_ids[r.num_prompt_tokens:])
                for r in constrained}

    def _validate(self, plan: StepPlan) -> list[RequestState]:
        """Raises ValueError where the plan is inconsistent; else returns the cached rows'
        states, in plan order."""
        seen: set[int] = set()
        finished = set(plan.finished_seq_ids)
        steps = plan.num_steps
        if steps < 1:
            raise ValueError(f"step {plan.step_id}: num_steps must be >= 1, got {steps}")
        check = self._check_row
        for r in plan.new_requests:
            check(r.seq_id, seen, r.block_ids, len(r.block_ids), len(r.token_ids), r.num_computed_tokens,
                  r.num_scheduled_tokens, steps, len(r.draft_token_ids))
            if r.draft_token_ids and r.sampling.structured_output is not None:
                raise ValueError(f"request {r.seq_id}: drafts for a constrained sample (the scheduler drafts none)")
            if not 0 <= r.num_prompt_tokens <= len(r.token_ids):
                raise ValueError(f"request {r.seq_id}: num_prompt_tokens {r.num_prompt_tokens} "
                                 f"outside 0..{len(r.token_ids)}")
        new_ids = {r.seq_id for r in plan.new_requests}
        cached = []
        for c in plan.cached_requests:
            st = self.states.get(c.seq_id)
            if st is None or c.seq_id in new_ids or c.seq_id in finished:
                raise ValueError(f"cached request {c.seq_id!r} is unknown to this worker")
            check(c.seq_id, seen, c.new_block_ids, len(st.block_ids) + len(c.new_block_ids), len(st.token_ids),
                  c.num_computed_tokens, c.num_scheduled_tokens, steps, len(c.draft_token_ids))
            if c.draft_token_ids and st.grammar is not None:
                raise ValueError(f"request {c.seq_id}: drafts for a constrained sample (the scheduler drafts none)")
            cached.append(st)
        return cached

    def _check_row(self, rid: int, seen: set[int], block_ids: list[int], table_len: int,
                   num_tokens: int, computed: int, scheduled: int, steps: int, drafts: int) -> None:
        """Every rule a scheduled row's counts and blocks obey. NOTE: called for each row of
        every step (most of them plain decodes): each rule is a comparison or two, and the
        common row skips the branches' bodies."""
        if rid in seen:
            raise ValueError(f"request {rid!r} is scheduled twice in one step")
        seen.add(rid)
        if block_ids:  # (most cached rows get no new block in a step)
            bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
            if bad:
                raise ValueError(f"request {rid!r}: block ids {bad[:5]} outside 0..{self.num_blocks - 1}")
        end = computed + scheduled
        if scheduled < 1 or computed < 0:
            raise ValueError(f"request {rid!r}: bad token counts computed={computed} scheduled={scheduled}")
        if drafts:
            # Verifying drafts: the last known token and the drafts after it, in one step.
            if steps > 1 or computed + 1 != num_tokens or scheduled != 1 + drafts:
                raise ValueError(f"request {rid!r}: {drafts} drafts need a one-step plan computing the last "
                                 f"token and the drafts (computed={computed} scheduled={scheduled}, knows "
                                 f"{num_tokens}, {steps} steps)")
            num_tokens += drafts
        if end > num_tokens:
            raise ValueError(f"request {rid!r}: tokens up to {end} scheduled but the worker knows {num_tokens}")
        if steps > 1:
            # A multi-step run: one sampled token per step, each the next step's input.
            if scheduled != 1 or end != num_tokens:
                raise ValueError(f"request {rid!r}: a {steps}-step plan needs a one-token decode of its "
                                 f"last token (computed={computed} scheduled={scheduled}, knows {num_tokens})")
            end = computed + steps
        if end > table_len * self.block_size:
            raise ValueError(f"request {rid!r}: position {end - 1} is beyond its block table "
                             f"({table_len} blocks of {self.block_size})")
        if end > self.max_model_len:
            raise ValueError(f"request {rid!r}: length {end} exceeds max_model_len {self.max_model_len}")

    # ---- state -> tensors ----------------------------------------------------------
    def build_inputs(self, rows: list[tuple[RequestState, int]],
                     prev_sampled: torch.Tensor | None = None) -> StepInputs:
        """The step's tensors. A row verifying drafts becomes 1 + drafts decode rows over
        one block table, row j seeing the keys up to its own position (causal): the
        backends' batched decode path computes it, every position sampled.

        `prev_sampled`: [S'] long on the device, the sampled ids of the last step launched
        and not read back; an input token still a placeholder of that step is taken from
        it on the device (no host round trip).

        The leading plain decode rows (most rows of a step) are read as columns: a few
        attribute reads a row, numpy for the rest. The other rows take the general path."""
        # NOTE: decode rows (1 token, or drafts being verified) first: the attention backend batches them.
        if [n for _, n in rows].count(1) != len(rows):
            rows = sorted(rows, key=lambda r: r[1] != 1 and not r[0].draft_token_ids)
        D = _num_plain_decodes(rows)
        plain = [st for st, _ in rows[:D]]
        rest = _GeneralRows(first_token=D)
        for st, n in rows[D:]:
            rest.add(st, n)
        # Plain decode row i: token i of the step, its last known token, at position pos[i], sampled.
        pos = np.array([st.num_computed_tokens for st in plain], dtype=np.int64)  # [D]
        table_rows = np.array([st.row for st in plain] + rest.table_rows, dtype=np.int64)  # [N]
        input_ids, positions, slot_mapping, logit_indices = self._index_tensors(plain, pos, table_rows, rest,
                                                                                prev_sampled)
        seq_lens = (pos + 1).tolist() + rest.seq_lens
        bs = self.block_size
        # [rows, widest table this step] int32: one gather from the kept tables, one copy
        padded = self.block_tables.padded(table_rows, cdiv(max(seq_lens), bs) if seq_lens else 0)
        meta = self.attention_backend.build_metadata([1] * D + rest.query_lens, seq_lens,
                                                     [st.block_ids for st in plain] + rest.tables, slot_mapping, bs,
                                                     padded.to(self.device, non_blocking=True))
        sample_states = plain + rest.sample_states
        return StepInputs(input_ids=input_ids, positions=positions, meta=meta,
                          sample_indices=logit_indices[: len(sample_states)], sample_states=sample_states,
                          sample_offsets=[0] * D + rest.sample_offsets, logit_indices=logit_indices,
                          sampling=self._sampling_rows(sample_states, pos, table_rows[:D], rest, prev_sampled),
                          prompt_rows=rest.prompt_rows)

    def _index_tensors(self, plain: list[RequestState], pos: np.ndarray, table_rows: np.ndarray,
                       rest: _GeneralRows, prev_sampled: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """(input_ids [T], positions [T], slot_mapping [T], logit_indices [S + P]) long on
        the device, the plain decode rows' ahead of the rest's; input tokens still
        placeholders taken from prev_sampled there."""
        D = len(plain)
        # [D]: the index in prev_sampled of a plain row's token still a placeholder, else -1
        in_flight = np.array([ph.index if (ph := st.placeholder) is not None and ph.position == st.num_computed_tokens
                              else -1 for st in plain], dtype=np.int64)
        fill_dst = np.flatnonzero(in_flight >= 0)
        token_pos = np.concatenate([pos, np.asarray(rest.pos, dtype=np.int64)])  # [T]
        # NOTE: the seven index columns go to the device as one host tensor, one copy.
        columns = [
            [st.token_ids[-1] for st in plain], rest.ids,  # input ids [T]
            token_pos,  # positions [T]
            self.block_tables.slots(np.concatenate([table_rows[:D], np.asarray(rest.token_rows, dtype=np.int64)]),
                                    token_pos),  # slot mapping [T]
            np.arange(D), rest.sample_idx, rest.prompt_idx,  # logit indices [S + P]
            fill_dst, rest.fill_dst, in_flight[fill_dst], rest.fill_src,  # placeholders: dst [F], src [F]
        ]
        T, F = D + len(rest.ids), len(fill_dst) + len(rest.fill_dst)
        SP = D + len(rest.sample_idx) + len(rest.prompt_idx)
        packed = torch.from_numpy(np.concatenate([np.asarray(c, dtype=np.int64) for c in columns]))
        input_ids, positions, slot_mapping, logit_indices, dst, src = packed.to(self.device, non_blocking=True).split(
            [T, T, T, SP, F, F])
        if F:
            if prev_sampled is None:
                raise RuntimeError(f"{F} input tokens are placeholders of a step that is not in flight")
            input_ids.index_copy_(0, dst, prev_sampled.index_select(0, src))  # on the device, no sync
        return input_ids, positions, slot_mapping, logit_indices

    def _sampling_rows(self, sample_states: list[RequestState], pos: np.ndarray, plain_rows: np.ndarray,
                       rest: _GeneralRows, prev_sampled: torch.Tensor | None) -> SamplingRows:
        """The sampled rows' settings (the D plain decode rows', then the rest's), gathered
        from the table. NOTE: position j of a row verifying drafts samples as the plain
        decode of its (num_output_tokens + j)-th token would: a seeded request draws the
        same token, and a penalized one (or one with multi-token bad words) sees
        drafts[:j] as output (the only copy of a history made). A penalized row whose
        history ends in the step in flight's placeholder has its id read from
        prev_sampled ([S'] on the device) by the penalties (InFlightIds)."""
        states, offsets = rest.sample_states, rest.sample_offsets
        plain = sample_states[: len(plain_rows)]
        return self.sampling.gather(
            np.concatenate([plain_rows, np.array([st.row for st in states], dtype=np.int64)]),
            np.concatenate([pos + 1, np.array([len(st.token_ids) + j for st, j in zip(states, offsets)],
                                              dtype=np.int64)]),
            [_history(st) for st in plain] + [_history(st, j) for st, j in zip(states, offsets)],
            self._token_bitmask(sample_states), _in_flight_ids(sample_states, prev_sampled))

    def _token_bitmask(self, states: list[RequestState]) -> TokenBitmask | None:
        """The constrained rows' allowed tokens (TokenBitmask: their indices among the S
        sampled rows, and a bit per token id each), or None when none is
        constrained: unconstrained batches pay nothing."""
        if self.grammars is None or all(st.grammar is None for st in states):
            return None
        return self.grammars.fill_bitmask([st.grammar for st in states])


def _history(st: RequestState, drafts: int = 0) -> Sequence[int]:
    """What the sampler reads as the row's history: its ids and its first `drafts` drafts
    (host_ids) where its sampling reads them, else token_ids (a reference, not read)."""
    if not st.reads_history:
        return st.token_ids
    if not drafts:
        return st.host_ids()
    return np.concatenate([st.host_ids(), np.asarray(st.draft_token_ids[:drafts], dtype=np.int64)])


def _in_flight_ids(states: list[RequestState], prev_sampled: torch.Tensor | None) -> InFlightIds | None:
    """Where the histories of the rows with a penalty or a multi-token bad word end in a
    placeholder of the step in flight (prev_sampled: its ids [S'] on the device), or None
    when no row's does."""
    if prev_sampled is None:
        return None
    holes = {i: (ph.position, ph.index) for i, st in enumerate(states)
             if st.reads_in_flight and (ph := st.placeholder) is not None}
    return InFlightIds(prev_sampled, holes) if holes else None


def _num_plain_decodes(rows: list[tuple[RequestState, int]]) -> int:
    """How many rows from the first are plain decodes: one token, the last known one, so
    sampled and past the prompt (no prompt logprobs). NOTE: one token means no drafts (a
    row verifying d drafts is scheduled 1 + d tokens: _check_row)."""
    for i, (st, n) in enumerate(rows):
        if n != 1 or st.num_computed_tokens + 1 != len(st.token_ids):
            return i
    return len(rows)


class _GeneralRows:
    """The lists of a step's rows other than the leading plain decodes, appended row by
    row: prefill chunks, rows verifying drafts, prompt logprobs. Token indices count from
    `first_token` (the plain decode rows' tokens come first)."""

    def __init__(self, first_token: int):
        self.first = first_token
        self.ids: list[int] = []  # [T']
        self.pos: list[int] = []  # [T']
        self.token_rows: list[int] = []  # [T']: each token's block-table row (its slot: BlockTables.slots)
        self.query_lens: list[int] = []  # [N']
        self.seq_lens: list[int] = []  # [N']
        self.tables: list[list[int]] = []  # [N']
        self.table_rows: list[int] = []  # [N']
        self.sample_idx: list[int] = []  # [S']
        self.sample_states: list[RequestState] = []  # [S']
        self.sample_offsets: list[int] = []  # [S']
        self.prompt_idx: list[int] = []  # [P]: positions whose next token is prompt, for prompt logprobs
        self.prompt_rows: list[PromptRows] = []
        self.fill_dst: list[int] = []  # [F']: input_ids[fill_dst] = prev_sampled[fill_src]
        self.fill_src: list[int] = []  # [F']

    def add(self, st: RequestState, n: int) -> None:
        """Row `st`, computing n tokens from its num_computed_tokens."""
        c, table = st.num_computed_tokens, st.block_ids
        start = self.first + len(self.ids)  # this row's first token in the step
        if st.placeholder is not None and c <= st.placeholder.position < c + n:
            self.fill_dst.append(start + st.placeholder.position - c)
            self.fill_src.append(st.placeholder.index)
        if st.draft_token_ids:
            self.ids.extend(st.token_ids[c:] + st.draft_token_ids)
            self.token_rows.extend([st.row] * n)
            for j, p in enumerate(range(c, c + n)):
                self.pos.append(p)
                self.query_lens.append(1)
                self.seq_lens.append(p + 1)
                self.tables.append(table)
                self.table_rows.append(st.row)
                self.sample_idx.append(start + j)
                self.sample_states.append(st)
                self.sample_offsets.append(j)
            return
        count = min(c + n, st.num_prompt_tokens - 1) - c
        if st.sampling.prompt_logprobs is not None and count > 0:
            self.prompt_idx.extend(range(start, start + count))
            self.prompt_rows.append(PromptRows(st, c + 1, count))
        self.ids.extend(st.token_ids[c : c + n])
        self.pos.extend(range(c, c + n))
        self.token_rows.extend([st.row] * n)
        self.query_lens.append(n)
        self.seq_lens.append(c + n)
        self.tables.append(table)
        self.table_rows.append(st.row)
        if c + n == len(st.token_ids):
            self.sample_idx.append(start + n - 1)
            self.sample_states.append(st)
            self.sample_offsets.append(0)
