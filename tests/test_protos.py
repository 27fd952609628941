"""The API's .proto files: generated code fresh, buf lint clean, and the published packages
(pip `llmserve-api`, npm `@llmserve/api`) built from them, versioned with the API."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from google.protobuf import descriptor_pb2

import llmserve.v1
from llmserve.protogen import PROTO_ROOT
from tests.api_wheel import build_api_wheel

def test_generated_protobuf_modules_are_fresh():
    result = subprocess.run([sys.executable, "-m", "llmserve.protogen", "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def buf() -> str:
    path = shutil.which("buf", path=str(Path(sys.executable).parent)) or shutil.which("buf")
    assert path, "buf is missing: it comes with the test extra (buf-bin); run bash scripts/setup.sh"
    return path


def test_buf_lint_passes():
    result = subprocess.run([buf(), "lint"], cwd=PROTO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_buf_lint_catches_an_unprefixed_enum_value(tmp_path):
    # The configuration really applies the rules the API promises (not an empty `use`).
    shutil.copy(PROTO_ROOT / "buf.yaml", tmp_path / "buf.yaml")
    (tmp_path / "llmserve" / "v1").mkdir(parents=True)
    proto = (PROTO_ROOT / "llmserve" / "v1" / "generation.proto").read_text()
    (tmp_path / "llmserve" / "v1" / "generation.proto").write_text(proto.replace("FINISH_REASON_STOP = 1", "STOP = 1"))
    result = subprocess.run([buf(), "lint"], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode != 0
    assert 'Enum value name "STOP" should be prefixed with "FINISH_REASON_"' in result.stdout


def test_descriptor_set_keeps_the_proto_comments():
    files = descriptor_pb2.FileDescriptorSet.FromString(llmserve.v1.DESCRIPTOR_SET.read_bytes()).file
    (generation,) = files
    comments = [loc.leading_comments for loc in generation.source_code_info.location]
    assert any("Most tokens to generate" in c for c in comments)


def api_versions() -> dict[str, str]:
    pyproject = tomllib.loads((PROTO_ROOT / "pyproject.toml").read_text())["project"]
    package_json = json.loads((PROTO_ROOT / "package.json").read_text())
    return {pyproject["name"]: pyproject["version"], package_json["name"]: package_json["version"]}


def test_packages_are_versioned_with_the_api():
    versions = api_versions()
    assert set(versions) == {"llmserve-api", "@llmserve/api"}
    assert len(set(versions.values())) == 1, versions
    (version,) = set(versions.values())
    # Major version N serves proto package llmserve.vN.
    package = re.search(r"^package (\S+);", (PROTO_ROOT / "llmserve/v1/generation.proto").read_text(), re.M)[1]
    assert package == f"llmserve.v{version.split('.')[0]}" == f"llmserve.{llmserve.v1.API_VERSION}"
    # Each release is in the .proto's changelog.
    assert re.search(rf"^//\s+{re.escape(version)}\s", (PROTO_ROOT / "llmserve/v1/generation.proto").read_text(), re.M)


def test_every_distribution_pins_the_api_version_it_ships():
    """A bump of llmserve-api must move the base's pin with it: a clean install resolves
    the pin against protos/ and fails on a mismatch (an existing venv hides it)."""
    (version,) = set(api_versions().values())
    repo = PROTO_ROOT.parent
    pins = {}
    for pyproject in [repo / "pyproject.toml", *repo.glob("*/pyproject.toml"), *repo.glob("services/*/pyproject.toml")]:
        for requirement in tomllib.loads(pyproject.read_text())["project"].get("dependencies", []):
            if re.match(r"llmserve-api\b", requirement):
                pins[str(pyproject.relative_to(repo))] = requirement
    assert pins, "no distribution depends on llmserve-api"
    assert all(pin == f"llmserve-api=={version}" for pin in pins.values()), pins


def test_the_python_wheel_holds_the_generated_modules_and_nothing_internal(tmp_path):
    wheel = build_api_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in ("generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py", "generation.proto",
                 "generation.binpb", "py.typed", "__init__.py"):
        assert f"llmserve/v1/{name}" in names
    assert not [n for n in names if n.startswith("llmserve/internal") or n == "llmserve/__init__.py"]
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "Requires-Dist: grpcio" in metadata and "Requires-Dist: protobuf" in metadata


def test_npm_package_types_are_generated_from_the_proto(node_example, tmp_path):
    shutil.copytree(PROTO_ROOT, tmp_path / "api", ignore=shutil.ignore_patterns("types", "node_modules"))
    gen = node_example / "node_modules" / ".bin" / "proto-loader-gen-types"
    script = json.loads((PROTO_ROOT / "package.json").read_text())["scripts"]["types"]
    argv = [str(gen), *script.split()[1:]]
    subprocess.run(argv, cwd=tmp_path / "api", check=True, capture_output=True)
    fresh = {p.relative_to(tmp_path / "api" / "types"): p.read_text() for p in (tmp_path / "api" / "types").rglob("*.ts")}
    committed = {p.relative_to(PROTO_ROOT / "types"): p.read_text() for p in (PROTO_ROOT / "types").rglob("*.ts")}
    assert fresh == committed, "protos/types is stale: run `npm run types` in protos/ (see tests/test_protos.py)"


def test_npm_package_types_check_a_typescript_client(node_example):
    result = subprocess.run([shutil.which("npm"), "run", "--silent", "typecheck"], cwd=node_example, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_npm_package_types_reject_camel_case_fields(node_example, tmp_path):
    # keepCase in the types too: `maxTokens` is a compile error, not a silently dropped field.
    source = (node_example / "stream_chat_typed.ts").read_text().replace("max_tokens:", "maxTokens:")
    bad = node_example / "camel_case_check.ts"
    bad.write_text(source)
    try:
        result = subprocess.run([str(node_example / "node_modules" / ".bin" / "tsc"), "--noEmit", "--strict",
                                 "--module", "commonjs", "--moduleResolution", "node", "--target", "es2020",
                                 "--types", "node", "--skipLibCheck", bad.name],
                                cwd=node_example, capture_output=True, text=True)
    finally:
        bad.unlink()
    assert result.returncode != 0 and "'maxTokens' does not exist" in result.stdout
