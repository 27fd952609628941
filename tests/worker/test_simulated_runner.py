"""The simulated worker (`--simulated-step-ms`): the real input bookkeeping, a device step
that only takes time, deterministic tokens that never hit eos."""

from __future__ import annotations

import json
import time

import pytest
import torch

from llmserve.contract.plan import CachedRequestData, NewRequestData, StepPlan
from llmserve.contract.sampling import SamplingParams
from llmserve.worker.config import RunnerConfig, WorkerConfig
from llmserve.worker.service import load_runner
from llmserve.worker.simulated_runner import SimulatedRunner, simulated_token, simulated_tokens

VOCAB = 100


@pytest.fixture
def model_dir(tmp_path):
    """config.json and generation_config.json only: a simulated worker reads no weights."""
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB, "eos_token_id": 2, "bos_token_id": 1,
                                                      "max_position_embeddings": 256}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    return tmp_path


def runner_for(model_dir, step_ms: float = 2.0) -> SimulatedRunner:
    return SimulatedRunner(model_dir, RunnerConfig(num_kv_blocks=32, block_size=4), step_ms, model_name="sim")


def chain(prompt: list[int], count: int, eos=frozenset({2, 7})) -> list[int]:
    out, prev = [], prompt[-1]
    for pos in range(len(prompt), len(prompt) + count):
        prev = simulated_token(pos, prev, VOCAB, eos)
        out.append(prev)
    return out


def new(seq_id: int, prompt: list[int], blocks: list[int]) -> NewRequestData:
    return NewRequestData(seq_id, list(prompt), len(prompt), SamplingParams(temperature=0.0), blocks, 0, len(prompt))


def test_the_token_function_is_fixed_and_steps_past_eos():
    token = simulated_token(5, 11, VOCAB)
    assert token == simulated_token(5, 11, VOCAB)  # Deterministic.
    assert simulated_token(6, 11, VOCAB) != token or simulated_token(5, 12, VOCAB) != token
    assert simulated_token(5, 11, VOCAB, frozenset({token})) == (token + 1) % VOCAB
    assert all(0 <= simulated_token(p, q, VOCAB) < VOCAB for p in range(50) for q in range(50))


def test_the_device_computes_every_rows_token_at_once_as_the_function_does():
    """The device thread's vectorized tokens equal simulated_token row by row, eos ids
    stepped past too (here a run of three consecutive ones that many rows hit)."""
    positions, previous = torch.arange(0, 4000, 7), torch.arange(4000, 0, -7) % VOCAB
    plain = [simulated_token(p, q, VOCAB) for p, q in zip(positions.tolist(), previous.tolist())]
    eos = frozenset(t + k for t in plain[::5] for k in range(3))
    assert simulated_tokens(positions, previous, VOCAB).tolist() == plain
    assert simulated_tokens(positions, previous, VOCAB, eos).tolist() == [
        simulated_token(p, q, VOCAB, eos) for p, q in zip(positions.tolist(), previous.tolist())]


def test_info_comes_from_config_json(model_dir):
    info = runner_for(model_dir).info
    assert (info.vocab_size, info.eos_token_ids, info.max_model_len, info.bos_token_id) == (VOCAB, (2, 7), 256, 1)
    assert (info.num_kv_blocks, info.block_size, info.model) == (32, 4, "sim")


