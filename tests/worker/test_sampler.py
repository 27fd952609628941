from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from llmserve.contract.sampling import SamplingParams as P
from llmserve.worker.sampler import InFlightIds, Sampler, SamplingRows, _greedy_as_is, adjusted_logits


def _sample(sampler: Sampler, logits, params, output_indices) -> tuple[list[int], list]:
    out = sampler(logits, SamplingRows.from_params(params, output_indices))
    assert out.token_ids.dtype == torch.long and out.token_ids.device == logits.device
    return out.token_ids.tolist(), out.logprobs


def _logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_top_k_1_and_tiny_top_p_are_argmax():
    lg = _logits()
    expect = lg.argmax(-1).tolist()
    s = Sampler(seed=0)
    assert _sample(s, lg, [P(temperature=0.0)] * 4, [0] * 4)[0] == expect
    assert _sample(s, lg, [P(temperature=1.5, top_k=1)] * 4, [0] * 4)[0] == expect
    assert _sample(s, lg, [P(temperature=1.5, top_p=1e-6)] * 4, [0] * 4)[0] == expect


def test_top_k_restricts_support():
    lg = _logits(rows=1, vocab=50).repeat(300, 1)
    allowed = set(lg[0].topk(3).indices.tolist())
    toks, _ = _sample(Sampler(seed=1), lg, [P(temperature=5.0, top_k=3)] * 300, [0] * 300)
    assert set(toks) == allowed  # hot temperature: all 3 show up, nothing else


def test_seeded_row_independent_of_batch_and_depends_on_output_index():
    lg = _logits(rows=6)
    seeded = P(temperature=1.0, seed=42)
    a, _ = _sample(Sampler(seed=0), lg[[0]], [seeded], [7])
    b, _ = _sample(Sampler(seed=9), lg[[3, 1, 0, 2]], [P(), P(temperature=0.0), seeded, P(seed=5)], [0, 0, 7, 0])
    assert a[0] == b[2]
    draws = {_sample(Sampler(), lg[[0]] * 0.01, [seeded], [i])[0][0] for i in range(40)}
    assert len(draws) > 5  # a different draw per output index (near-uniform distribution)


def test_logprobs_from_raw_logits():
    lg = _logits(rows=3)
    params = [P(temperature=0.7, top_k=5, logprobs=4), P(temperature=0.0), P(temperature=0.0, logprobs=0)]
    toks, lps = _sample(Sampler(seed=0), lg, params, [0, 0, 0])
    ref = torch.log_softmax(lg.float(), dim=-1)
    assert lps[1] is None
    lp0 = lps[0]
    assert lp0.token_id == toks[0] and abs(lp0.logprob - ref[0, toks[0]].item()) < 1e-5
    assert list(lp0.top_logprobs) == sorted(lp0.top_logprobs, reverse=True)
    assert list(lp0.top_token_ids) == ref[0].topk(4).indices.tolist()
    torch.testing.assert_close(torch.tensor(lp0.top_logprobs), ref[0].topk(4).values)
    assert lps[2].top_token_ids == () and abs(lps[2].logprob - ref[2].max().item()) < 1e-5
    # The sampler leaves them as tensors (a pipelined step reads them back with its ids).
    pending = Sampler(seed=0)(lg.clone(), SamplingRows.from_params(params, [0, 0, 0])).pending_logprobs
    assert pending.rows == (0, 2) and pending.ks == (4, 0) and all(isinstance(t, torch.Tensor) for t in pending.tensors)
    assert pending.read() == lps


def test_temperature_sampling_frequencies():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n, temp = 4000, 2.0
    # logits such that softmax(logits / temp) == probs
    lg = (probs.log() * temp).repeat(n, 1)
    toks, _ = _sample(Sampler(seed=123), lg, [P(temperature=temp)] * n, [0] * n)
    freq = torch.bincount(torch.tensor(toks), minlength=4).float() / n
    assert (freq - probs).abs().max() < 0.03, freq


def test_seeded_rows_follow_distribution():
    probs = torch.tensor([0.25, 0.5, 0.25])
    n = 2000
    lg = probs.log().repeat(n, 1)
    toks, _ = _sample(Sampler(), lg, [P(seed=s) for s in range(n)], [0] * n)
    freq = torch.bincount(torch.tensor(toks), minlength=3).float() / n
    assert (freq - probs).abs().max() < 0.04, freq


