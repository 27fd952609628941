"""The sampler on the device never waits for it: logprobs, penalties (an id in flight
among them), seeds, top-k/top-p and logit_bias rows sample under CUDA's sync debug mode
set to "error" (a device-to-host read or a stream sync raises), and what it returns is
what the same greedy rows give on the host. On the CPU (LLMSERVE_TEST_GPU_DEVICE=cpu) the mode
is a no-op: the comparison still runs."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from llmserve.contract.sampling import SamplingParams as P
from llmserve.worker.sampler import InFlightIds, Sampler, SamplingRows

from .conftest import DEVICE, GPU, ON_CUDA

pytestmark = GPU

PARAMS = [
    P(temperature=0.0, logprobs=3),
    P(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25),
    P(temperature=0.9, top_k=20, top_p=0.9, seed=7, logprobs=0),
    P(temperature=0.7, min_p=0.05),
    # (11, 3): 3 is banned where the id in flight is 11 (it is), despite its +50.
    P(temperature=0.0, logit_bias=((3, 50.0),), frequency_penalty=1.0, bad_words_token_ids=((11, 3),)),
]
HISTORIES = [[1, 2], [4, 4, 9, 7, -1], [5, 6], [8], [0, 3, 3, -1]]  # -1: a placeholder of the step in flight
PROMPT_LENS = [1, 2, 1, 1, 1]


@contextlib.contextmanager
def no_host_sync():
    if not ON_CUDA:
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _rows(in_flight_ids: torch.Tensor) -> SamplingRows:
    rows = SamplingRows.from_params(PARAMS, [len(h) - n for h, n in zip(HISTORIES, PROMPT_LENS)], HISTORIES,
                                    PROMPT_LENS)
    holes = {1: (4, 2), 4: (3, 0)}  # row -> (its placeholder's position, its index in the ids in flight)
    return replace(rows, in_flight=InFlightIds(in_flight_ids, holes))


def test_sampling_on_the_device_reads_nothing_back_and_matches_the_host():
    logits = torch.randn(len(PARAMS), 64, generator=torch.Generator().manual_seed(0)) * 3
    in_flight = torch.tensor([11, 12, 9])  # row 4's id in flight is 11, row 1's is 9
    want = Sampler(seed=1)(logits.clone(), _rows(in_flight))
    device_logits, device_ids = logits.to(DEVICE), in_flight.to(DEVICE)
    sampler = Sampler(seed=1, device=DEVICE)
    with no_host_sync():
        out = sampler(device_logits.clone(), _rows(device_ids))
    # The greedy rows (0, 1, 4) take the same tokens on either device (a seeded row's draw
    # comes from the device's own generator: another stream of numbers on CUDA).
    got, expected = out.token_ids.cpu().tolist(), want.token_ids.tolist()
    assert [got[i] for i in (0, 1, 4)] == [expected[i] for i in (0, 1, 4)]
    assert got[4] != 3 and expected[4] != 3
    assert all(0 <= t < 64 for t in got)
    lps, want_lps = out.logprobs, want.logprobs
    assert [lp is None for lp in lps] == [False, True, False, True, True]
    assert lps[0].top_token_ids == want_lps[0].top_token_ids and abs(lps[0].logprob - want_lps[0].logprob) < 1e-4
