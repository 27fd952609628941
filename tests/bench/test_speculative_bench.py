"""`bench speculative`'s pieces: the copying workload asks to repeat real text, and the
side-by-side comparisons report identical outputs and the speculation they saw."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmserve.bench.speculative import COPY_INSTRUCTION, compare_latency, compare_throughput, copy_workload
from llmserve.bench.workloads import random_workload
from llmserve.model_store import resolve_model_dir
from llmserve.scheduler.config import SchedulerConfig
from llmserve.worker.config import RunnerConfig
from llmserve.worker.model_runner import ModelRunner


def _contains(haystack: list[int], needle: list[int]) -> bool:
    return any(haystack[i:i + len(needle)] == needle for i in range(len(haystack) - len(needle) + 1))


def test_the_copy_workload_asks_to_repeat_a_paragraph_it_carries():
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir("default")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    requests = copy_workload(model_dir, 3)
    assert len(requests) == 3 and len({tuple(r.prompt_token_ids) for r in requests}) == 3
    for request in requests:
        text = tokenizer.decode(request.prompt_token_ids)
        paragraph = text.split(COPY_INSTRUCTION, 1)[1].split("<|im_end|>")[0]
        assert 40 <= len(tokenizer(paragraph, add_special_tokens=False)["input_ids"]) <= 120
        assert request.output_len == len(tokenizer(paragraph, add_special_tokens=False)["input_ids"]) + 16


@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    return ModelRunner(tiny_llama_dir, RunnerConfig(block_size=4, num_kv_blocks=400, max_model_len=128, swap_space=0))


def test_latency_runs_each_request_both_ways_with_identical_outputs(runner):
    # A prompt that repeats itself: the tiny random model keeps some drafts.
    requests = random_workload(3, (8, 16), (12, 12), 300, seed=1)
    requests[0] = replace(requests[0], prompt_token_ids=[11, 45, 3, 99] * 4)
    config = SchedulerConfig(speculative_ngram_min=1)
    row = compare_latency(runner, config, 3, requests, ignore_eos=True)
    assert row["num_requests"] == 3 and row["output_tokens"] == 36
    assert row["identical_outputs"] == 1.0
    assert len(row["per_request_ratio"]) == 3 and row["tpot_plain_ms"] > 0 and row["tpot_speculative_ms"] > 0
    assert row["steps_plain"] == 3 * 12  # one step per token (the prompt's step samples the first)
    assert 0 <= row["acceptance_rate"] <= 1 and row["mean_accepted_length"] >= 1


def test_throughput_pairs_rounds(runner):
    requests = random_workload(4, (8, 16), (6, 6), 300, seed=2)
    row = compare_throughput(runner, SchedulerConfig(), 2, requests, rounds=2)
    assert len(row["plain_tok_per_s"]) == len(row["speculative_tok_per_s"]) == len(row["speculative_over_plain"]) == 2
    assert row["speculative_over_plain"][0] == pytest.approx(row["speculative_tok_per_s"][0] / row["plain_tok_per_s"][0])
