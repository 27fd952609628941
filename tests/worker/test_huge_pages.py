"""The CPU worker's KV cache and packed weights on transparent huge pages (huge_pages.py)."""

from pathlib import Path

import pytest
import torch

from llmserve.kernels import cpu as cpu_kernels
from llmserve.worker import huge_pages
from llmserve.worker.kv_cache import allocate_kv_caches
from llmserve.worker.layers.packed_weight import PackedWeight

MIB = 1 << 20
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_offered() -> bool:
    """Whether this kernel gives huge pages to a region that asks (THP "always" or "madvise")."""
    return THP_MODE.exists() and "[never]" not in THP_MODE.read_text() and huge_pages.enabled()


def huge_kib_at(address: int) -> int:
    """AnonHugePages (KiB) of this process's mapping that holds `address`."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_large_tensor_moves_with_its_values_onto_an_aligned_mapping():
    t = torch.randn(3 * MIB // 4)  # 3 MiB of float32
    moved = huge_pages.moved(t)
    assert moved is not t and torch.equal(moved, t)
    assert moved.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    moved.add_(1)  # writable, and its own memory
    assert torch.equal(moved, t + 1)


@pytest.mark.parametrize("case", ["small", "strided", "disabled"])
def test_what_huge_pages_do_not_suit_stays_as_it_is(case, monkeypatch):
    t = torch.randn(4 * MIB // 4)
    if case == "small":
        t = torch.randn(1024)
    elif case == "strided":
        t = t.view(1024, -1).t()
    else:
        monkeypatch.setenv(huge_pages.ENV, "0")
    assert huge_pages.moved(t) is t


@pytest.mark.skipif(not thp_offered(), reason="this kernel offers no transparent huge pages")
def test_the_moved_tensor_is_backed_by_huge_pages():
    moved = huge_pages.moved(torch.ones(8 * MIB // 4))
    assert huge_kib_at(moved.data_ptr()) >= 2048


def test_a_cpu_kv_cache_is_zero_and_on_huge_pages_where_offered():
    caches = allocate_kv_caches(2, 256, 16, 4, 64, torch.bfloat16)  # 4 MiB a layer
    for cache in caches:
        assert cache.shape == (2, 256, 16, 4, 64) and cache.dtype == torch.bfloat16
        assert not cache.any()
        assert cache.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    caches[0].fill_(1)  # pages come in as they are written
    assert bool(caches[0].eq(1).all()) and not caches[1].any()
    if thp_offered():
        assert huge_kib_at(caches[0].data_ptr()) >= 2048
    small = allocate_kv_caches(1, 4, 16, 4, 64, torch.bfloat16)[0]  # 64 KiB: plain pages
    assert not small.any()


@pytest.mark.skipif(not THP_MODE.exists() or "[madvise]" not in THP_MODE.read_text(),
                    reason="only where huge pages come to regions that ask for them alone")
def test_the_swap_pool_keeps_plain_pages():
    pool = allocate_kv_caches(1, 256, 16, 4, 64, torch.bfloat16, zeroed=False)[0]
    pool.fill_(1)  # (every page touched: a swap pool is only ever partly)
    assert huge_kib_at(pool.data_ptr()) == 0


@pytest.mark.skipif(not cpu_kernels.bf16_tiles_supported(), reason="no AVX-512 BF16: no tiles layout")
def test_a_packed_weight_multiplies_the_same_from_huge_pages(monkeypatch):
    w = torch.randn(2048, 1024).bfloat16()  # 4 MiB packed
    x = torch.randn(5, 1024).bfloat16()
    packed = PackedWeight.packed_as("tiles", w)
    assert packed.packed.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    monkeypatch.setenv(huge_pages.ENV, "0")
    plain = PackedWeight.packed_as("tiles", w)
    assert torch.equal(packed.packed, plain.packed)
    assert torch.equal(packed.matmul(x), plain.matmul(x))
