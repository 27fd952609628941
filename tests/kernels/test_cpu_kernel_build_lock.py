"""A CPU-kernel build killed midway leaves torch's `lock` file behind; the next worker
must not wait on it forever (it used to hang silently at model load). Each torch
installation builds in a directory of its own (torch's builder rebuilds for another
one's include paths: two environments sharing a directory rebuilt it in turn)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

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


def test_each_torch_installation_builds_in_its_own_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path))
    here = cpu._build_dir()
    monkeypatch.setattr(cpu.torch, "__file__", str(tmp_path / "other-venv" / "torch" / "__init__.py"))
    other = cpu._build_dir()
    assert here != other and here.parent == other.parent
    assert here.name.rsplit("-", 1)[0] == other.name.rsplit("-", 1)[0]  # the same torch, CPU and sources