# ---- logit_bias, min_tokens, penalties, min_p: each against a plain-torch reference of
# its definition, one row at a time (sampler.py's docstring states them) ----------------

def _reference_adjusted(logits: torch.Tensor, params, histories, prompt_lens, output_index) -> torch.Tensor:
    """logit_bias, then stop ids masked under min_tokens, then repetition (prompt + output),
    frequency and presence (output only): a loop over rows and tokens."""
    out = logits.clone()
    for r, p in enumerate(params):
        for token, bias in p.logit_bias:
            out[r, token] += bias
        if output_index[r] < p.min_tokens:
            for token in p.stop_token_ids:
                out[r, token] = float("-inf")
        history = list(histories[r])
        outputs = history[prompt_lens[r]:]
        for token in set(history):
            if p.repetition_penalty != 1:
                l = out[r, token]
                out[r, token] = l / p.repetition_penalty if l > 0 else l * p.repetition_penalty
        for token in set(outputs):
            out[r, token] -= p.frequency_penalty * outputs.count(token) + p.presence_penalty
    return out


def _rows(params, output_index, histories, prompt_lens) -> SamplingRows:
    return SamplingRows.from_params(params, output_index, histories, prompt_lens)


MIXED = [
    P(temperature=0.0),
    P(temperature=0.0, logit_bias=((3, 2.5), (7, -1.5), (49, 100.0))),
    P(temperature=0.0, repetition_penalty=1.5),
    P(temperature=0.0, frequency_penalty=0.75, presence_penalty=-0.5),
    P(temperature=0.0, repetition_penalty=0.5, frequency_penalty=-0.25, presence_penalty=1.25, logit_bias=((0, 4.0),)),
    P(temperature=0.0, min_tokens=3, stop_token_ids=(2, 11)),
    P(temperature=0.0, min_tokens=1, stop_token_ids=(5,)),
]
HISTORIES = [[1, 2], [4, 4, 9], [1, 2, 2, 3, 40, 40], [5, 6, 6, 6, 7, 8, 8], [0, 0, 1, 30, 30, 30], [2], [5, 5]]
PROMPT_LENS = [2, 1, 3, 2, 4, 1, 1]
OUTPUT_INDEX = [0, 2, 3, 5, 2, 2, 1]  # Row 5 is under its min_tokens, row 6 just past it.


def test_adjusted_logits_match_the_definitions_exactly():
    lg = _logits(rows=len(MIXED), vocab=50, seed=3)
    got = adjusted_logits(lg.clone(), _rows(MIXED, OUTPUT_INDEX, HISTORIES, PROMPT_LENS))  # In place.
    ref = _reference_adjusted(lg, MIXED, HISTORIES, PROMPT_LENS, OUTPUT_INDEX)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert torch.equal(got[0], lg[0])  # A row using none of them is untouched...
    assert got[5, 2] == got[5, 11] == float("-inf") and torch.equal(got[6], lg[6])  # ...and past min_tokens.


def test_an_id_in_flight_is_penalized_as_the_same_id_read_back():
    # Each row's last id is a placeholder of the step in flight (its id on the "device",
    # at a shuffled index): the logits equal those of the read-back history bit for bit.
    # Cases: the id in flight repeats an output (its count goes up: row 3), is in the
    # prompt only (row 2), is new (row 4), is the row's only output (row 6 has none else).
    params = MIXED + [P(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=1.3)]
    histories = HISTORIES + [[7, 8, 9]]
    prompt_lens = PROMPT_LENS + [2]
    output_index = OUTPUT_INDEX + [1]
    lg = _logits(rows=len(params), vocab=50, seed=5)
    known = adjusted_logits(lg.clone(), _rows(params, output_index, histories, prompt_lens))
    penalized = [2, 3, 4, 7]
    ids_in_flight = torch.tensor([0, histories[4][-1], histories[7][-1], 0, histories[2][-1], histories[3][-1]])
    at = {2: 4, 3: 5, 4: 1, 7: 2}
    with_holes = [list(h[:-1]) + [-1] if r in penalized else h for r, h in enumerate(histories)]
    holes = {r: (len(histories[r]) - 1, at[r]) for r in penalized}
    rows = replace(_rows(params, output_index, with_holes, prompt_lens), in_flight=InFlightIds(ids_in_flight, holes))
    torch.testing.assert_close(adjusted_logits(lg.clone(), rows), known, rtol=0, atol=0)
    # The ids in flight are read: other ids there change the penalized rows' logits only.
    wrong = replace(rows, in_flight=InFlightIds((ids_in_flight + 1) % 50, holes))
    differs = (adjusted_logits(lg.clone(), wrong) != known).any(dim=1)
    assert differs[penalized].all() and not differs[[0, 1, 5, 6]].any()


