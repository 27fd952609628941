"""deploy/helm/llmserve: rendered offline (helm-python-sdk, Helm's own Go SDK, no
cluster), every object valid against the Kubernetes 1.37 JSON schemas
(kubernetes-validate, strict: unknown fields fail), and no drift from the services:
command lines parse with the real CLI, probes and Services point at the ports the flags
open, the grace period outlasts the drain, every LLMSERVE_* variable is a setting."""

from __future__ import annotations

import copy
import functools
import re
import shlex
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from helm_python import chart as helm
from helm_python.chart import Chart

from llmserve.certs import write_credentials
from llmserve.cli import build_parser, load_commands
from llmserve.settings import options, resolve

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "llmserve"
KUBERNETES_VERSION = "1.37.0"  # The newest schema set kubernetes-validate==1.37.0 bundles.
SECRET = "llmserve-tls"
# Values files of the variants the Kubernetes guide (docs/guide/kubernetes.md) documents, and shapes the templates branch on.
VARIANTS = {
    "cpu": {},
    "gpu": yaml.safe_load((CHART / "values-gpu.yaml").read_text()),
    "cpu-tp2": {"replica": {"tpSize": 2}},
    "autoscaling": {"autoscaling": {"enabled": True}},
    "own-model": {"model": "/models/Qwen2-7B-Instruct", "modelVolume": {"persistentVolumeClaim": {"claimName": "models"}}},
}
# The worker drains up to --shutdown-timeout + 5 s (llmserve/worker/service.py `_drain`:
# it steps until its scheduler has drained), then its server stops with a 2 s grace.
WORKER_DRAIN_EXTRA_S = 5 + 2


@functools.cache
def _rendered(variant: str) -> tuple[dict, ...]:
    manifests = Chart.load(CHART).render(values=VARIANTS[variant], name="llmserve", namespace="llmserve")
    return tuple(doc for text in manifests.values() for doc in yaml.safe_load_all(text) if doc)


def rendered(variant: str) -> list[dict]:
    return copy.deepcopy(list(_rendered(variant)))


def one(docs: list[dict], kind: str, name: str) -> dict:
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def pod_spec(docs: list[dict], kind: str, name: str) -> dict:
    return one(docs, kind, name)["spec"]["template"]["spec"]


def containers(variant: str) -> list[tuple[str, dict]]:
    """(workload name, container) of every long-running llmserve container."""
    return [(d["metadata"]["name"], c) for d in rendered(variant) if d["kind"] in ("Deployment", "StatefulSet")
            for c in d["spec"]["template"]["spec"]["containers"]]


def flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


# --- valid Kubernetes -------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_object_is_valid_against_the_kubernetes_schemas(variant):
    docs = rendered(variant)
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    expected = [("Deployment", "llmserve-router"), ("Service", "llmserve-replica"), ("Service", "llmserve-router"),
                ("StatefulSet", "llmserve-replica")]
    if variant == "autoscaling":
        expected.insert(1, ("HorizontalPodAutoscaler", "llmserve-replica"))
    assert kinds == expected
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_helm_lint_finds_nothing_above_info(variant):
    result = helm.lint(CHART, values=VARIANTS[variant], strict=True, kube_version=KUBERNETES_VERSION)
    warnings = [m for m in result["messages"] if m["severity"] > 1]  # Helm's 1 = INFO ("icon is recommended").
    assert not result["errors"] and not warnings, result


