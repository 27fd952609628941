from __future__ import annotations

import pytest
import torch

from llmserve.worker import kv_cache as kvc


def test_bytes_per_block_smollm2_shapes():
    # 2 (K,V) * 16 tokens * 3 kv heads * 64 dims * 30 layers * 4 bytes
    assert kvc.bytes_per_block(16, 3, 64, 30, torch.float32) == 737_280
    assert kvc.bytes_per_block(16, 3, 64, 30, torch.bfloat16) == 368_640
    assert kvc.bytes_per_block(32, 8, 128, 32, torch.bfloat16) == 4_194_304


def test_num_blocks_from_budget():
    assert kvc.num_blocks_for_budget(1 << 30, 737_280) == 1456
    assert kvc.num_blocks_for_budget(737_280, 737_280) == 1
    with pytest.raises(ValueError):
        kvc.num_blocks_for_budget(737_279, 737_280)


def test_default_budget_from_meminfo(tmp_path, monkeypatch):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   10000000 kB\n")
    assert kvc.mem_available_bytes(f) == 10_240_000_000
    monkeypatch.setattr(kvc, "mem_available_bytes", lambda: 10_240_000_000)
    assert kvc.default_kv_cache_bytes() == 1_024_000_000


def test_allocate_shapes():
    caches = kvc.allocate_kv_caches(3, 10, 16, 2, 8, torch.bfloat16)
    assert len(caches) == 3 and caches[0].shape == (2, 10, 16, 2, 8) and caches[0].dtype == torch.bfloat16
    assert caches[1].abs().sum() == 0 and caches[0].data_ptr() != caches[1].data_ptr()
