"""A plain decode row (one token, no new block, no drafts) takes a short path through the
input batch's validation and input building: it refuses exactly what the general checks
refuse, with their messages, and gives the tensors a decode row must have."""

from __future__ import annotations

import pytest

from llmserve.contract.plan import CachedRequestData, NewRequestData, StepPlan
from llmserve.contract.sampling import SamplingParams
from llmserve.worker.input_batch import InputBatch

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