def test_a_bad_word_hanging_on_an_id_in_flight_bans_as_the_id_read_back():
    # Each row's last id is a placeholder of the step in flight. Row 0: (3, 4, 9) bans 9
    # after ... 3, 4 (the 4 in flight); row 1: (4, 9) after ... 4 (in flight) and (8, 9, 2)
    # whose known 8 does not match; row 2: (4, 9) where the id in flight is not 4; row 3:
    # the placeholder lies before the word's window ((7, 3) after ... 7: banned on the
    # host), row 4: a word longer than the output (never the prompt); row 5: no placeholder.
    words = [((3, 4, 9),), ((4, 9), (8, 9, 2)), ((4, 9),), ((7, 3), (5,)), ((1, 2, 3, 4, 9),), ((4, 9),)]
    histories = [[1, 3, 4], [2, 5, 4], [2, 5, 6], [2, 7, 7], [1, 2, 3, 4], [2, 4]]
    prompt_lens = [1, 1, 1, 1, 2, 1]
    holes_at = {0: 2, 1: 2, 2: 2, 3: 1, 4: 3}  # row -> the placeholder's position
    params = [P(temperature=0.0, bad_words_token_ids=w) for w in words]
    output_index = [len(h) - n for h, n in zip(histories, prompt_lens)]
    lg = _logits(rows=len(params), vocab=12, seed=7)
    known = adjusted_logits(lg.clone(), _rows(params, output_index, histories, prompt_lens))
    assert known[0, 9] == known[1, 9] == known[3, 3] == known[3, 5] == known[5, 9] == float("-inf")
    assert torch.isfinite(known[[2, 4]]).all()
    index = {0: 3, 1: 0, 2: 1, 3: 4, 4: 2}  # row -> its id's index among the ids in flight
    ids_in_flight = torch.zeros(5, dtype=torch.long)
    for r, i in index.items():
        ids_in_flight[i] = histories[r][holes_at[r]]
    with_holes = [[-1 if k == holes_at.get(r) else t for k, t in enumerate(h)] for r, h in enumerate(histories)]
    holes = {r: (holes_at[r], index[r]) for r in holes_at}
    rows = replace(_rows(params, output_index, with_holes, prompt_lens), in_flight=InFlightIds(ids_in_flight, holes))
    torch.testing.assert_close(adjusted_logits(lg.clone(), rows), known, rtol=0, atol=0)
    # The ids in flight are read: others there lift the bans that hung on them (rows 0, 1)
    # and add one where the word's id is now in flight (row 2 with 4), nothing else.
    other = ids_in_flight.clone()
    other[index[0]], other[index[1]], other[index[2]] = 5, 5, 4
    got = adjusted_logits(lg.clone(), replace(rows, in_flight=InFlightIds(other, holes)))
    assert got[0, 9] == lg[0, 9] and got[1, 9] == lg[1, 9] and got[2, 9] == float("-inf")
    assert torch.equal(got[3:], known[3:])


def test_no_row_using_them_costs_nothing():
    lg = _logits(rows=3)
    before = lg.clone()
    assert adjusted_logits(lg, _rows([P(), P(temperature=0.0), P(min_tokens=2)], [0, 0, 5], [[1]] * 3, [1] * 3)) is lg
    assert torch.equal(lg, before)


