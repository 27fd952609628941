"""The tree shows the architecture: a file's path tells its import name, and its layer
tells what it may import.

Each distribution root (the repository root, kernels/, services/<name>/, launcher/,
bench/) holds one portion of the `llmserve` namespace package, so
`services/router/llmserve/router/x.py` is `llmserve.router.x`, and nothing maps a folder
onto another name.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DISTRIBUTION_ROOTS = [REPO, REPO / "kernels", *(REPO / "services" / s for s in ("router", "scheduler", "worker")),
                      REPO / "launcher", REPO / "bench"]

# Layers, bottom first, by module prefix. A module belongs to the longest prefix it has.
LAYERS = {
    # The shared bottom: wire contract (plans, outputs, sampling, protobuf conversion,
    # generated modules, server helpers), settings machinery, model-directory lookup.
    "contract": ("llmserve.contract", "llmserve.v1", "llmserve.internal", "llmserve.settings",
                 "llmserve.model_store", "llmserve.gguf_checkpoint"),
    "telemetry": ("llmserve.telemetry",),
    "kernels": ("llmserve.kernels",),
    "router": ("llmserve.router",),
    "scheduler": ("llmserve.scheduler",),
    "worker": ("llmserve.worker",),
    # What a client needs: the Python client and the cluster's credentials (`llmserve certs`).
    "client": ("llmserve.client", "llmserve.certs"),
    # The `llmserve` command finds every other command through entry points, never by import.
    "cli": ("llmserve.cli", "llmserve.protogen"),
    "launcher": ("llmserve.launcher",),  # launcher/: the local cluster, `llmserve up`, the in-process engine
    "bench": ("llmserve.bench",),  # bench/: `llmserve bench`
}
_BASE = {"contract", "telemetry"}
_SERVICES = {"router", "scheduler", "worker", "kernels"}
MAY_IMPORT = {
    "contract": {"contract"},
    "telemetry": {"contract"},
    "kernels": set(),  # Plain torch / triton / C++: no llmserve layer at all.
    "router": _BASE,
    "scheduler": _BASE,
    "worker": _BASE | {"kernels"},
    "client": _BASE,
    "cli": _BASE | {"client"},
    "launcher": _BASE | _SERVICES | {"client"},
    "bench": _BASE | _SERVICES | {"client", "launcher"},
}
# The base distribution (the repository root's pyproject.toml) installs without any
# service: its modules may import only these layers (tests/test_base_install.py proves
# it in a fresh venv).
BASE_DISTRIBUTION_LAYERS = {"contract", "telemetry", "client", "cli"}


def product_files() -> dict[str, Path]:
    """Module name -> file, for every Python file of every distribution."""
    modules = {}
    for root in DISTRIBUTION_ROOTS:
        for path in sorted((root / "llmserve").rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            assert name not in modules, f"{name} is defined twice: {modules[name]} and {path}"
            modules[name] = path
    return modules


def layer_of(module: str) -> str:
    best = max(((prefix, layer) for layer, prefixes in LAYERS.items() for prefix in prefixes
                if module == prefix or module.startswith(prefix + ".")), key=lambda m: len(m[0]), default=None)
    if best is None:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS in {__file__}")
    return best[1]


def imported_modules(path: Path, module: str) -> set[str]:
    """Every llmserve module the file imports, at the top or inside a function."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("llmserve.")}


def test_no_distribution_claims_the_namespace_root():
    for root in DISTRIBUTION_ROOTS:
        assert not (root / "llmserve" / "__init__.py").exists(), f"{root}/llmserve must stay a namespace portion"


def test_every_module_imports_from_its_own_file():
    """The installed import name resolves to the file whose path spells it."""
    for name, path in product_files().items():
        if "_pb2" in name:
            continue
        spec = importlib.util.find_spec(name)
        assert spec is not None and Path(spec.origin).resolve() == path.resolve(), (name, spec and spec.origin)


def test_no_upward_or_sideways_imports():
    modules = product_files()
    bad = set()
    for name, path in modules.items():
        own = layer_of(name)
        for target in imported_modules(path, name):
            if target not in modules and target.rpartition(".")[0] in modules:
                target = target.rpartition(".")[0]  # `from package import name` of a non-module
            other = layer_of(target)
            if other != own and other not in MAY_IMPORT[own]:
                bad.add(f"{name} ({own}) imports {target} ({other})")
    assert not bad, "imports that cross the layers the wrong way:\n" + "\n".join(sorted(bad))


def base_violations(paths: dict[str, Path]) -> set[str]:
    """Imports of the base distribution's modules that leave the base layers."""
    bad = set()
    for name, path in paths.items():
        for target in imported_modules(path, name):
            if layer_of(target) not in BASE_DISTRIBUTION_LAYERS:
                bad.add(f"{name} imports {target}")
    return bad


def test_the_base_distribution_imports_no_service_launcher_or_bench():
    base = {name: path for name, path in product_files().items() if path.is_relative_to(REPO / "llmserve")}
    assert "llmserve.cli" in base and "llmserve.settings" in base  # The walk found the base.
    assert not any(layer_of(name) not in BASE_DISTRIBUTION_LAYERS for name in base), sorted(base)
    assert not base_violations(base), "\n".join(sorted(base_violations(base)))


def test_the_base_check_finds_a_lazy_import(tmp_path):
    """An import inside a function counts: the base would fail where that function runs."""
    path = tmp_path / "cli.py"
    path.write_text("def up():\n    from llmserve.launcher.cluster import LocalCluster\n    return LocalCluster\n")
    # Both what `from X import Y` may name: module X, and Y if it were a module.
    assert base_violations({"llmserve.cli": path}) == {"llmserve.cli imports llmserve.launcher.cluster",
                                                       "llmserve.cli imports llmserve.launcher.cluster.LocalCluster"}


@pytest.mark.parametrize("module,target,ok", [
    ("llmserve.scheduler.service", "llmserve.worker.model_runner", False),
    ("llmserve.router.service", "llmserve.scheduler.scheduler", False),
    ("llmserve.launcher.cluster", "llmserve.bench.serve", False),
    ("llmserve.contract.wire", "llmserve.telemetry", False),
    ("llmserve.cli", "llmserve.launcher.up", False),
    ("llmserve.cli", "llmserve.worker.config", False),
    ("llmserve.client", "llmserve.router.service", False),
    ("llmserve.certs", "llmserve.launcher.cluster", False),
    ("llmserve.worker.layers.norm", "llmserve.kernels.cpu", True),
    ("llmserve.bench.serve", "llmserve.launcher.cluster", True),
    ("llmserve.launcher.up", "llmserve.router.config", True),
    ("llmserve.launcher.cluster", "llmserve.certs", True),
    ("llmserve.cli", "llmserve.client", True),
])
def test_the_layer_rules_themselves(module, target, ok):
    """The check is not vacuous: known-bad edges are refused, known-good ones allowed."""
    assert (layer_of(target) in MAY_IMPORT[layer_of(module)] | {layer_of(module)}) is ok
