"""CPU kernels in C++ (built on first use with torch's extension builder).

On CPU, decode attention over a paged KV cache is memory-bound; gathering each
sequence's blocks into a contiguous tensor first (what plain torch must do) moves
every K/V byte three times. These kernels read the blocks in place.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from functools import lru_cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
_SOURCES = [Path(__file__).parent / "csrc" / "paged_attention_decode.cpp"]


def _build_dir() -> Path:
    # -march=native code is only valid on the CPU it was built for: key the cache on it.
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else platform.processor()
    cpu_key = hashlib.sha1(flags.split("\nflags", 1)[-1].split("\n", 1)[0].encode()).hexdigest()[:10]
    root = Path(os.environ.get("LLMSERVE_CACHE", Path.home() / ".cache" / "llmserve"))
    path = root / "torch_extensions" / f"{torch.__version__}-{cpu_key}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@lru_cache(maxsize=1)
def load() -> bool:
    """Builds (once per machine) and loads the ops; False if that is impossible here."""
    if os.environ.get("LLMSERVE_DISABLE_CPU_KERNELS") == "1":
        return False
    try:
        from torch.utils.cpp_extension import load as build

        build(name="llmserve_cpu_kernels", sources=[str(s) for s in _SOURCES], build_directory=str(_build_dir()),
              extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"], is_python_module=False,
              verbose=False)
        return True
    except Exception as err:  # No compiler, no headers: the torch path still works.
        logger.warning("CPU attention kernels unavailable (%s); using the torch gather path", err)
        return False


def paged_attention_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, D], kv_cache [2, NB, BS, KVH, D], block_tables [B, max_blocks] int64, seq_lens [B] int64."""
    return torch.ops.llmserve_cpu.paged_attention_decode(q.contiguous(), kv_cache, block_tables, seq_lens, scale)
