"""The input batch keeps every request's block table in one tensor, updated by deltas:
after any sequence of adds, extensions, drops and full resends, a step's gathered table
equals the one built from the requests' own block lists, and rows are reused."""

from __future__ import annotations

import random

import numpy as np
import torch

from llmserve.contract.plan import CachedRequestData, NewRequestData, StepPlan
from llmserve.contract.sampling import SamplingParams
from llmserve.worker.attention import TorchPagedAttention
from llmserve.worker.attention.triton_backend import TritonPagedAttention
from llmserve.worker.block_table import BlockTables
from llmserve.worker.input_batch import InputBatch

BS = 4


def test_rows_are_written_by_deltas_reused_and_zero_padded():
    tables = BlockTables(max_model_len=16, block_size=BS, capacity=2)
    a, b = tables.add([7, 2]), tables.add([3])
    tables.extend(a, [5])
    assert tables.padded([b, a], 3).tolist() == [[3, 0, 0], [7, 2, 5]]
    tables.drop(a)
    c = tables.add([9])  # a's row again, its old entries gone
    assert c == a and tables.padded([c], 3).tolist() == [[9, 0, 0]]
    d = tables.add([1, 1, 1, 1, 1, 1])  # a third row: the tensor doubles; past max_model_len's 5 blocks: widens
    assert tables.padded([d, b, c], 6).tolist() == [[1] * 6, [3] + [0] * 5, [9] + [0] * 5]


def _new(seq_id: int, rng: random.Random, blocks: list[int]) -> NewRequestData:
    n = rng.randint(1, len(blocks) * BS)
    return NewRequestData(seq_id, [rng.randrange(50) for _ in range(n)], n, SamplingParams(), blocks, 0, n)


def test_a_steps_gathered_tables_equal_the_lists_across_random_plans():
    rng = random.Random(0)
    batch = InputBatch(BS, num_blocks=1000, max_model_len=256)
    next_id, free_blocks = 0, list(range(1000))
    for step in range(60):
        plan = StepPlan(step)
        live = list(batch.states)
        for seq_id in rng.sample(live, k=min(len(live), rng.randint(0, 2))):
            plan.finished_seq_ids.append(seq_id)
        for _ in range(rng.randint(0, 3)):
            plan.new_requests.append(_new(next_id, rng, [free_blocks.pop() for _ in range(rng.randint(1, 4))]))
            next_id += 1
        for seq_id in live:
            st = batch.states[seq_id]
            if seq_id in plan.finished_seq_ids or st.num_computed_tokens != len(st.token_ids):
                continue
            st.token_ids.append(rng.randrange(50))  # the last step's sample
            grow = [free_blocks.pop()] if len(st.token_ids) > len(st.block_ids) * BS else []
            plan.cached_requests.append(CachedRequestData(seq_id, grow, st.num_computed_tokens, 1))
        rows = batch.apply_plan(plan)
        if not rows:
            continue
        inputs = batch.build_inputs(rows)
        meta = inputs.meta
        lists = TorchPagedAttention.build_metadata(
            [meta.query_start_loc[i + 1] - meta.query_start_loc[i] for i in range(len(meta.seq_lens))],
            meta.seq_lens, meta.block_tables, meta.slot_mapping, BS)
        if meta.num_decodes:
            assert torch.equal(meta.decode_block_table, lists.decode_block_table), step
        triton = TritonPagedAttention.build_metadata(
            [meta.query_start_loc[i + 1] - meta.query_start_loc[i] for i in range(len(meta.seq_lens))],
            meta.seq_lens, meta.block_tables, meta.slot_mapping, BS)
        widest = triton.block_table.shape[1]
        gathered = batch.block_tables.padded([st.row for st, _ in sorted(
            rows, key=lambda r: r[1] != 1 and not r[0].draft_token_ids)], widest)
        assert torch.equal(gathered, triton.block_table), step
        for st, n in rows:
            st.num_computed_tokens += n
    assert len(batch.states) > 3 and next_id > 20


def test_staged_gathers_alternate_two_buffers_and_match():
    """The CUDA worker's staging: each gather in the other of two persistent buffers, so the
    last step's (maybe still copying to the device) is not overwritten by this one's."""
    plain, staged = BlockTables(16, BS, capacity=2), BlockTables(16, BS, capacity=2, staged=True)
    for tables in (plain, staged):
        tables.add([7, 2, 5]), tables.add([3]), tables.add([4, 4])
    first, second, third = staged.padded([1, 0], 3), staged.padded([2, 1, 0], 2), staged.padded([0], 3)
    assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    assert third.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    assert second.tolist() == plain.padded([2, 1, 0], 2).tolist() == [[4, 4], [3, 0], [7, 2]]
    assert third.tolist() == plain.padded([0], 3).tolist()
    big = staged.padded([0, 1, 2] * 700, 3)  # past the buffers' size: they grow
    assert big.tolist() == plain.padded([0, 1, 2] * 700, 3).tolist()


def test_slots_read_the_tables_as_written_across_growth():
    """A step's slots (table[row, p // 4] * 4 + p % 4) are read from the same memory the
    rows are written to, after the table has grown rows and widened."""
    tables = BlockTables(max_model_len=16, block_size=BS, capacity=1)
    a, b = tables.add([7, 2]), tables.add([3])  # a second row: grows
    tables.extend(b, [1, 1, 1, 1, 8])  # six blocks, past max_model_len's five: widens
    slots = tables.slots(np.array([a, a, b, b]), np.array([0, 5, 3, 23]))
    assert slots.tolist() == [7 * BS + 0, 2 * BS + 1, 3 * BS + 3, 8 * BS + 3]
