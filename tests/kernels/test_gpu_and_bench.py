"""The bench entry point everywhere; bf16 and the bench's timed cases on a GPU only."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from llmserve.kernels.triton.paged_attention import paged_attention_varlen, paged_attention_varlen_reference
from tests.kernels.helpers import TOL, make_case, rel_err

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_bench_without_cuda_exits_zero():
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "llmserve.bench.kernels"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0 and "no CUDA device" in r.stdout


@pytest.mark.gpu
@needs_cuda
def test_varlen_bf16_on_gpu():
    case = make_case([9, 37, 70, 45], [1, 37, 23, 6], 2, 3, 128, 16, torch.bfloat16, "cuda")
    out = paged_attention_varlen(case.q, case.kv_cache, case.block_tables, case.seq_lens, case.cu_seqlens_q,
                                 37, case.scale)
    ref = paged_attention_varlen_reference(case.q.cpu(), case.kv_cache.cpu(), case.block_tables.cpu(),
                                           case.seq_lens.cpu(), case.cu_seqlens_q.cpu(), case.scale)
    assert rel_err(out.cpu(), ref) <= TOL[torch.bfloat16]


@pytest.mark.gpu
@needs_cuda
def test_bench_runs_on_gpu():
    from llmserve.bench import kernels as bench

    assert bench.main() == 0
