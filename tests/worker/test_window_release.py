"""A model whose every layer has a sliding window (Mistral-style), end to end in the
in-process engine: the scheduler releases the blocks a sequence's window has left
behind, so a sequence longer than the whole KV cache runs, holds a bounded number of
blocks at every step (the block audit), and still gives transformers' greedy tokens."""

from __future__ import annotations

import random

import pytest
import torch

from llmserve.contract.sampling import SamplingParams
from llmserve.launcher.engine import InProcessEngine
from llmserve.scheduler.block_pool import RELEASED
from tests.tiny_models import TINY_WINDOW, make_tiny_window_model

BLOCK = 4
NUM_BLOCKS = 12  # 48 tokens of KV: less than one sequence below
CHUNK = 8  # prefill tokens per step
PROMPT_LEN = 3 * TINY_WINDOW + 5
GEN = 32


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    return make_tiny_window_model(tmp_path_factory.mktemp("mistral-window"), "mistral")


def test_a_sequence_longer_than_the_cache_runs_in_its_window(mistral_dir):
    from transformers import AutoModelForCausalLM

    rng = random.Random(3)
    prompt = [rng.randrange(3, 300) for _ in range(PROMPT_LEN)]
    assert PROMPT_LEN + GEN > NUM_BLOCKS * BLOCK
    engine = InProcessEngine.from_model_dir(mistral_dir, dtype="float32", block_size=BLOCK, num_kv_blocks=NUM_BLOCKS,
                                            max_num_batched_tokens=CHUNK, enable_chunked_prefill=True,
                                            enable_prefix_caching=True)
    assert engine.runner.info.sliding_window == TINY_WINDOW
    engine.add_request("long", prompt, SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True))
    tokens, most_held, released = [], 0, 0
    # A step's queries (at most CHUNK from the computed count on) read keys from W - 1
    # before the first; the table reaches to the last: the blocks of that span, +1 for alignment.
    bound = -(-(TINY_WINDOW - 1 + CHUNK) // BLOCK) + 1
    while engine.scheduler.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
        audit = engine.scheduler.audit()
        assert audit.ok, audit.problems
        held = sum(1 for holders in audit.gpu_owners.values() for h in holders if h.request_id == "long")
        most_held = max(most_held, held)
        assert held <= bound, (held, bound)
        sample = engine.scheduler.get_request("long")
        if sample is not None:
            released = max(released, sum(b == RELEASED for b in sample.samples[0].block_table))
    assert released > NUM_BLOCKS // 2  # the early blocks did go back
    assert engine.scheduler.kv.num_free_blocks == NUM_BLOCKS  # and every block at the end

    hf = AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=GEN, min_new_tokens=GEN, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, PROMPT_LEN:].tolist()
    assert tokens == want
