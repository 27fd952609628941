"""The worker's persistent request states, and the ONE place a step plan becomes tensors
(the sampling settings included: SamplingParams -> SamplingRows)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmserve.contract.arith import cdiv
from llmserve.contract.plan import StepPlan
from llmserve.contract.sampling import SamplingParams
from llmserve.worker.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from llmserve.worker.block_table import BlockTables
from llmserve.worker.sampler import SamplingRows, TokenBitmask
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
    sampling: SamplingParams  # As the plan sent it (this sample's seed); read into SamplingRows.
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
    # Its sampling reads the row's token ids on the host (a penalty, a multi-token bad word,
    # a grammar): decided once at arrival, not per step (sampling and grammar never change).
    reads_host_ids: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.reads_host_ids = self.sampling.needs_history or self.grammar is not None

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
        self._validate(plan)
        grammars = self._grammars(plan)  # Before any state changes: compiling may fail.
        for rid in plan.finished_seq_ids:
            self._forget(rid)
        rows = []
        for r in plan.new_requests:
            self._forget(r.seq_id)  # (a full resend replaces what the worker held)
            st = RequestState(r.seq_id, list(r.token_ids), r.num_prompt_tokens, r.sampling,
                              list(r.block_ids), r.num_computed_tokens, list(r.draft_token_ids),
                              row=self.block_tables.add(r.block_ids), grammar=grammars.get(r.seq_id))
            self.states[r.seq_id] = st
            rows.append((st, r.num_scheduled_tokens))
        for c in plan.cached_requests:
            st = self.states[c.seq_id]
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

    def _validate(self, plan: StepPlan) -> None:
        seen: set[int] = set()
        finished = set(plan.finished_seq_ids)
        steps = plan.num_steps
        if steps < 1:
            raise ValueError(f"step {plan.step_id}: num_steps must be >= 1, got {steps}")
        for r in plan.new_requests:
            self._check_row(r.seq_id, seen, r.block_ids, len(r.block_ids), len(r.token_ids),
                            r.num_computed_tokens, r.num_scheduled_tokens, steps, len(r.draft_token_ids))
            if r.draft_token_ids and r.sampling.structured_output is not None:
                raise ValueError(f"request {r.seq_id}: drafts for a constrained sample (the scheduler drafts none)")
            if not 0 <= r.num_prompt_tokens <= len(r.token_ids):
                raise ValueError(f"request {r.seq_id}: num_prompt_tokens {r.num_prompt_tokens} "
                                 f"outside 0..{len(r.token_ids)}")
        new_ids = {r.seq_id for r in plan.new_requests}
        for c in plan.cached_requests:
            st = self.states.get(c.seq_id)
            if c.seq_id in new_ids or st is None or c.seq_id in finished:
                raise ValueError(f"cached request {c.seq_id!r} is unknown to this worker")
            if (steps == 1 and c.num_scheduled_tokens == 1 and not c.new_block_ids and not c.draft_token_ids
                    and c.seq_id not in seen and 0 <= c.num_computed_tokens < len(st.token_ids)
                    and c.num_computed_tokens < min(self.max_model_len, self.block_size * len(st.block_ids))):
                # NOTE: a one-token decode on a table the worker holds: _check_row's checks
                # reduce to these (its own slow path names whichever fails).
                seen.add(c.seq_id)
                continue
            self._check_row(c.seq_id, seen, c.new_block_ids, len(st.block_ids) + len(c.new_block_ids),
                            len(st.token_ids), c.num_computed_tokens, c.num_scheduled_tokens, steps,
                            len(c.draft_token_ids))
            if c.draft_token_ids and st.grammar is not None:
                raise ValueError(f"request {c.seq_id}: drafts for a constrained sample (the scheduler drafts none)")

    def _check_row(self, rid: int, seen: set[int], block_ids: list[int], table_len: int,
                   num_tokens: int, computed: int, scheduled: int, steps: int, drafts: int = 0) -> None:
        if rid in seen:
            raise ValueError(f"request {rid!r} is scheduled twice in one step")
        seen.add(rid)
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
        it on the device (no host round trip)."""
        # NOTE: decode rows (1 token, or drafts being verified) first: the attention backend batches them.
        rows = sorted(rows, key=lambda r: r[1] != 1 and not r[0].draft_token_ids)
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        query_lens, seq_lens, tables, table_rows = [], [], [], []
        sample_idx, sample_states, sample_offsets = [], [], []
        prompt_idx, prompt_rows = [], []  # Positions whose next token is prompt, for prompt logprobs.
        fill_dst, fill_src = [], []  # input_ids[fill_dst] = prev_sampled[fill_src]
        for st, n in rows:
            c = st.num_computed_tokens
            table = st.block_ids
            if st.placeholder is not None and c <= st.placeholder.position < c + n:
                fill_dst.append(len(ids) + st.placeholder.position - c)
                fill_src.append(st.placeholder.index)
            if n == 1 and c + 1 == len(st.token_ids) and c >= st.num_prompt_tokens - 1 and not st.draft_token_ids:
                # NOTE: the plain decode row (most rows of a step): the general path's
                # bookkeeping for one token and no prompt logprobs, without its slices and ranges.
                sample_idx.append(len(ids))
                ids.append(st.token_ids[c])
                pos.append(c)
                slots.append(table[c // bs] * bs + c % bs)
                query_lens.append(1)
                seq_lens.append(c + 1)
                tables.append(table)
                table_rows.append(st.row)
                sample_states.append(st)
                sample_offsets.append(0)
                continue
            if st.draft_token_ids:
                ids.extend(st.token_ids[c:] + st.draft_token_ids)
                for j, p in enumerate(range(c, c + n)):
                    pos.append(p)
                    slots.append(table[p // bs] * bs + p % bs)
                    query_lens.append(1)
                    seq_lens.append(p + 1)
                    tables.append(table)
                    table_rows.append(st.row)
                    sample_idx.append(len(ids) - n + j)
                    sample_states.append(st)
                    sample_offsets.append(j)
                continue
            count = min(c + n, st.num_prompt_tokens - 1) - c
            if st.sampling.prompt_logprobs is not None and count > 0:
                prompt_idx.extend(range(len(ids), len(ids) + count))
                prompt_rows.append(PromptRows(st, c + 1, count))
            ids.extend(st.token_ids[c : c + n])
            pos.extend(range(c, c + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(c, c + n))
            query_lens.append(n)
            seq_lens.append(c + n)
            tables.append(table)
            table_rows.append(st.row)
            if c + n == len(st.token_ids):
                sample_idx.append(len(ids) - 1)
                sample_states.append(st)
                sample_offsets.append(0)
        # NOTE: the seven index lists go to the device as one host tensor, one copy.
        T, S, P, F = len(ids), len(sample_idx), len(prompt_idx), len(fill_dst)
        packed = torch.tensor(ids + pos + slots + sample_idx + prompt_idx + fill_dst + fill_src,
                              dtype=torch.long).to(self.device, non_blocking=True)
        input_ids, positions, slot_mapping, logit_indices, dst, src = packed.split([T, T, T, S + P, F, F])
        sample_indices = logit_indices[:S]
        if F:
            if prev_sampled is None:
                raise RuntimeError(f"{F} input tokens are placeholders of a step that is not in flight")
            input_ids.index_copy_(0, dst, prev_sampled.index_select(0, src))  # on the device, no sync
        # [rows, widest table this step] int32: one gather from the kept tables, one copy
        padded = self.block_tables.padded(table_rows, cdiv(max(seq_lens), bs) if seq_lens else 0)
        meta = self.attention_backend.build_metadata(query_lens, seq_lens, tables, slot_mapping, bs,
                                                     padded.to(self.device, non_blocking=True))
        # NOTE: position j of a row verifying drafts samples as the plain decode of its
        # (num_output_tokens + j)-th token would: a seeded request draws the same token,
        # and a penalized one (or one with multi-token bad words) sees drafts[:j] as
        # output (the only copy of a history made).
        sampling = SamplingRows.from_params(
            [st.sampling for st in sample_states],
            [st.num_output_tokens + j for st, j in zip(sample_states, sample_offsets)],
            [st.token_ids + st.draft_token_ids[:j] if j and st.sampling.needs_history else st.token_ids
             for st, j in zip(sample_states, sample_offsets)],
            [st.num_prompt_tokens for st in sample_states],
            self._token_bitmask(sample_states))
        return StepInputs(input_ids=input_ids, positions=positions, meta=meta, sample_indices=sample_indices,
                          sample_states=sample_states, sample_offsets=sample_offsets, sampling=sampling,
                          logit_indices=logit_indices, prompt_rows=prompt_rows)

    def _token_bitmask(self, states: list[RequestState]) -> TokenBitmask | None:
        """The constrained rows' allowed tokens (TokenBitmask: their indices among the S
        sampled rows, and a bit per token id each), or None when none is
        constrained: unconstrained batches pay nothing."""
        if self.grammars is None or all(st.grammar is None for st in states):
            return None
        return self.grammars.fill_bitmask([st.grammar for st in states])
