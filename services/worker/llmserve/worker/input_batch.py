"""The worker's persistent request states, and the ONE place a step plan becomes tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.contract.plan import CachedRequestData, NewRequestData, StepPlan, WorkerSamplingParams
from llmserve.worker.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention


@dataclass
class RequestState:
    seq_id: int
    token_ids: list[int]  # prompt + every token generated so far (including this worker's samples)
    num_prompt_tokens: int
    sampling: WorkerSamplingParams
    block_ids: list[int]
    num_computed_tokens: int

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


class InputBatch:
    def __init__(self, block_size: int, num_blocks: int, max_model_len: int,
                 attention_backend: type[AttentionBackend] = TorchPagedAttention,
                 device: torch.device | str = "cpu"):
        self.block_size, self.num_blocks, self.max_model_len = block_size, num_blocks, max_model_len
        self.attention_backend = attention_backend  # builds the per-step metadata its layers need
        self.device = torch.device(device)  # where the step's tensors go (the model's device)
        self.states: dict[int, RequestState] = {}

    # ---- plan -> state -------------------------------------------------------------
    def apply_plan(self, plan: StepPlan) -> list[tuple[RequestState, int]]:
        """Validate the whole plan, then update states. Returns (state, num_scheduled) per
        scheduled request in plan order. Raises ValueError on an inconsistent plan,
        leaving the states untouched."""
        self._validate(plan)
        for rid in plan.finished_seq_ids:
            self.states.pop(rid, None)
        rows = []
        for r in plan.new_requests:
            st = RequestState(r.seq_id, list(r.token_ids), r.num_prompt_tokens, r.sampling,
                              list(r.block_ids), r.num_computed_tokens)
            self.states[r.seq_id] = st
            rows.append((st, r.num_scheduled_tokens))
        for c in plan.cached_requests:
            st = self.states[c.seq_id]
            st.block_ids.extend(c.new_block_ids)
            st.num_computed_tokens = c.num_computed_tokens
            rows.append((st, c.num_scheduled_tokens))
        return rows

    def _validate(self, plan: StepPlan) -> None:
        seen: set[int] = set()
        finished = set(plan.finished_seq_ids)
        steps = plan.num_steps
        if steps < 1:
            raise ValueError(f"step {plan.step_id}: num_steps must be >= 1, got {steps}")
        for r in plan.new_requests:
            self._check_row(r.seq_id, seen, r.block_ids, len(r.block_ids), len(r.token_ids),
                            r.num_computed_tokens, r.num_scheduled_tokens, steps)
            if not 0 <= r.num_prompt_tokens <= len(r.token_ids):
                raise ValueError(f"request {r.seq_id}: num_prompt_tokens {r.num_prompt_tokens} "
                                 f"outside 0..{len(r.token_ids)}")
        new_ids = {r.seq_id for r in plan.new_requests}
        for c in plan.cached_requests:
            st = self.states.get(c.seq_id)
            if c.seq_id in new_ids or st is None or c.seq_id in finished:
                raise ValueError(f"cached request {c.seq_id!r} is unknown to this worker")
            self._check_row(c.seq_id, seen, c.new_block_ids, len(st.block_ids) + len(c.new_block_ids),
                            len(st.token_ids), c.num_computed_tokens, c.num_scheduled_tokens, steps)

    def _check_row(self, rid: int, seen: set[int], block_ids: list[int], table_len: int,
                   num_tokens: int, computed: int, scheduled: int, steps: int) -> None:
        if rid in seen:
            raise ValueError(f"request {rid!r} is scheduled twice in one step")
        seen.add(rid)
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"request {rid!r}: block ids {bad[:5]} outside 0..{self.num_blocks - 1}")
        end = computed + scheduled
        if scheduled < 1 or computed < 0:
            raise ValueError(f"request {rid!r}: bad token counts computed={computed} scheduled={scheduled}")
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
    def build_inputs(self, rows: list[tuple[RequestState, int]]) -> StepInputs:
        # NOTE: decode rows (1 token) first: the attention backend batches them.
        rows = sorted(rows, key=lambda r: r[1] != 1)
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        sample_idx, sample_states = [], []
        for st, n in rows:
            c = st.num_computed_tokens
            ids.extend(st.token_ids[c : c + n])
            pos.extend(range(c, c + n))
            table = st.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(c, c + n))
            query_lens.append(n)
            seq_lens.append(c + n)
            tables.append(table)
            if c + n == len(st.token_ids):
                sample_idx.append(len(ids) - 1)
                sample_states.append(st)
        # NOTE: the four index lists go to the device as one host tensor, one copy.
        T, S = len(ids), len(sample_idx)
        packed = torch.tensor(ids + pos + slots + sample_idx, dtype=torch.long).to(self.device, non_blocking=True)
        input_ids, positions, slot_mapping, sample_indices = packed.split([T, T, T, S])
        meta = self.attention_backend.build_metadata(query_lens, seq_lens, tables, slot_mapping, bs)
        return StepInputs(input_ids=input_ids, positions=positions, meta=meta, sample_indices=sample_indices,
                          sample_states=sample_states)
