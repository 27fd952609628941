"""`llmserve up`: router, scheduler and worker on localhost (cluster.py), from one set of
flags: every setting of the three services but those the cluster assigns per process
(addresses, ranks, credentials), plus the cluster's own (ports, --dp-size, --prompt).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from llmserve.contract.startup_errors import port_error
from llmserve.launcher.cluster import ClusterSpec, LocalCluster, metrics_port_owners
from llmserve.launcher.engine_settings import CREDENTIALS, PER_PROCESS, EngineSettings
from llmserve.router.config import RouterConfig
from llmserve.settings import Command, group, setting

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class UpConfig:
    """`llmserve up`: every setting of the three services, but those the launcher sets
    per process (addresses, ranks), plus the cluster's own."""

    engine: EngineSettings = group(EngineSettings)
    # The router serves the worker's model; `up` keeps the router's --insecure: one flag
    # for the whole cluster.
    router: RouterConfig = group(RouterConfig, skip=PER_PROCESS + CREDENTIALS + ("model", "served-model-name",
                                                                                 "http-port"))
    port: int = setting(50051, help="the router's (public) port")
    http_port: int = setting(8000, help="the router's OpenAI-compatible HTTP API port (0 = off)")
    scheduler_port: int = setting(50052, help="the scheduler's port")
    worker_port: int = setting(50053, help="the worker's port (rank 0's in a group)")
    dp_size: int = setting(1, help="data-parallel replicas (a scheduler and a worker group each) behind the router; "
                                   "replica i listens on --scheduler-port + 2i and --worker-port + 2i")
    prompt: str | None = setting(None, help="answer this prompt (as a chat message), then stop",
                                 unset="none: serve until Ctrl-C")
    max_tokens: int = setting(128, help="token limit of the --prompt answer")
    startup_timeout: float = setting(600.0, help="seconds the cluster may take to become ready")
    metrics_port: int = setting(0, help="Prometheus endpoints: router, scheduler, worker on PORT, +1, +2; with "
                                        "--dp-size N, each replica's scheduler and worker on the next two (0 = off)")
    shutdown_timeout: float = setting(30.0, help="after SIGTERM, seconds in-flight streams may run on")


def cluster_spec(config: UpConfig, model_dir: Path, log_level: str = "INFO") -> ClusterSpec:
    """The local cluster `up` runs: the services' settings as given, the ports and sizes
    of the cluster."""
    worker = config.engine.worker
    return ClusterSpec(model_dir=model_dir, router=config.router, scheduler=config.engine.scheduler, worker=worker,
                       router_port=config.port, http_port=config.http_port, scheduler_port=config.scheduler_port,
                       worker_port=config.worker_port, metrics_port=config.metrics_port,
                       shutdown_timeout_s=config.shutdown_timeout, log_level=log_level, tp_size=worker.tp_size,
                       pp_size=worker.pp_size, dp_size=config.dp_size, insecure=config.router.security.insecure)


def startup_lines(spec: ClusterSpec) -> list[str]:
    """One readable line per service for the start-up log (--log-level DEBUG also logs
    the whole config)."""
    internal = "plaintext (--insecure)" if spec.insecure else "mutual TLS"
    public = "plaintext, no API key (--insecure)" if spec.insecure else "TLS + API key"
    schedulers, workers = (", ".join(str(ports[i]) for ports in spec.ports()) for i in (0, 1))
    metrics = {}
    if spec.metrics_port:
        for offset, owner in enumerate(metrics_port_owners(spec.dp_size)):
            metrics.setdefault(owner.split("@")[0], []).append(str(spec.metrics_port + offset))
    shown = {name: f", metrics port {', '.join(ports)}" for name, ports in metrics.items()}
    runner, scheduling = spec.worker.runner, spec.scheduler.scheduling
    http = f", HTTP port {spec.http_port}" if spec.http_port else ", HTTP off"
    replicas = f" x {spec.dp_size} replicas" if spec.dp_size > 1 else ""
    return [
        f"router: model {spec.worker.served_model_name or spec.model_dir.name}, port {spec.router_port}{http}"
        f"{shown.get('router', '')}, routing {spec.router.routing_policy}, {public}",
        f"scheduler{replicas}: port {schedulers}{shown.get('scheduler', '')}, max-num-seqs "
        f"{scheduling.max_num_seqs or 'by device'}, max-num-batched-tokens "
        f"{scheduling.max_num_batched_tokens or 'by device'}, {internal}",
        f"worker{replicas}: model {spec.model_dir}, device {runner.device}, dtype {runner.dtype}, quantization "
        f"{runner.quantization}, tp {spec.tp_size} x pp {spec.pp_size}, port {workers}{shown.get('worker', '')}, "
        f"{internal}",
    ]


