"""The CPU kernels' loops take their items a piece at a time off a shared counter
(csrc/shared_pieces.h), so which thread computes an item depends on timing: an item's
result must not. Each kernel's output, on 1, 2 and 3 threads and with a second thread
slowed by work of its own, equals its one-thread output bit for bit (the products and
prefill attention split nothing but items; decode attention at a batch where its key
chunks do not depend on the thread count)."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from llmserve.kernels import cpu as cpu_kernels
from tests.kernels.helpers import make_case

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels not built on this host")
THREADS = [2, 3]


@contextlib.contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def busy_neighbour():
    """A Python thread spinning beside the kernel's threads, so that some of them run slower
    than others and take fewer pieces."""
    stop = threading.Event()
    spinner = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)], daemon=True)
    spinner.start()
    try:
        yield
    finally:
        stop.set()
        spinner.join()


def same_on_every_thread_count(run) -> None:
    with torch_threads(1):
        want = run()
    for n in THREADS:
        with torch_threads(n):
            assert torch.equal(run(), want), f"{n} threads"
            with busy_neighbour():
                assert torch.equal(run(), want), f"{n} threads beside a busy one"


@pytest.mark.skipif(not cpu_kernels.bf16_tiles_supported(), reason="bfloat16 tiles need AVX-512 BF16")
@pytest.mark.parametrize("engine", ["avx512", "amx"])
@pytest.mark.parametrize("rows", [1, 16, 40])
def test_bfloat16_products(engine, rows):
    if engine == "amx" and not cpu_kernels.amx_supported():
        pytest.skip("AMX absent on this CPU")
    gen = torch.Generator().manual_seed(rows)
    # 2,000 output channels: 125 blocks, 63 pairs, 42 tiles of 3 blocks: several pieces
    # per thread, and a last pair and tile that are partial.
    w = torch.randn(2000, 576, generator=gen).bfloat16()
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    packed = cpu_kernels.bf16_pack_weight(w)
    same_on_every_thread_count(lambda: cpu_kernels.bf16_linear(x, packed, engine))


@pytest.mark.skipif(not cpu_kernels.f32_tiles_supported(), reason="float32 tiles need AVX-512 F")
@pytest.mark.parametrize("rows", [1, 40])
def test_float32_products(rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(2000, 576, generator=gen)  # 42 tiles of 3 blocks, the last partial
    x = torch.randn(rows, 576, generator=gen)
    packed = cpu_kernels.f32_pack_weight(w)
    same_on_every_thread_count(lambda: cpu_kernels.f32_linear(x, packed))


@pytest.mark.skipif(not cpu_kernels.w8a8_supported(), reason="W8A8 int8 needs AVX-512 VNNI")
@pytest.mark.parametrize("engine", ["vnni", "amx"])
@pytest.mark.parametrize("rows", [1, 40])
def test_w8a8_products(engine, rows):
    if engine == "amx" and not cpu_kernels.amx_supported():
        pytest.skip("AMX absent on this CPU")
    from llmserve.worker.layers.int8_weight import quantize_rows

    gen = torch.Generator().manual_seed(rows)
    q, scale = quantize_rows(torch.randn(2000, 576, generator=gen))
    packed = cpu_kernels.w8a8_pack_weight(q)
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    same_on_every_thread_count(lambda: cpu_kernels.w8a8_linear(x, packed, scale, engine))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention(dtype):
    # 12 sequences of unequal lengths: at 1-3 threads every item is one whole sequence
    # (no key chunks), so the split is the only thing that changes.
    seq_lens = [5, 300, 17, 129, 64, 1, 250, 33, 96, 200, 16, 180]
    case = make_case(seq_lens, [1] * len(seq_lens), 3, 3, 64, 16, dtype, "cpu", seed=7)
    tables, lens = case.block_tables.long(), case.seq_lens.long()
    same_on_every_thread_count(
        lambda: cpu_kernels.paged_attention_decode(case.q, case.kv_cache, tables, lens, case.scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention(dtype):
    case = make_case([40, 300, 7, 129], [40, 100, 7, 2], 3, 3, 64, 16, dtype, "cpu", seed=8)
    tables, starts, lens = case.block_tables.long(), case.cu_seqlens_q.long(), case.seq_lens.long()
    same_on_every_thread_count(
        lambda: cpu_kernels.paged_attention_prefill(case.q, case.kv_cache, tables, starts, lens, case.scale))
