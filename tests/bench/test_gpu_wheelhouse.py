"""The GPU self-check's wheel lists (scripts/gpu-wheels.txt, scripts/gpu-build-wheels.txt)
against what our distributions need on a Python 3.12 GPU image that has
scripts/gpu-image.txt: every missing distribution is brought, nothing else is, one
version each, at our pins and at the versions this venv tests with.

Requirements are read from the installed distributions' own metadata (the same
Requires-Dist the wheels carry: same versions), markers evaluated for Python 3.12."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

from tests.script_modules import load_script

wheelhouse = load_script("wheelhouse")
canonical, problems, read_names = wheelhouse.canonical, wheelhouse.problems, wheelhouse.read_names
read_wheel_list, requirements = wheelhouse.read_wheel_list, wheelhouse.requirements

REPO = Path(__file__).resolve().parents[2]
PYPROJECTS = [REPO / "pyproject.toml", REPO / "protos/pyproject.toml", REPO / "kernels/pyproject.toml",
              *sorted((REPO / "services").glob("*/pyproject.toml")), REPO / "launcher/pyproject.toml",
              REPO / "bench/pyproject.toml"]
OURS = {"llmserve", "llmserve-api", "llmserve-kernels", "llmserve-scheduler", "llmserve-router", "llmserve-worker",
        "llmserve-launcher", "llmserve-bench"}
PY312 = {"python_version": "3.12", "python_full_version": "3.12.3"}
# In our requirements, not needed by the GPU check: it never runs them.
NOT_NEEDED_THERE = {
    "grpcio-tools",  # Regenerates the protobuf modules (python -m llmserve.protogen); they are committed.
    # CPU-only checks of files, never run by the GPU check: buf lint and buf curl (protos/,
    # examples/), the Helm chart's rendering and its Kubernetes schema validation.
    "buf-bin",
    "helm-python-sdk",
    "kubernetes-validate",
    # The documentation site's build (tests/test_docs.py, `mkdocs build --strict`), a CPU check.
    "mkdocs",
    "mkdocs-material",
}

BROUGHT = read_wheel_list(REPO / "scripts/gpu-wheels.txt")
BUILD = read_wheel_list(REPO / "scripts/gpu-build-wheels.txt")
IMAGE = {canonical(n) for n in read_names(REPO / "scripts/gpu-image.txt")}


def reached() -> set[str]:
    """Distributions ours need (llmserve with its test extra, and every other of ours), walking
    Requires-Dist for Python 3.12; the walk stops at what the image has (its own
    requirements are its business) unless we bring our own copy of it."""
    seen: set[str] = set()
    todo = [("llmserve", frozenset({"test"}))] + [(name, frozenset()) for name in OURS]
    while todo:
        name, extras = todo.pop()
        name = canonical(name)
        if name in NOT_NEEDED_THERE or (name, extras) in seen:
            continue
        seen.add((name, extras))
        if name in IMAGE and name not in BROUGHT:
            continue
        todo += [(req.name, frozenset(req.extras)) for req in requirements(name, extras, PY312)]
    return {name for name, _ in seen}


def our_pins() -> dict[str, str]:
    """name -> version of every `name==version` in our pyprojects (dependencies and extras)."""
    pins = {}
    for path in PYPROJECTS:
        project = tomllib.loads(path.read_text())["project"]
        lines = project.get("dependencies", []) + sum(project.get("optional-dependencies", {}).values(), [])
        for req in map(Requirement, lines):
            spec = next(iter(req.specifier), None)
            if spec is not None and spec.operator == "==":
                pins[canonical(req.name)] = spec.version
    return pins


def test_every_distribution_the_image_lacks_is_brought_and_nothing_else():
    needed = reached()
    assert {"grpcio", "protobuf", "opentelemetry-sdk", "cryptography", "torch"} <= needed  # The walk was real.
    missing = needed - IMAGE - OURS
    assert missing - set(BROUGHT) == set(), "needed there, not in scripts/gpu-wheels.txt"
    assert set(BROUGHT) - needed == set(), "in scripts/gpu-wheels.txt, needed by nothing"
    # Where the image's version is unknown and ours must be exact, we bring it anyway.
    assert {"grpcio", "protobuf"} <= set(BROUGHT)


def test_brought_versions_are_our_pins_and_what_this_venv_tests():
    pins = our_pins()
    assert pins["protobuf"] == "7.36.2" and pins["grpcio"] == "1.85.1"
    for name, version in {**BROUGHT, **BUILD}.items():
        assert Version(metadata.version(name)) == Version(version), name
        if name in pins:
            assert Version(pins[name]) == Version(version), name


def test_brought_wheels_satisfy_each_other():
    """Each brought wheel's requirement on another brought one accepts the version brought;
    its other requirements are brought or in the image."""
    for name in BROUGHT:
        for req in requirements(name, env=PY312):
            dep = canonical(req.name)
            if dep in BROUGHT:
                assert req.specifier.contains(BROUGHT[dep], prereleases=True), f"{name} requires {req}"
            else:
                assert dep in IMAGE, f"{name} requires {req}: neither brought nor in the image"


def test_the_build_backend_builds_our_projects_without_wheel():
    """Our [build-system] requires setuptools and wheel; the setuptools brought satisfies
    it and builds wheels itself (70.1+), so the image's `wheel` need not be new."""
    assert set(BUILD) == {"setuptools"} and not set(BUILD) & set(BROUGHT)
    assert Version(BUILD["setuptools"]) >= Version("70.1")
    for path in PYPROJECTS:
        for req in map(Requirement, tomllib.loads(path.read_text())["build-system"]["requires"]):
            name = canonical(req.name)
            if name in BUILD:
                assert req.specifier.contains(BUILD[name]), f"{path}: {req}"
            else:
                assert name in IMAGE, f"{path}: {req}"


