"""The wheel list a GPU machine without a registry gets (scripts/gpu-wheels.txt), and
the checks that it is whole and that what the interpreter there imports is what it says.

    python scripts/wheelhouse.py check-wheels DIR --python-version 3.12 --image scripts/gpu-image.txt
    python scripts/wheelhouse.py verify scripts/gpu-wheels.txt

check-wheels (where the wheelhouse is made): every Requires-Dist of every wheel in DIR,
read from the wheel itself with its markers evaluated for that Python, names a wheel in
DIR whose version it accepts, or a distribution the image has.
verify (on the GPU machine, after installing): every listed distribution is the first
one on sys.path at its listed version, and every requirement of each (markers evaluated
for this interpreter) is installed at a version that satisfies it.
Both exit 1, naming each problem, otherwise.
"""

from __future__ import annotations

import argparse
import re
import sys
import zipfile
from email.parser import Parser
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


def wheel_metadata(path: Path) -> tuple[str, str, list[Requirement]]:
    """(canonical name, version, Requires-Dist) from a wheel's own METADATA."""
    with zipfile.ZipFile(path) as whl:
        name = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(whl.read(name).decode())
    return canonical(meta["Name"]), meta["Version"], [Requirement(r) for r in meta.get_all("Requires-Dist") or ()]


def wheel_problems(folder: Path, python_version: str, image: set[str]) -> list[str]:
    """Requirements of the wheels in `folder` (for Python `python_version`, no extras but
    those one wheel asks of another) that neither another wheel there nor the image meets."""
    wheels = {name: (version, reqs) for name, version, reqs in map(wheel_metadata, sorted(folder.glob("*.whl")))}
    env = {"python_version": python_version, "python_full_version": f"{python_version}.0"}
    # Extras one wheel asks of another in its own unconditional requirements; fastapi's
    # `uvicorn[standard]; extra == "standard"` asks nothing unless fastapi[standard] is wanted.
    wanted_extras = {
        canonical(r.name): r.extras
        for _, reqs in wheels.values()
        for r in reqs
        if r.extras and (r.marker is None or r.marker.evaluate({**env, "extra": ""}))
    }
    found = []
    for name, (version, reqs) in wheels.items():
        extras = {"", *wanted_extras.get(name, ())}
        for req in reqs:
            if req.marker is not None and not any(req.marker.evaluate({**env, "extra": e}) for e in extras):
                continue
            dep = canonical(req.name)
            if dep in wheels:
                if not req.specifier.contains(wheels[dep][0], prereleases=True):
                    found.append(f"{name} {version} requires {req}: the wheelhouse has {wheels[dep][0]}")
            elif dep not in image:
                found.append(f"{name} {version} requires {req}: neither in the wheelhouse nor in the image")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="action", required=True)
    verify = sub.add_parser("verify", help="on the GPU machine: installed versions and their requirements")
    verify.add_argument("wheel_list", type=Path)
    check = sub.add_parser("check-wheels", help="where the wheelhouse is made: the wheels' own requirements")
    check.add_argument("folder", type=Path)
    check.add_argument("--python-version", required=True)
    check.add_argument("--image", type=Path, required=True, help="the image's distributions, one a line")
    args = parser.parse_args(argv)
    if args.action == "verify":
        count, found = len(read_wheel_list(args.wheel_list)), problems(read_wheel_list(args.wheel_list))
    else:
        count = len(list(args.folder.glob("*.whl")))
        found = wheel_problems(args.folder, args.python_version, {canonical(n) for n in read_names(args.image)})
    for line in found:
        print(f"wheelhouse: {line}", flush=True)
    print(f"wheelhouse: {count} distributions, {len(found)} problem(s)", flush=True)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