def test_greedy_follows_the_adjusted_logits_and_other_rows_keep_their_tokens():
    lg = _logits(rows=len(MIXED), vocab=50, seed=4)
    ref = _reference_adjusted(lg, MIXED, HISTORIES, PROMPT_LENS, OUTPUT_INDEX).argmax(-1)
    out = Sampler(seed=0)(lg.clone(), _rows(MIXED, OUTPUT_INDEX, HISTORIES, PROMPT_LENS))
    assert out.token_ids.tolist() == ref.tolist()
    assert out.token_ids[1] == 49  # +100 forces a token.
    alone = Sampler(seed=0)(lg[[0]], _rows([MIXED[0]], [0], [HISTORIES[0]], [2]))
    assert out.token_ids[0] == alone.token_ids[0] == lg[0].argmax()


def test_penalties_bite_where_the_reference_says():
    # A row whose top token is repeated in its output: a frequency penalty moves greedy off it.
    lg = torch.tensor([[3.0, 2.5, 0.0, -1.0]])
    history, prompt_len = [2, 0, 0], 1  # Token 0 twice in the output.
    plain = P(temperature=0.0)
    assert Sampler()(lg, _rows([plain], [2], [history], [prompt_len])).token_ids.tolist() == [0]
    freq = P(temperature=0.0, frequency_penalty=0.5)  # 3 - 2 * 0.5 = 2 < 2.5
    assert Sampler()(lg, _rows([freq], [2], [history], [prompt_len])).token_ids.tolist() == [1]
    # Presence counts outputs only: token 2, in the prompt only, keeps its logit.
    lg2 = torch.tensor([[0.0, 0.0, 1.0, 0.5]])
    pres = P(temperature=0.0, presence_penalty=2.0)
    assert Sampler()(lg2, _rows([pres], [2], [history], [prompt_len])).token_ids.tolist() == [2]
    # Repetition counts the prompt too: 1.0 / 4 = 0.25 < 0.5.
    rep = P(temperature=0.0, repetition_penalty=4.0)
    assert Sampler()(lg2, _rows([rep], [2], [history], [prompt_len])).token_ids.tolist() == [3]


def test_min_p_keeps_exactly_the_tokens_the_definition_keeps():
    from llmserve.worker.sampler import _filtered_probs

    lg = _logits(rows=3, vocab=40, seed=5)
    params = [P(temperature=0.7, min_p=0.2), P(temperature=1.3, min_p=0.05), P(temperature=1.0)]
    probs = _filtered_probs(lg, _rows(params, [0] * 3, [[]] * 3, [0] * 3))
    for r, p in enumerate(params):
        full = (lg[r] / p.temperature).softmax(-1)
        keep = full >= p.min_p * full.max()
        assert torch.equal(probs[r] > 0, keep), r
        torch.testing.assert_close(probs[r], torch.where(keep, full, 0.0) / full[keep].sum())


def test_min_p_sampling_stays_in_its_support():
    lg = torch.tensor([[2.0, 1.9, 0.0, -3.0]]).repeat(500, 1)
    toks, _ = _sample(Sampler(seed=2), lg, [P(temperature=1.0, min_p=0.5)] * 500, [0] * 500)
    assert set(toks) == {0, 1}


def test_random_rows_sample_from_the_adjusted_distribution():
    # A -100 bias bans a token for random rows too; min_tokens bans a stop id.
    lg = torch.zeros(400, 4)
    params = [P(temperature=1.0, logit_bias=((1, -100.0),), min_tokens=2, stop_token_ids=(3,))] * 400
    toks, _ = _sample(Sampler(seed=3), lg, params, [0] * 400)
    assert set(toks) == {0, 2}


def test_draft_positions_see_the_drafts_before_them_as_output():
    from llmserve.contract.plan import NewRequestData, StepPlan
    from llmserve.worker.input_batch import InputBatch

    sampling = P(temperature=0.0, frequency_penalty=1.0)
    batch = InputBatch(block_size=4, num_blocks=8, max_model_len=64)
    plan = StepPlan(step_id=0, new_requests=[NewRequestData(1, [1, 2, 3, 4], 3, sampling, [0, 1], 3, 3,
                                                            draft_token_ids=[7, 8])])
    rows = batch.build_inputs(batch.apply_plan(plan)).sampling
    assert [list(h) for h in rows.token_ids] == [[1, 2, 3, 4], [1, 2, 3, 4, 7], [1, 2, 3, 4, 7, 8]]
    assert rows.output_index == [1, 2, 3] and rows.num_prompt_tokens == [3, 3, 3]