def test_verify_finds_a_wrong_version_and_passes_the_right_ones():
    assert problems(BROUGHT) == []  # This venv has exactly the brought versions.
    found = problems({"grpcio": "1.0.0", "protobuf": BROUGHT["protobuf"]})
    assert len(found) == 1 and found[0].startswith("grpcio: want 1.0.0")


def _fake_wheel(folder: Path, name: str, version: str, requires: list[str]) -> None:
    import zipfile

    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{name}-{version}.dist-info/METADATA", "Metadata-Version: 2.1\n"
                     f"Name: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires))


def test_check_wheels_reads_each_wheel_s_own_requirements_for_the_target_python(tmp_path):
    wheel_problems = wheelhouse.wheel_problems

    _fake_wheel(tmp_path, "alpha", "1.0", ["beta>=2", "numpy", "gamma", 'delta; python_version < "3.11"',
                                           "epsilon[extra1]", 'theta[extra2]; extra == "fancy"'])
    _fake_wheel(tmp_path, "beta", "1.5", [])
    _fake_wheel(tmp_path, "epsilon", "1.0", ['zeta; extra == "extra1"', 'eta; extra == "other"'])
    # Nobody wants alpha[fancy], so theta's extra2 is not wanted either (fastapi's
    # `uvicorn[standard]; extra == "standard"` is this case).
    _fake_wheel(tmp_path, "theta", "1.0", ['iota; extra == "extra2"'])
    assert wheel_problems(tmp_path, "3.12", {"numpy"}) == [
        "alpha 1.0 requires beta>=2: the wheelhouse has 1.5",
        "alpha 1.0 requires gamma: neither in the wheelhouse nor in the image",
        # Asked for by alpha's epsilon[extra1]; eta (another extra) and delta (Python < 3.11) are not.
        'epsilon 1.0 requires zeta; extra == "extra1": neither in the wheelhouse nor in the image',
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_gpu_check_without_cuda_fails_fast_with_one_line(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    env.pop("LLMSERVE_GPU_CHECK_DEVICE", None)
    r = subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh"), "--python", sys.executable],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2
    assert r.stderr.startswith("no CUDA device: torch ") and r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "steps.tsv").exists()  # Nothing was installed or run.
