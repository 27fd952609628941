"""A plain decode row (one token, no new block, no drafts) is most rows of a step: the
input batch's one set of checks refuses what is wrong with it, with their messages, and
its columns path gives the tensors a decode row must have, beside the general path's rows."""

from __future__ import annotations

import pytest
import torch

from llmserve.contract.plan import CachedRequestData, NewRequestData, StepPlan
from llmserve.contract.sampling import SamplingParams
from llmserve.worker.input_batch import PLACEHOLDER, InputBatch, Placeholder

BS = 4


def _batch_with_two_decoding(max_model_len: int = 8) -> InputBatch:
    """Seq 1: 6 tokens on blocks [7, 2]; seq 2: 3 tokens on block [5]; both prefilled but
    for their last token, which the next step decodes."""
    batch = InputBatch(BS, num_blocks=16, max_model_len=max_model_len)
    batch.apply_plan(StepPlan(0, new_requests=[
        NewRequestData(1, [11, 12, 13, 14, 15, 16], 6, SamplingParams(), [7, 2], 0, 5),
        NewRequestData(2, [21, 22, 23], 3, SamplingParams(), [5], 0, 2),
    ]))
    batch.states[1].num_computed_tokens, batch.states[2].num_computed_tokens = 5, 2
    return batch


@pytest.mark.parametrize("row, message", [
    (CachedRequestData(1, [], 6, 1), "tokens up to 7 scheduled but the worker knows 6"),
    (CachedRequestData(1, [], -1, 1), "bad token counts computed=-1"),
    (CachedRequestData(2, [], 3, 1), "tokens up to 4 scheduled but the worker knows 3"),
    (CachedRequestData(9, [], 0, 1), "cached request 9 is unknown to this worker"),
])
def test_a_bad_decode_row_is_refused_as_the_general_checks_refuse_it(row, message):
    batch = _batch_with_two_decoding()
    with pytest.raises(ValueError, match=message):
        batch.apply_plan(StepPlan(1, cached_requests=[row]))
    assert batch.states[1].num_computed_tokens == 5  # states untouched


def test_a_decode_row_past_its_table_or_the_model_length_is_refused():
    batch = _batch_with_two_decoding()
    batch.states[2].token_ids += [24, 25]  # position 4 would need a second block
    with pytest.raises(ValueError, match=r"position 4 is beyond its block table \(1 blocks of 4\)"):
        batch.apply_plan(StepPlan(1, cached_requests=[CachedRequestData(2, [], 4, 1)]))
    batch = _batch_with_two_decoding(max_model_len=6)
    batch.states[1].token_ids.append(17)  # position 6 fits its table (8 slots), not the model
    with pytest.raises(ValueError, match="length 7 exceeds max_model_len 6"):
        batch.apply_plan(StepPlan(1, cached_requests=[CachedRequestData(1, [], 6, 1)]))


def test_a_row_scheduled_twice_is_refused():
    batch = _batch_with_two_decoding()
    with pytest.raises(ValueError, match="request 1 is scheduled twice in one step"):
        batch.apply_plan(StepPlan(1, cached_requests=[CachedRequestData(1, [], 5, 1), CachedRequestData(1, [], 5, 1)]))


def test_decode_rows_give_their_token_position_slot_and_sampled_index():
    batch = _batch_with_two_decoding()
    rows = batch.apply_plan(StepPlan(1, cached_requests=[CachedRequestData(2, [], 2, 1),
                                                         CachedRequestData(1, [], 5, 1)]))
    inputs = batch.build_inputs(rows)
    assert inputs.input_ids.tolist() == [23, 16]
    assert inputs.positions.tolist() == [2, 5]
    # slot = table[p // 4] * 4 + p % 4: seq 2 at 2 in block 5; seq 1 at 5 in block 2
    assert inputs.meta.slot_mapping.tolist() == [5 * BS + 2, 2 * BS + 1]
    assert inputs.sample_indices.tolist() == [0, 1]
    assert [st.seq_id for st in inputs.sample_states] == [2, 1] and inputs.sample_offsets == [0, 0]
    assert inputs.meta.seq_lens == [3, 6] and inputs.prompt_rows == []


def test_a_mixed_step_orders_decode_rows_first_and_reads_placeholders_from_the_device():
    """Plain decode rows lead (read as columns); a row verifying drafts, a plain decode
    after it and a prefill chunk take the general path; the plan's order is kept among
    decode rows, and an in-flight token comes from the last step's sampled ids."""
    batch = InputBatch(BS, num_blocks=16, max_model_len=64)
    batch.apply_plan(StepPlan(0, new_requests=[
        NewRequestData(1, [11, 12, 13, 14, 15, 16], 6, SamplingParams(), [7, 2], 0, 6),
        NewRequestData(2, [21, 22, 23], 3, SamplingParams(), [5], 0, 3),
        NewRequestData(3, [41, 42, 43, 44], 2, SamplingParams(), [6, 3], 0, 4),
    ]))
    s1, s2, s3 = (batch.states[i] for i in (1, 2, 3))
    s1.token_ids.append(PLACEHOLDER)  # sampled by the step in flight (its sample 1), not read back
    s1.num_computed_tokens, s1.placeholder = 6, Placeholder(s1, 6, 1)
    s2.token_ids.append(24)  # read back already
    s2.num_computed_tokens = 3
    s3.token_ids.append(47)
    s3.num_computed_tokens = 4
    rows = batch.apply_plan(StepPlan(1, new_requests=[
        NewRequestData(10, [31, 32, 33, 34, 35, 36], 6, SamplingParams(), [8, 9], 0, 4),  # a chunk: no sample
    ], cached_requests=[CachedRequestData(1, [], 6, 1), CachedRequestData(3, [], 4, 3, [45, 46]),
                        CachedRequestData(2, [], 3, 1)]))
    inputs = batch.build_inputs(rows, prev_sampled=torch.tensor([90, 91]))
    assert inputs.input_ids.tolist() == [91, 47, 45, 46, 24, 31, 32, 33, 34]
    assert inputs.positions.tolist() == [6, 4, 5, 6, 3, 0, 1, 2, 3]
    # slot = table[p // 4] * 4 + p % 4: seq 1 in block 2, seq 3 in block 3, seq 2 in block 5, seq 10 in block 8
    assert inputs.meta.slot_mapping.tolist() == [10, 12, 13, 14, 23, 32, 33, 34, 35]
    assert inputs.sample_indices.tolist() == [0, 1, 2, 3, 4]
    assert [st.seq_id for st in inputs.sample_states] == [1, 3, 3, 3, 2] and inputs.sample_offsets == [0, 0, 1, 2, 0]
    assert inputs.meta.seq_lens == [7, 5, 6, 7, 4, 4] and inputs.meta.num_decodes == 5
    assert inputs.meta.query_start_loc == [0, 1, 2, 3, 4, 5, 9]
    assert inputs.sampling.output_index == [1, 3, 4, 5, 1]  # outputs before each sample (drafts before it counted)
    assert inputs.sampling.num_prompt_tokens == [6, 2, 2, 2, 3]
