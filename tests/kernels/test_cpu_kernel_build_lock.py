"""A CPU-kernel build killed midway leaves torch's `lock` file behind; the next worker
must not wait on it forever (it used to hang silently at model load)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from llmserve.kernels import cpu


def test_a_stale_build_lock_is_removed_not_waited_on(tmp_path):
    built = cpu._build_dir()  # This machine's build (made by earlier tests; else built below).
    cache = tmp_path / "cache"
    target = cache / built.relative_to(built.parents[1])
    shutil.copytree(built, target, ignore=shutil.ignore_patterns("lock", "*.flock"))
    (target / "lock").write_text("")  # What a SIGKILLed build leaves.
    env = {**os.environ, "LLMSERVE_CACHE": str(cache)}
    env.pop("LLMSERVE_DISABLE_CPU_KERNELS", None)
    result = subprocess.run([sys.executable, "-c", "from llmserve.kernels.cpu import load; print(load())"],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.stdout.strip() == "True", result.stderr[-2000:]
    assert "left by a CPU-kernel build that was killed" in result.stderr
    assert not (target / "lock").exists()
