"""The base distribution installs and works without any service: a fresh venv (no system
site-packages) gets ./protos and the repository root only (no llmserve-router,
-scheduler, -worker, -kernels, -launcher or -bench), then imports every module of the
base and runs `llmserve --help`. The image's base stage (Dockerfile) installs exactly this.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow  # A venv and a pip install: about a minute with pip's cache warm.


def base_modules() -> list[str]:
    """Every module of the base distribution (the files under llmserve/ of the repository root)."""
    names = []
    for path in sorted((REPO / "llmserve").rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


# Runs in the fresh venv: imports every base module, and says which of ours it can find.
PROBE = """
import importlib, importlib.util, json, sys
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
others = ["llmserve.router", "llmserve.scheduler", "llmserve.worker", "llmserve.kernels", "llmserve.launcher",
          "llmserve.bench"]
print(json.dumps({"found": [n for n in others if importlib.util.find_spec(n) is not None],
                  "cli": importlib.util.find_spec("llmserve.cli").origin}))
"""


def _copy_sources(dest: Path) -> Path:
    """What the image's base stage copies: a build in the checkout would write build/ there."""
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("llmserve", "protos"):
        shutil.copytree(REPO / name, dest / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    return dest


def test_the_base_installs_and_runs_without_any_service(tmp_path):
    src = _copy_sources(tmp_path / "src")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python, llmserve = venv / "bin" / "python", venv / "bin" / "llmserve"
    # NOTE: no PYTHONPATH, and outside the checkout: only what the venv installed imports.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    install = subprocess.run([python, "-m", "pip", "install", "--quiet", str(src / "protos"), str(src)],
                             capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert install.returncode == 0, install.stderr[-3000:]
    modules = base_modules()
    assert {"llmserve.cli", "llmserve.client", "llmserve.certs", "llmserve.settings",
            "llmserve.contract.wire", "llmserve.telemetry.tracing"} <= set(modules)
    probe = subprocess.run([python, "-c", PROBE, json.dumps(modules)], capture_output=True, text=True, env=env,
                           cwd=tmp_path, timeout=300)
    assert probe.returncode == 0, probe.stderr[-3000:]
    result = json.loads(probe.stdout)
    assert result["found"] == [], f"installed without being asked for: {result['found']}"
    assert Path(result["cli"]).is_relative_to(venv)  # The venv's copy, not the checkout's.
    help_ = subprocess.run([llmserve, "--help"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert help_.returncode == 0, help_.stderr
    # The base's own commands, and no service's (each comes with its distribution).
    commands = help_.stdout.split("positional arguments:")[1].split()[0]
    assert commands == "{generate,health,certs}", commands
