"""Builds the `llmserve-api` wheel from protos/ the way a release would, from a copy (pip
leaves build/ and *.egg-info in the directory it builds)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from llmserve.protogen import PROTO_ROOT


def build_api_wheel(tmp_path: Path) -> Path:
    source = tmp_path / "protos-src"
    shutil.copytree(PROTO_ROOT, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "node_modules",
                                                                       "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path / "dist"), str(source)], check=True)
    (wheel,) = (tmp_path / "dist").glob("llmserve_api-*.whl")
    return wheel