def cluster_ports(config: UpConfig) -> dict[int, tuple[str, str]]:
    """Every port `up` will listen on -> (what listens there, the flag that moves it)."""
    ports = {config.port: ("the router", "--port")}
    for i in range(config.dp_size):
        replica = f" of replica {i}" if config.dp_size > 1 else ""
        ports[config.scheduler_port + 2 * i] = (f"the scheduler{replica}", "--scheduler-port")
        ports[config.worker_port + 2 * i] = (f"the worker{replica}", "--worker-port")
    if config.metrics_port:
        for offset, name in enumerate(metrics_port_owners(config.dp_size)):
            ports[config.metrics_port + offset] = (f"the {name}'s metrics", "--metrics-port")
    return ports


def check_ports_free(config: UpConfig, host: str = "127.0.0.1") -> None:
    """StartupError naming the first port of the cluster that another process holds. Run
    before anything loads: a second `up` fails in a line, not after loading a model."""
    for port, (what, flag) in cluster_ports(config).items():
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # As the services' gRPC servers bind.
            try:
                s.bind((host, port))
            except OSError as err:
                raise port_error(what, host, port, flag, err) from err


def run_local_cluster(config: UpConfig, log_level: str = "INFO") -> int:
    """`llmserve up`: start the cluster, answer --prompt if given, else serve until Ctrl-C."""
    from llmserve.model_store import resolve_model_dir
    from llmserve.worker.models.checkpoint import check_model_dir

    check_ports_free(config)
    model_dir = resolve_model_dir(config.engine.worker.model)  # Convert the default model once, before the children race.
    check_model_dir(model_dir)  # A model the worker cannot load fails here, in a line, before any process starts.
    spec = cluster_spec(config, model_dir, log_level)
    for line in startup_lines(spec):
        logger.info("%s", line)
    config.router.security.warn_if_insecure("the local cluster (router, scheduler and worker)")
    cluster = LocalCluster(spec)
    # Ctrl-C reaches the whole foreground process group; the children shut down on it
    # by themselves, and stop() below makes sure none is left behind. SIGTERM reaches
    # this process only: it becomes KeyboardInterrupt, and stop() passes it on.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        cluster.start(timeout_s=config.startup_timeout)
        _log_ready(cluster)
        if config.prompt is not None:
            return asyncio.run(_answer(cluster, config.prompt, config.max_tokens))
        while all(p.poll() is None for p in cluster.processes.values()):
            time.sleep(0.5)
        logger.error("a service exited; stopping the cluster")
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # A second SIGTERM must not cut the drain short.
        codes = cluster.stop()
        for name, code in codes.items():
            (logger.info if code == 0 else logger.error)("%s exited with code %d", name, code)
        clean = all(code == 0 for code in codes.values())
    return 0 if clean else 1


def _log_ready(cluster: LocalCluster) -> None:
    logger.info("cluster ready: router at %s (Ctrl-C stops it)", cluster.router_address)
    if cluster.http_url:
        logger.info("OpenAI-compatible API at %s", cluster.http_url)
    if cluster.credentials is not None:
        c = cluster.credentials
        logger.info("TLS CA certificate: %s; API key file: %s (removed when the cluster stops). Connect with "
                    "LLMSERVE_TLS_CA=%s LLMSERVE_API_KEY=$(cat %s) llmserve generate ...", c.ca, c.api_key_file,
                    c.ca, c.api_key_file)


def _run_up(config: UpConfig) -> int:
    return run_local_cluster(config, logging.getLevelName(logging.getLogger().getEffectiveLevel()))


# logs_config: run_local_cluster logs startup_lines(); the whole config only at DEBUG.
COMMAND = Command("up", "start router, scheduler and worker on localhost", UpConfig, _run_up, logs_config=True)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


async def _answer(cluster: LocalCluster, prompt: str, max_tokens: int) -> int:
    print(f">>> {prompt}", flush=True)
    async with cluster.client() as client:
        async for delta in client.generate(messages=[{"role": "user", "content": prompt}],
                                           max_tokens=max_tokens, temperature=0.0):
            print(delta.text, end="", flush=True)
    print(flush=True)
    return 0
