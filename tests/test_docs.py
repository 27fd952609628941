"""The documentation site builds with `mkdocs build --strict` (broken links and anchors
fail it), its generated reference pages hold the real settings and API, and the README
stays short."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmserve.settings import options

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 300


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr[-5000:]
    return out


def page(site: Path, name: str) -> str:
    return (site / name / "index.html").read_text()


def test_the_site_builds_strict(site):
    for name in ("quickstart", "guide/security", "guide/openai", "guide/grpc", "guide/data-parallel",
                 "guide/kubernetes", "guide/gpu", "guide/cpu", "guide/operations", "benchmarks",
                 "benchmarks-history"):
        assert (site / name / "index.html").is_file(), name


def test_the_settings_reference_is_generated(site):
    html = page(site, "reference/settings")
    assert "--kv-cache-memory" in html and "LLMSERVE_KV_CACHE_MEMORY" in html
    assert "--routing-policy" in html and "cache-aware" in html
    # Every setting of every registered command, with its environment variable.
    commands = [point.load() for point in importlib.metadata.entry_points(group="llmserve.commands")]
    for command in commands:
        if command.config is None:
            continue
        assert f"llmserve-{command.name}" in html, command.name
        for opt in options(command.config):
            assert f"--{opt.name}" in html and opt.env in html, (command.name, opt.name)


def test_the_supported_models_page_is_generated(site):
    from llmserve.worker.models.catalog import FAMILIES

    html = page(site, "reference/models")
    for family in FAMILIES:
        for architecture in family.architectures:
            assert architecture in html, architecture
        assert family.examples[0] in html


def test_the_api_reference_is_generated(site):
    html = page(site, "reference/api")
    for name in ("llmserve.v1.Generation", "Generate", "GenerateRequest", "SamplingParams", "max_tokens",
                 "FINISH_REASON_STOP", "llmserve.internal.v1.Scheduler", "SubscribeKvEvents"):
        assert name in html, name
    # A field's leading comment from generation.proto.
    assert "Most tokens to generate." in html


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
