"""The wheel list a GPU machine without a registry gets (scripts/gpu-wheels.txt), and the
check that what its interpreter imports is what the list says.

    python -m llmserve.bench.wheelhouse verify scripts/gpu-wheels.txt

verify: every listed distribution is the first one on sys.path at its listed version,
and every requirement of each (its markers evaluated for this interpreter) is installed
at a version that satisfies it. Exits 1, naming each problem, otherwise.
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

# Modules whose own version must agree with their distribution's: a stale copy elsewhere
# on sys.path (a regular `google` package, say) would shadow ours with no error.
MODULE_VERSIONS = {"grpcio": ("grpc", "__version__"), "protobuf": ("google.protobuf", "__version__")}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_names(path: str | Path) -> list[str]:
    """Non-comment lines of a list file, up to any `#`, stripped."""
    lines = (line.split("#", 1)[0].strip() for line in Path(path).read_text().splitlines())
    return [line for line in lines if line]


def read_wheel_list(path: str | Path) -> dict[str, str]:
    """{canonical name: version} of `name==version` lines."""
    pins = {}
    for line in read_names(path):
        name, sep, version = line.partition("==")
        if not sep or not version.strip():
            raise ValueError(f"{path}: {line!r} is not name==version")
        pins[canonical(name.strip())] = version.strip()
    return pins


def requirements(name: str, extras: frozenset[str] = frozenset(), env: dict | None = None) -> list[Requirement]:
    """The installed distribution's Requires-Dist that apply: markers evaluated in `env`
    (default: this interpreter) with no extra, or with one of `extras`."""
    out = []
    for line in metadata.requires(name) or ():
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({**(env or {}), "extra": e}) for e in {"", *extras}):
            out.append(req)
    return out


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _module_version(module: str, attribute: str) -> str | None:
    import importlib

    try:
        return str(getattr(importlib.import_module(module), attribute))
    except Exception as err:  # An import error is the finding, not a crash of the check.
        return f"import failed: {type(err).__name__}: {err}"


def problems(pins: dict[str, str]) -> list[str]:
    """What is wrong with this interpreter's view of the pinned distributions."""
    found = []
    for name, version in pins.items():
        have = _installed(name)
        if have is None or Version(have) != Version(version):
            found.append(f"{name}: want {version}, first on sys.path: {have or 'none'}")
            continue
        if name in MODULE_VERSIONS:
            got = _module_version(*MODULE_VERSIONS[name])
            if got != version:
                found.append(f"{name}: {MODULE_VERSIONS[name][0]} imports as {got}, want {version}")
        for req in requirements(name):
            dep = _installed(req.name)
            if dep is None:
                found.append(f"{name} requires {req}: not installed")
            elif not req.specifier.contains(dep, prereleases=True):
                found.append(f"{name} requires {req}: {req.name} {dep} is installed")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["verify"])
    parser.add_argument("wheel_list", type=Path)
    args = parser.parse_args(argv)
    pins = read_wheel_list(args.wheel_list)
    found = problems(pins)
    for line in found:
        print(f"wheelhouse: {line}", flush=True)
    print(f"wheelhouse: {len(pins)} distributions, {len(found)} problem(s)", flush=True)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
