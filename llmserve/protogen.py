"""Regenerates the Python protobuf/gRPC modules from protos/ (run after editing a .proto).

    python -m llmserve.protogen          # writes protos/llmserve/v1 and llmserve/internal/v1
    python -m llmserve.protogen --check  # exits 1 when the committed files are stale

The public API's modules live beside generation.proto in protos/llmserve/v1: that folder
is the `llmserve-api` Python package (protos/pyproject.toml), installable on its own.
Beside them, generation.binpb is the API's descriptor set *with* source comments
(protoc's Python output strips them); the router's reflection service serves it.
The internal contracts' modules stay in the `llmserve` distribution (llmserve/internal).
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "protos"
PUBLIC_PACKAGE = Path("llmserve/v1")  # relative to protos/: the llmserve-api package
PUBLIC_DESCRIPTOR_SET = PUBLIC_PACKAGE / "generation.binpb"


def proto_files() -> list[Path]:
    # Under protos/llmserve only: a package build's copies (protos/build/) are not sources.
    return sorted((PROTO_ROOT / "llmserve").rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    public = [str(p.relative_to(PROTO_ROOT)) for p in proto_files() if p.is_relative_to(PROTO_ROOT / PUBLIC_PACKAGE)]
    descriptor_args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        "--include_source_info",
        f"--descriptor_set_out={out_dir / PUBLIC_DESCRIPTOR_SET}",
        *public,
    ]
    if protoc.main(descriptor_args) != 0:
        raise RuntimeError("protoc failed (descriptor set)")
    return sorted([*out_dir.rglob("*_pb2*.py*"), out_dir / PUBLIC_DESCRIPTOR_SET])


def destination(rel: Path) -> Path:
    """Where a generated file is committed: the public API's beside its .proto."""
    if rel.is_relative_to(PUBLIC_PACKAGE):
        return PROTO_ROOT / rel
    return REPO / rel


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generated = generate(Path(tmp))
        stale = []
        for path in generated:
            rel = path.relative_to(tmp)
            target = destination(rel)
            if args.check:
                if not target.exists() or not filecmp.cmp(path, target, shallow=False):
                    stale.append(str(rel))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(path.read_bytes())
        if stale:
            print("stale generated files (run python -m llmserve.protogen):", *stale, sep="\n  ")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