def _bits(allowed: list[list[int]], vocab: int) -> torch.Tensor:
    """[C, ceil(V / 32)] int32 with row j's `allowed` ids set: a plain-torch bit packing."""
    words = torch.zeros(len(allowed), (vocab + 31) // 32, dtype=torch.int64)
    for j, ids in enumerate(allowed):
        for t in ids:
            words[j, t // 32] |= 1 << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_the_token_bitmask_masks_the_constrained_rows_only():
    from llmserve.worker.sampler import TokenBitmask, _apply_token_bitmask

    vocab, allowed = 70, [[3, 40, 69], [0, 33]]  # rows 1 and 3 of 4 are constrained
    lg = _logits(rows=4, vocab=vocab, seed=5)
    masked = lg.clone()
    _apply_token_bitmask(masked, TokenBitmask(torch.tensor([1, 3]), _bits(allowed, vocab)))
    for row, ids in zip((1, 3), allowed):
        ref = torch.full((vocab,), float("-inf"))
        ref[ids] = lg[row, ids]
        assert torch.equal(masked[row], ref)
    assert torch.equal(masked[[0, 2]], lg[[0, 2]])  # The plain rows are untouched.
    rows = SamplingRows.from_params([P(temperature=0.0)] * 4, [0] * 4,
                                    token_bitmask=TokenBitmask(torch.tensor([1, 3]), _bits(allowed, vocab)))
    tokens = Sampler(seed=0)(lg.clone(), rows).token_ids.tolist()
    assert tokens == [int(lg[0].argmax()), allowed[0][int(lg[1, allowed[0]].argmax())],
                      int(lg[2].argmax()), allowed[1][int(lg[3, allowed[1]].argmax())]]
    assert rows.select([3, 0]).token_bitmask is None  # Applied before rows are selected.


def _reference_bad_words(logits, params, histories, prompt_lens):
    """vLLM's definition, row by row: a bad word's last id is -inf where the row's
    generated tokens end with the word's other ids (none: always)."""
    out = logits.clone()
    for r, p in enumerate(params):
        generated = list(histories[r][prompt_lens[r]:])
        for word in p.bad_words_token_ids:
            *prefix, last = word
            if not prefix or (len(generated) >= len(prefix) and generated[len(generated) - len(prefix):] == prefix):
                out[r, last] = float("-inf")
    return out


BAD_WORDS = [
    P(temperature=0.0),
    P(temperature=0.0, bad_words_token_ids=((7,), (3,))),  # One-token words: always.
    P(temperature=0.0, bad_words_token_ids=((4, 9), (5, 12))),  # Output ends with 4: 9 banned, 12 not.
    P(temperature=0.0, bad_words_token_ids=((1, 2, 20),)),  # 1, 2 are the prompt's: not banned.
    P(temperature=0.0, bad_words_token_ids=((6, 6, 21), (8, 22)), min_tokens=3, stop_token_ids=(0,)),
    P(temperature=0.0, bad_words_token_ids=((30, 31, 32, 33),)),  # Longer than the output: not banned.
]
BAD_HISTORIES = [[1, 2], [1, 2, 3], [1, 5, 4], [0, 1, 2], [9, 6, 6], [30, 31, 32]]
BAD_PROMPT_LENS = [2, 2, 1, 3, 1, 2]


def test_bad_words_match_the_definition_exactly():
    lg = _logits(rows=len(BAD_WORDS), vocab=40, seed=7)
    output_index = [len(h) - n for h, n in zip(BAD_HISTORIES, BAD_PROMPT_LENS)]
    got = adjusted_logits(lg.clone(), _rows(BAD_WORDS, output_index, BAD_HISTORIES, BAD_PROMPT_LENS))
    ref = _reference_bad_words(_reference_adjusted(lg, BAD_WORDS, BAD_HISTORIES, BAD_PROMPT_LENS, output_index),
                               BAD_WORDS, BAD_HISTORIES, BAD_PROMPT_LENS)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    banned = [(r, t) for r in range(len(BAD_WORDS)) for t in range(40) if got[r, t] == float("-inf")]
    assert banned == [(1, 3), (1, 7), (2, 9), (4, 0), (4, 21)]  # The cases above bite where they say.
    assert torch.equal(got[0], lg[0])  # A row without bad words is untouched.


def test_greedy_avoids_a_banned_top_token_and_other_rows_keep_theirs():
    lg = _logits(rows=3, vocab=40, seed=8)
    top = lg.argmax(-1).tolist()
    params = [P(temperature=0.0), P(temperature=0.0, bad_words_token_ids=((top[1],),)),
              P(temperature=0.0, bad_words_token_ids=((5, top[2]),))]
    out = Sampler(seed=0)(lg.clone(), _rows(params, [1, 1, 1], [[1, 2], [1, 2], [1, 5]], [1, 1, 1]))
    assert out.token_ids.tolist() == [top[0], lg[1].topk(2).indices[1], lg[2].topk(2).indices[1]]


def test_prompt_logprobs_in_slices_equal_one_log_softmax(monkeypatch):
    from llmserve.worker import sampler

    logits, targets = _logits(rows=7, vocab=30, seed=9), torch.tensor([3, 0, 29, 5, 5, 17, 8])
    monkeypatch.setattr(sampler, "PROMPT_LOGPROBS_SLICE", 3)  # 7 positions: slices of 3, 3 and 1.
    got = sampler.as_token_logprobs(sampler.prompt_logprob_tensors(logits, targets, 2), [2] * 7)
    ref = torch.log_softmax(logits, dim=-1)
    assert [lp.token_id for lp in got] == targets.tolist()
    assert [lp.logprob for lp in got] == ref.gather(1, targets[:, None])[:, 0].tolist()
    assert [lp.rank for lp in got] == [int((row > row[t]).sum()) + 1 for row, t in zip(ref, targets)]
    assert [list(lp.top_token_ids) for lp in got] == ref.topk(2, dim=-1).indices.tolist()


def test_the_table_gathers_each_rows_own_settings_after_reuse_and_growth():
    """SamplingTable: rows written once, gathered in any order (a row repeated, as a row
    verifying drafts samples at each); a row written again for a new request reads the
    new settings; past its capacity the table grows and keeps what it held."""
    from dataclasses import fields

    import numpy as np

    from llmserve.worker.sampler import SamplingTable

    table = SamplingTable(capacity=2)
    held = {0: P(temperature=0.5, top_k=3, seed=7, logprobs=2),
            1: P(min_p=0.25, stop_token_ids=(2, 9), logit_bias=((3, 1.5),))}
    prompts = {0: 4, 1: 1}
    for row, p in held.items():
        table.write(row, p, prompts[row])
    held[0], prompts[0] = P(repetition_penalty=1.25, bad_words_token_ids=((4,), (6, 8))), 2  # row 0 reused
    held[3], prompts[3] = P(frequency_penalty=0.5, presence_penalty=-0.75, min_tokens=2, top_p=0.25), 3  # grows
    for row in (0, 3):
        table.write(row, held[row], prompts[row])
    rows = [3, 0, 0, 1]
    got = table.gather(rows, np.array([5, 6, 7, 1]))
    for f in fields(SamplingRows):
        if f.name not in SamplingRows.ROW_STATE:
            column = getattr(got, f.name)
            assert (column.tolist() if isinstance(column, torch.Tensor) else column) == \
                [getattr(held[r], f.name) for r in rows], f.name
    assert got.temperature.dtype == torch.float32 and got.top_k.dtype == torch.long
    assert got.output_index == [5 - 3, 6 - 2, 7 - 2, 1 - 1] and got.num_prompt_tokens == [3, 2, 2, 1]


def test_bfloat16_logits_sample_what_their_float32_copy_samples():
    # Greedy rows with nothing to adjust take the argmax of the bfloat16 logits as they are;
    # a logit_bias, a penalty, a min_tokens ban, logprobs or a random row send the step
    # through the float32 path. Either way the tokens are those of the float32 copy.
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(4, 700, generator=gen) * 4).bfloat16()  # bfloat16: ties for the max are common
    logits[1, [5, 600]] = 40.0  # a tie: the first index wins
    top = logits.float().argmax(dim=-1)
    variants = {
        "plain": [P(temperature=0.0)] * 4,
        "bias": [P(temperature=0.0), P(temperature=0.0, logit_bias=((int(top[1]), -100.0),)),
                 P(temperature=0.0), P(temperature=0.0)],
        "penalty": [P(temperature=0.0, repetition_penalty=1.5)] + [P(temperature=0.0)] * 3,
        "min_tokens": [P(temperature=0.0, min_tokens=3, stop_token_ids=(int(top[2]),))] * 4,
        "logprobs": [P(temperature=0.0, logprobs=2)] + [P(temperature=0.0)] * 3,
        "random": [P(temperature=0.0)] * 3 + [P(temperature=1.0, seed=7)],
    }
    histories = [[int(top[0])] * 2, [1], [1], [1]]
    for name, params in variants.items():
        rows = SamplingRows.from_params(params, [0] * 4, histories, [1] * 4)
        assert _greedy_as_is(rows) == (name == "plain"), name
        want = Sampler(seed=0)(logits.float(), rows)
        got = Sampler(seed=0)(logits, rows)
        assert torch.equal(got.token_ids, want.token_ids), name
        assert [lp is None for lp in got.logprobs] == [lp is None for lp in want.logprobs], name
    assert int(Sampler()(logits, SamplingRows.from_params(variants["plain"], [0] * 4)).token_ids[1]) == 5


def test_a_rows_host_ids_follow_its_token_ids_as_they_grow_and_get_their_placeholders():
    from llmserve.worker.input_batch import PLACEHOLDER, RequestState

    st = RequestState(1, list(range(100)), 50, P(temperature=0.0, presence_penalty=1.0), [0], 100)
    assert st.host_ids().tolist() == list(range(100))
    st.token_ids += [7, PLACEHOLDER]  # a step in flight: its id is not known yet
    assert st.host_ids().tolist() == [*range(100), 7, PLACEHOLDER]
    st.token_ids[-1] = 9  # read back
    st.token_ids += list(range(200))  # past the array's first capacity
    assert st.host_ids().tolist() == [*range(100), 7, 9, *range(200)]
    first = st.host_ids()
    st.token_ids.append(5)
    assert first.tolist() == [*range(100), 7, 9, *range(200)]  # earlier views keep their length
    assert st.host_ids().tolist() == st.token_ids


def test_penalized_rows_reach_the_sampler_as_their_ids_and_sample_as_from_lists():
    from llmserve.contract.plan import CachedRequestData, NewRequestData, StepPlan
    from llmserve.worker.input_batch import InputBatch

    batch = InputBatch(block_size=4, num_blocks=16, max_model_len=64)
    params = [P(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.3), P(temperature=0.0)]
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    batch.apply_plan(StepPlan(0, new_requests=[
        NewRequestData(i, p, len(p), s, [2 * i, 2 * i + 1], len(p) - 1, 1)
        for i, (p, s) in enumerate(zip(prompts, params))]))
    for i, extra in enumerate(([1, 1], [2])):  # outputs
        batch.states[i].token_ids += extra
    plan = StepPlan(1, cached_requests=[CachedRequestData(0, [], 6, 1), CachedRequestData(1, [], 3, 1)])
    rows = batch.build_inputs(batch.apply_plan(plan)).sampling
    assert isinstance(rows.token_ids[0], np.ndarray) and rows.token_ids[0].tolist() == [3, 1, 4, 1, 5, 1, 1]
    assert rows.token_ids[1] is batch.states[1].token_ids  # not penalized: never read
    lg = _logits(rows=2, vocab=12, seed=8)
    as_lists = replace(rows, token_ids=[list(map(int, h)) for h in rows.token_ids])
    torch.testing.assert_close(adjusted_logits(lg.clone(), rows), adjusted_logits(lg.clone(), as_lists), rtol=0, atol=0)
    ref = _reference_adjusted(lg, params, as_lists.token_ids, [5, 3], rows.output_index)
    torch.testing.assert_close(adjusted_logits(lg.clone(), rows), ref)
