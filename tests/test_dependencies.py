"""Each distribution installs only what it needs: the resolved dependency closure of each
(the base, every service, the launcher, the benchmarks), read from the installed
packages' own metadata (the same Requires-Dist that pip resolves for a fresh venv with
only that distribution)."""

from __future__ import annotations

import re
from importlib import metadata

import pytest
from packaging.requirements import Requirement

HEAVY = {"torch", "triton", "matplotlib"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(distribution: str) -> set[str]:
    """Every distribution `pip install <distribution>` brings, itself included (no extras)."""
    seen: set[str] = set()
    todo = [distribution]
    while todo:
        name = canonical(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        for line in metadata.requires(name) or ():
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return seen


@pytest.mark.parametrize("distribution,forbidden", [
    ("llmserve", HEAVY | {"transformers", "tokenizers"}),
    ("llmserve-scheduler", HEAVY | {"transformers", "tokenizers", "jinja2"}),
    ("llmserve-router", HEAVY),
])
def test_light_services_pull_no_torch(distribution, forbidden):
    found = closure(distribution)
    assert not found & forbidden, f"{distribution} pulls {sorted(found & forbidden)}"
    assert "grpcio" in found  # The walk really followed the requirements.


def test_router_has_its_tokenizer_stack():
    assert {"tokenizers", "transformers", "jinja2"} <= closure("llmserve-router")


def test_worker_pulls_the_model_stack():
    assert {"torch", "triton", "safetensors", "llmserve-kernels", "llmserve"} <= closure("llmserve-worker")
    assert "matplotlib" not in closure("llmserve-worker")


def test_the_base_pulls_no_service_launcher_or_bench():
    ours = {name for name in closure("llmserve") if name.startswith("llmserve")}
    assert ours == {"llmserve", "llmserve-api"}


def test_launcher_runs_every_service_but_pulls_no_benchmark_tools():
    found = closure("llmserve-launcher")
    assert {"llmserve", "llmserve-router", "llmserve-scheduler", "llmserve-worker", "torch"} <= found
    assert not found & {"llmserve-bench", "matplotlib", "openai"}


def test_bench_brings_its_plots_its_openai_client_and_the_launcher():
    assert {"matplotlib", "openai", "llmserve-launcher", "llmserve-worker"} <= closure("llmserve-bench")
