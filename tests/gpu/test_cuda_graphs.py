"""Decode steps through CUDA graphs give the eager forward's tokens and logits: two runners
over one tiny model, one with --enforce-eager, driven by the same plans. Decode batches of
1, 3, 5, 8 and 13 rows replay the graphs of 1, 4, 8, 8 and 16 (padding rows beside real
ones), multi-step plans replay once per step, and steps with a prefill row or more rows
than the largest graph run eagerly in both runners.

float32, where both paths must agree token for token; the graphs in bfloat16 and float16
are covered by test_hf_equivalence.py (its engine decodes through them).
"""

from __future__ import annotations

import random

import torch

from llmserve.worker.config import RunnerConfig
from llmserve.worker.model_runner import ModelRunner
from tests.kernels.helpers import rel_err
from tests.worker.conftest import PlanDriver

from .conftest import DEVICE, GPU, ON_CUDA

pytestmark = GPU

BLOCK = 16
NUM_BLOCKS = 96
MAX_NUM_SEQS = 16  # graphs of 1, 2, 4, 8, 16 rows
BATCHES = (1, 3, 5, 8, 13)
_rng = random.Random(7)
PROMPTS = {f"r{i}": [_rng.randrange(3, 300) for _ in range(_rng.randrange(1, 40))] for i in range(18)}
NAMES = list(PROMPTS)


def _runner(model_dir, enforce_eager: bool) -> ModelRunner:
    return ModelRunner(model_dir, RunnerConfig(
        device=DEVICE.type, dtype="float32", block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, max_model_len=256,
        swap_space=0, max_num_seqs=MAX_NUM_SEQS, enforce_eager=enforce_eager))


def _record(runner: ModelRunner) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """Spies: the logits of every step, and (graph size, real rows) of every replay."""
    logits, replays = [], []
    compute_logits = runner.model.compute_logits

    def logits_spy(hidden):
        out = compute_logits(hidden)
        logits.append(out.float().cpu())
        return out

    runner.model.compute_logits = logits_spy
    if runner.graphs is not None:
        replay = runner.graphs.replay

        def replay_spy(size, input_ids, positions, meta):
            replays.append((size, input_ids.shape[0]))
            return replay(size, input_ids, positions, meta)

        runner.graphs.replay = replay_spy
    return logits, replays


def _drive(runner: ModelRunner) -> dict[str, list[int]]:
    d = PlanDriver(runner, BLOCK, NUM_BLOCKS, seed=5)
    for rid, prompt in PROMPTS.items():
        d.add(rid, prompt)
    d.step({rid: None for rid in NAMES[:13]})  # 13 prompts: eager
    for batch in BATCHES:  # decodes: padded to 1, 4, 8, 8, 16
        d.step({rid: 1 for rid in NAMES[:batch]})
    d.step({**{rid: 1 for rid in NAMES[:5]}, NAMES[13]: None})  # decodes beside a prompt: eager
    assert d.step({rid: 1 for rid in NAMES[:14]}, num_steps=4).num_steps == 4  # 4 replays of 16
    assert d.step({rid: 1 for rid in NAMES[:3]}, num_steps=3).num_steps == 3  # 3 replays of 4
    d.step({rid: None for rid in NAMES[14:]})  # 4 prompts: eager
    d.step({rid: 1 for rid in NAMES})  # 18 decodes > 16: eager
    d.step({rid: 1 for rid in NAMES[:2]})  # back to a graph (2)
    return {rid: d.outputs(rid) for rid in NAMES}


def test_graph_replays_equal_eager_steps(tiny_llama_dir):
    eager = _runner(tiny_llama_dir, enforce_eager=True)
    assert eager.graphs is None
    eager_logits, _ = _record(eager)
    want = _drive(eager)
    del eager

    graphed = _runner(tiny_llama_dir, enforce_eager=False)
    if ON_CUDA:
        assert graphed.graphs is not None and graphed.graphs.sizes == [1, 2, 4, 8, 16]
        assert set(graphed.graphs.graphs) == {1, 2, 4, 8, 16}
    got_logits, replays = _record(graphed)
    got = _drive(graphed)

    assert got == want
    assert sum(len(v) for v in want.values()) == 13 + sum(BATCHES) + 6 + 14 * 4 + 3 * 3 + 4 + 18 + 2
    assert len(got_logits) == len(eager_logits)
    for step, (g, e) in enumerate(zip(got_logits, eager_logits)):
        assert g.shape == e.shape and rel_err(g, e) <= 1e-5, step
    if ON_CUDA:  # the graph path was taken, padded, and only where it applies
        assert replays == [(1, 1), (4, 3), (8, 5), (8, 8), (16, 13)] + [(16, 14)] * 4 + [(4, 3)] * 3 + [(2, 2)]