def test_the_validator_refuses_what_kubernetes_would():
    """The check above can fail: a misspelt field and a wrong type are refused."""
    deployment = one(rendered("cpu"), "Deployment", "llmserve-router")
    misspelt = copy.deepcopy(deployment)
    misspelt["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["replicas"] = "two"
    for doc in (misspelt, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


# --- no drift from the services --------------------------------------------------------


def _container_ids():
    return [(variant, workload, c["name"]) for variant in VARIANTS for workload, c in containers(variant)]


@pytest.mark.parametrize("variant,workload,name", _container_ids(), ids=["/".join(i) for i in _container_ids()])
def test_every_command_line_parses_with_llmserve(variant, workload, name):
    """The router's --scheduler list, --scheduler-resolve-interval and --routing-policy come
    with the data-parallel router: this passes once that is merged."""
    [container] = [c for w, c in containers(variant) if (w, c["name"]) == (workload, name)]
    cmd = container["command"]
    assert cmd[0] == "llmserve" and cmd[1] in ("router", "scheduler", "worker")
    args = build_parser().parse_args(cmd[1:])  # SystemExit (a failure) on an unknown flag or a bad value.
    environ = {k: v for k, v in env_of(container).items() if k.startswith("LLMSERVE_")}
    config = resolve(load_commands()[args.command].config, args, environ=environ)
    assert config.server.host == "0.0.0.0"  # The kubelet and the other pods reach the pod's address.
    assert not config.security.insecure and config.security.tls_cert is not None


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_llmserve_variable_is_a_setting_of_its_command(variant):
    for workload, c in containers(variant):
        known = {o.env for o in options(load_commands()[c["command"][1]].config)} | {"LLMSERVE_LOG_LEVEL"}
        for name in env_of(c):
            if name.startswith("LLMSERVE_"):
                assert name in known, f"{workload}/{c['name']}: {name} is not a setting of `llmserve {c['command'][1]}`"


@pytest.mark.parametrize("variant", VARIANTS)
def test_probes_and_ports_are_the_ones_the_flags_open(variant):
    for workload, c in containers(variant):
        cmd, where = c["command"], f"{workload}/{c['name']}"
        health = int(flag(cmd, "--health-port"))
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == health, f"{where}: {probe}"
        declared = {p["containerPort"] for p in c["ports"]}
        opened = {int(flag(cmd, f)) for f in ("--port", "--health-port", "--metrics-port", "--http-port")
                  if flag(cmd, f)}
        assert opened <= declared, f"{where}: ports {opened - declared} opened but not declared"
    for kind, name in (("Deployment", "llmserve-router"), ("StatefulSet", "llmserve-replica")):
        spec = pod_spec(rendered(variant), kind, name)
        ports = [p["containerPort"] for c in spec["containers"] for p in c["ports"]]
        assert len(ports) == len(set(ports)), f"{name}: two containers of one pod on one port"
        # The scrape annotation names a port a container serves its metrics on.
        annotations = one(rendered(variant), kind, name)["spec"]["template"]["metadata"]["annotations"]
        metrics_ports = {flag(c["command"], "--metrics-port") for c in spec["containers"]}
        assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] in metrics_ports


@pytest.mark.parametrize("variant", VARIANTS)
def test_services_reach_the_ports_the_routers_and_clients_dial(variant):
    docs = rendered(variant)
    [router] = pod_spec(docs, "Deployment", "llmserve-router")["containers"]
    replica = {c["name"]: c for c in pod_spec(docs, "StatefulSet", "llmserve-replica")["containers"]}
    scheduler_port = flag(replica["scheduler"]["command"], "--port")

    def target(service: dict, port_name: str, container: dict) -> int:
        [port] = [p for p in service["spec"]["ports"] if p["name"] == port_name]
        [named] = [p for p in container["ports"] if p["name"] == port["targetPort"]]
        assert named["containerPort"] == port["port"], f"{service['metadata']['name']}: {port_name}"
        return port["port"]

    public = one(docs, "Service", "llmserve-router")
    assert target(public, "grpc", router) == int(flag(router["command"], "--port"))
    assert target(public, "http", router) == int(flag(router["command"], "--http-port"))
    # Headless: the router's --scheduler resolves to every replica pod's address.
    headless = one(docs, "Service", "llmserve-replica")
    assert headless["spec"]["clusterIP"] == "None"
    assert one(docs, "StatefulSet", "llmserve-replica")["spec"]["serviceName"] == "llmserve-replica"
    assert headless["spec"]["selector"] == one(docs, "StatefulSet", "llmserve-replica")["spec"]["selector"][
        "matchLabels"]
    assert target(headless, "grpc", replica["scheduler"]) == int(scheduler_port)
    assert flag(router["command"], "--scheduler") == f"llmserve-replica:{scheduler_port}"
    # Each worker rank registers with the scheduler of its own pod.
    workers = [c for name, c in replica.items() if name.startswith("worker-")]
    assert workers and all(flag(w["command"], "--scheduler") == f"localhost:{scheduler_port}" for w in workers)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_grace_period_outlasts_the_drain(variant):
    """SIGKILL comes terminationGracePeriodSeconds after the preStop hook starts: it must
    leave the hook's sleep plus the services' drain (--shutdown-timeout) and the worker's extra."""
    for kind, name in (("Deployment", "llmserve-router"), ("StatefulSet", "llmserve-replica")):
        spec = pod_spec(rendered(variant), kind, name)
        for c in spec["containers"]:
            sleep = c["lifecycle"]["preStop"]["sleep"]["seconds"]
            shutdown = float(env_of(c)["LLMSERVE_SHUTDOWN_TIMEOUT"])
            assert flag(c["command"], "--shutdown-timeout") is None  # One source: the variable.
            assert spec["terminationGracePeriodSeconds"] > sleep + shutdown + WORKER_DRAIN_EXTRA_S, f"{name}/{c['name']}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_readiness_asks_the_status_that_means_it(variant):
    from llmserve.v1 import generation_pb2

    public_service = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
    for workload, c in containers(variant):
        # The router's own service turns NOT_SERVING while the replicas refuse work; its "" does not.
        expected = public_service if c["command"][1] == "router" else ""
        assert c["readinessProbe"]["grpc"]["service"] == expected, f"{workload}/{c['name']}"
        assert c["livenessProbe"]["grpc"]["service"] == "" and c["startupProbe"]["grpc"]["service"] == ""


# --- credentials -----------------------------------------------------------------------


def test_credentials_are_the_files_llmserve_certs_writes_each_role_its_own(tmp_path):
    creds = write_credentials(tmp_path / "out", ca_key=tmp_path / "ca" / "ca.key")
    secret_keys = {p.name for p in creds.dir.iterdir()}  # What `kubectl create secret --from-file=DIR` takes.
    assert "ca.key" not in secret_keys
    for variant in VARIANTS:
        for kind, name in (("Deployment", "llmserve-router"), ("StatefulSet", "llmserve-replica")):
            spec = pod_spec(rendered(variant), kind, name)
            volumes = {v["name"]: v for v in spec["volumes"]}
            for c in spec["containers"]:
                role = c["command"][1]
                mounted = {}
                for m in c["volumeMounts"]:
                    secret = volumes[m["name"]].get("secret")
                    if secret:
                        assert secret["secretName"] == SECRET and m["readOnly"]
                        mounted |= {f"{m['mountPath']}/{i['path']}": i["key"] for i in secret["items"]}
                assert set(mounted.values()) <= secret_keys
                env = env_of(c)
                wanted = {"LLMSERVE_TLS_CERT": f"{role}.crt", "LLMSERVE_TLS_KEY": f"{role}.key",
                          "LLMSERVE_TLS_CA": "ca.crt"} | ({"LLMSERVE_API_KEY_FILE": "api-key"} if role == "router" else {})
                for variable, key in wanted.items():
                    assert mounted.get(env[variable]) == key, f"{name}/{c['name']}: {variable}"
                # Only its own role's key: a compromised container cannot act as another role.
                assert {k for k in mounted.values() if k.endswith(".key")} == {f"{role}.key"}


def _readme_kubernetes_commands() -> list[list[str]]:
    section = (ROOT / "docs" / "guide" / "kubernetes.md").read_text()  # The Kubernetes guide.
    lines = []
    for block in re.findall(r"^```bash\n(.*?)^```", section, flags=re.S | re.M):
        lines += [shlex.split(line, comments=True) for line in block.replace("\\\n", " ").splitlines()]
    return [line for line in lines if line]


def test_the_readmes_certificates_name_every_host_that_is_dialed():
    """TLS verifies a resolved replica address against the host name as written: the
    scheduler certificate must carry the headless Service's name, the router's its Service's."""
    commands = _readme_kubernetes_commands()
    [certs] = [c for c in commands if c[:2] == ["llmserve", "certs"]]
    args = build_parser().parse_args(certs[1:])
    hosts = set(args.hosts.split(","))
    [router] = pod_spec(rendered("cpu"), "Deployment", "llmserve-router")["containers"]
    dialed = {flag(router["command"], "--scheduler").rsplit(":", 1)[0], "llmserve-router"}
    assert dialed <= hosts, dialed - hosts
    assert not Path(args.ca_key).is_relative_to(args.out), "the CA's key must not go into the Secret"
    [create] = [c for c in commands if c[:4] == ["kubectl", "create", "secret", "generic"]]
    assert create[4] == SECRET and f"--from-file={args.out}" in create


# --- variants --------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_gpus_only_in_the_gpu_variant(variant):
    workers = [c for w, c in containers(variant) if c["name"].startswith("worker-")]
    for c in workers:
        device = flag(c["command"], "--device")
        gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
        if variant == "gpu":
            assert device == "cuda" and gpus == 1 == c["resources"]["requests"]["nvidia.com/gpu"]
            assert env_of(c)["LOCAL_RANK"] == "0"  # Each container sees its own GPU as cuda:0.
        else:
            assert device == "cpu" and gpus is None


@pytest.mark.parametrize("variant", ["gpu", "cpu-tp2"])
def test_tensor_parallel_ranks_share_one_pod(variant):
    spec = pod_spec(rendered(variant), "StatefulSet", "llmserve-replica")
    workers = [c["command"] for c in spec["containers"] if c["name"].startswith("worker-")]
    assert [flag(w, "--rank") for w in workers] == ["0", "1"]
    assert {flag(w, "--tp-size") for w in workers} == {"2"}
    [rendezvous] = {flag(w, "--dist-init") for w in workers}
    port = int(rendezvous.rsplit(":", 1)[1])
    assert rendezvous.startswith("tcp://127.0.0.1:")
    assert port in {p["containerPort"] for p in spec["containers"][1]["ports"]}  # Rank 0 serves it.
    assert any(v["name"] == "dshm" and v["emptyDir"]["medium"] == "Memory" for v in spec["volumes"])


def test_a_model_of_ones_own_reaches_router_and_workers_read_only():
    docs = rendered("own-model")
    for kind, name in (("Deployment", "llmserve-router"), ("StatefulSet", "llmserve-replica")):
        spec = pod_spec(docs, kind, name)
        assert {"name": "models", "persistentVolumeClaim": {"claimName": "models"}} in spec["volumes"]
        for c in spec["containers"]:
            if c["command"][1] == "scheduler":  # Holds no model.
                assert "--model" not in c["command"] and all(m["name"] != "models" for m in c["volumeMounts"])
                continue
            assert flag(c["command"], "--model") == "/models/Qwen2-7B-Instruct"
            assert {"name": "models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]


def test_one_rank_needs_no_group_flags():
    workers = [c for w, c in containers("cpu") if c["name"].startswith("worker-")]
    assert len(workers) == 1 and not {"--tp-size", "--rank", "--dist-init"} & set(workers[0]["command"])


def test_the_autoscaler_scales_the_replicas_on_a_metric_the_scheduler_serves():
    from llmserve.telemetry.metrics import METRICS

    docs = rendered("autoscaling")
    hpa = one(docs, "HorizontalPodAutoscaler", "llmserve-replica")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "llmserve-replica"}
    [metric] = hpa["spec"]["metrics"]
    scheduler_metrics = {m.prometheus_name for m in METRICS if m.service == "scheduler" and m.kind == "gauge"}
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] in scheduler_metrics
    # The autoscaler owns the replica count: the StatefulSet must not reset it on every upgrade.
    assert "replicas" not in one(docs, "StatefulSet", "llmserve-replica")["spec"]
    assert "replicas" in one(rendered("cpu"), "StatefulSet", "llmserve-replica")["spec"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_non_root_with_a_read_only_root(variant):
    uid = int(re.search(r"useradd .*--uid (\d+)", (ROOT / "Dockerfile").read_text()).group(1))
    for kind, name in (("Deployment", "llmserve-router"), ("StatefulSet", "llmserve-replica")):
        spec = pod_spec(rendered(variant), kind, name)
        assert spec["securityContext"]["runAsUser"] == uid and spec["securityContext"]["runAsNonRoot"]
        for c in spec["containers"]:
            context = c["securityContext"]
            assert context["readOnlyRootFilesystem"] and not context["allowPrivilegeEscalation"]
            assert context["capabilities"]["drop"] == ["ALL"]
            assert "/tmp" in {m["mountPath"] for m in c["volumeMounts"]}  # The one writable scratch place.