def test_steps_keep_the_real_bookkeeping_and_return_the_chain(model_dir):
    runner = runner_for(model_dir)
    a, b = [5, 6, 8, 9, 10], [3, 4]
    first = runner.execute(StepPlan(1, new_requests=[new(0, a, [0, 1]), new(1, b, [2])]))
    assert [(t.seq_id, t.token_id) for t in first.sampled] == [(0, chain(a, 1)[0]), (1, chain(b, 1)[0])]
    # The decode step: a grows a block (positions 4..7 in block 3); b's state is extended by its delta.
    start = time.perf_counter()
    second = runner.execute(StepPlan(2, cached_requests=[CachedRequestData(0, [], 5, 1),
                                                         CachedRequestData(1, [], 2, 1)]))
    assert time.perf_counter() - start >= 0.002  # The simulated device's time was spent.
    assert [t.token_id for t in second.sampled] == [chain(a, 2)[1], chain(b, 2)[1]]
    state = runner.batch.states[0]
    assert (state.num_computed_tokens, state.token_ids) == (6, a + chain(a, 2))
    third = runner.execute(StepPlan(3, cached_requests=[CachedRequestData(1, [], 3, 1)], finished_seq_ids=[0]))
    assert 0 not in runner.batch.states and [t.token_id for t in third.sampled] == [chain(b, 3)[2]]


def test_a_multi_step_plan_samples_every_step(model_dir):
    runner = runner_for(model_dir, step_ms=1.0)
    prompt = [9, 9, 9]
    runner.execute(StepPlan(1, new_requests=[new(0, prompt, [0, 1])]))
    result = runner.execute(StepPlan(2, cached_requests=[CachedRequestData(0, [], 3, 1)], num_steps=4))
    assert result.num_steps == 4 and [t.token_id for t in result.sampled] == chain(prompt, 5)[1:]


def test_inconsistent_plans_drafts_and_swaps_are_refused(model_dir):
    runner = runner_for(model_dir)
    with pytest.raises(ValueError, match="outside"):
        runner.execute(StepPlan(1, new_requests=[new(0, [1, 2], [99])]))
    with pytest.raises(ValueError, match="drafts"):
        runner.execute(StepPlan(2, new_requests=[NewRequestData(0, [1, 2], 2, SamplingParams(), [0], 1, 2,
                                                                draft_token_ids=[5])]))
    with pytest.raises(ValueError, match="swap"):
        runner.execute(StepPlan(3, swap_out=[(0, 0)]))
    assert runner.batch.states == {}  # Nothing half-applied.


def test_the_worker_setting_selects_it(model_dir):
    runner = load_runner(WorkerConfig(model=str(model_dir), simulated_step_ms=1.5))
    assert isinstance(runner, SimulatedRunner) and runner.step_s == pytest.approx(0.0015)
    with pytest.raises(ValueError, match="positive"):
        SimulatedRunner(model_dir, RunnerConfig(), 0.0)


def test_launched_steps_keep_the_device_busy_and_the_tokens(model_dir):
    """launch(N+1) before finish(N): the device finds each next step queued when it ends
    one (its own accounting, not a wall-clock threshold), and the tokens are the serial ones."""
    prompts = {seq: [seq + 3, 9, 4, seq] for seq in range(4)}

    def plans():
        # Six blocks each (24 positions) from the start: the decodes add none.
        yield StepPlan(0, new_requests=[new(seq, p, list(range(6 * seq, 6 * seq + 6))) for seq, p in prompts.items()])
        for step in range(1, 20):
            yield StepPlan(step, cached_requests=[CachedRequestData(seq, [], 4 + step - 1, 1) for seq in prompts])

    serial = runner_for(model_dir, step_ms=5.0)
    serial_out = [[(t.seq_id, t.token_id) for t in serial.execute(plan).sampled] for plan in plans()]
    pipelined = runner_for(model_dir, step_ms=5.0)
    out, previous = [], None
    for plan in plans():
        launched = pipelined.launch(plan)
        if previous is not None:
            out.append([(t.seq_id, t.token_id) for t in pipelined.finish(previous).sampled])
        previous = launched
    out.append([(t.seq_id, t.token_id) for t in pipelined.finish(previous).sampled])
    assert out == serial_out
    assert [[tok for sid, tok in step if sid == 2] for step in out] == [[t] for t in chain(prompts[2], 20)]
    assert serial.device.steps == pipelined.device.steps == 20
    assert serial.device.idle_starts == 20  # Serial: each step waits for the host to read the last back.
    assert pipelined.device.idle_starts <= 3  # The first, and slack for a loaded machine.
