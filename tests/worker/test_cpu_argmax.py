"""The C++ argmax of greedy sampling against torch: each row's first largest value."""

from __future__ import annotations

import pytest
import torch

from llmserve.kernels import cpu as cpu_kernels
from llmserve.worker.sampler import greedy_ids

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ compiler for the CPU kernels")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bfloat16: many more ties
@pytest.mark.parametrize("V", [1, 15, 16, 63, 64, 65, 1000, 49152, 49157])
def test_argmax_rows_matches_torch_including_ties(V, dtype):
    gen = torch.Generator().manual_seed(V)
    x = torch.randn(9, V, generator=gen).to(dtype)
    # Ties for the max at several places: across lanes, vector chains and the scalar tail.
    for row, places in ((1, [0, V - 1]), (2, [V // 2, V // 3, V - 1]), (3, [V - 1, V - 2]),
                        (4, list(range(0, V, 17))), (5, [min(V - 1, 64), min(V - 1, 80)])):
        x[row, places] = 50.0
    x[6] = -3.0  # all equal: index 0
    x[7, -1] = 60.0  # the max in the last element
    want = torch.tensor([int(torch.nonzero(r == r.max())[0]) for r in x])
    assert torch.equal(cpu_kernels.argmax_rows(x), want)
    assert torch.equal(x.max(dim=-1).indices, want)  # (the reference's own rule, on this torch)


def test_argmax_rows_reads_strided_rows_and_the_sampler_uses_it():
    x = torch.randn(4, 3000)[:, 100:2100]  # rows 2,000 long at a stride of 3,000
    assert torch.equal(cpu_kernels.argmax_rows(x), x.max(dim=-1).indices)
    assert torch.equal(greedy_ids(x), x.max(dim=-1).indices)
    assert torch.equal(greedy_ids(x.bfloat16()), x.bfloat16().float().max(dim=-1).indices)
    assert torch.equal(greedy_ids(x.double()), x.double().max(dim=-1).indices)  # (not the kernel's dtype)
    with pytest.raises(RuntimeError, match="argmax_rows"):
        cpu_kernels.argmax_rows(x.half())
