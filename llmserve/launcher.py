"""A local cluster: router, scheduler and worker as three processes on localhost (with
--dp-size N, N replicas of scheduler + worker behind the one router).

Used by `llmserve up` and by the end-to-end tests. Each child is the same
`llmserve <service>` command that docker-compose or Kubernetes would run. Secure by
default: unless the spec says `insecure`, the cluster makes a throwaway CA, one
certificate per role and an API key in a private temporary directory (removed by
stop()), and every hop runs mutual TLS.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.certs import ClusterCredentials, write_credentials
from llmserve.contract.peers import ROUTER, SCHEDULER, WORKER
from llmserve.contract.security import channel_credentials
from llmserve.contract.startup_errors import StartupError, port_error
from llmserve.router.config import RouterConfig
from llmserve.scheduler.config import SchedulerConfig, SchedulerServiceConfig
from llmserve.settings import Command, group, setting, to_argv
from llmserve.worker.config import WorkerConfig

logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ClusterSpec:
    model_dir: Path
    router_port: int = 50051
    http_port: int = 0  # The router's OpenAI-compatible HTTP API (0: off).
    scheduler_port: int = 50052
    worker_port: int = 50053
    model_name: str | None = None
    scheduler_args: list[str] = field(default_factory=list)
    worker_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    shutdown_timeout_s: float = 30.0  # The children's own drain time; stop() waits a bit longer.
    log_dir: Path | None = None  # Children's stderr goes here (else inherited).
    log_level: str = "INFO"
    tp_size: int = 1  # A TP x PP group: one worker process per rank ("worker-0", "worker-1", ...).
    pp_size: int = 1
    dist_port: int | None = None  # Rendezvous port of the group (a free one when None).
    # Data parallelism: replicas of scheduler + worker group behind the router. Replica 0
    # uses scheduler_port / worker_port; replica i > 0 the i-th (scheduler, worker) pair of
    # replica_ports (default: scheduler_port + 2i, worker_port + 2i).
    dp_size: int = 1
    replica_ports: list[tuple[int, int]] | None = None
    # Flags for one process only, by its name ("router", "scheduler@1", ...), after the rest.
    process_args: dict[str, list[str]] = field(default_factory=dict)
    # Environment variables for one service's processes on top of this process's own:
    # {"router" | "scheduler" | "worker": {name: value}} ("worker": every rank of a group).
    service_env: dict[str, dict[str, str]] = field(default_factory=dict)
    insecure: bool = False  # Plaintext and no API key (debugging; the benchmarks' TLS-cost runs).
    # A credential set to use (`llmserve certs --out DIR`); None: a throwaway one per cluster.
    credentials: ClusterCredentials | None = None

    def commands(self, credentials: ClusterCredentials | None = None) -> dict[str, list[str]]:
        """Each process's command line; `credentials` is required unless `insecure`."""
        if not self.insecure and credentials is None:
            raise ValueError("a secure cluster needs credentials (or insecure=True)")

        def security(role: str) -> list[str]:
            if self.insecure:
                return ["--insecure"]
            # --no-insecure: an LLMSERVE_INSECURE in this process's environment must not
            # turn a child insecure behind the launcher's back.
            flags = ["--no-insecure", *credentials.service_flags(role)]
            return flags + (["--api-key-file", str(credentials.api_key_file)] if role == ROUTER else [])

        base = [sys.executable, "-m", "llmserve.cli", "--log-level", self.log_level]
        model = ["--model", str(self.model_dir)]
        if self.model_name:
            model += ["--served-model-name", self.model_name]
        commands = {}
        schedulers = []
        for replica, (scheduler_port, worker_port) in enumerate(self.ports()):
            # dp 1: "scheduler", "worker" (or "worker-<rank>"); dp N: the same names + "@<replica>".
            suffix = f"@{replica}" if self.dp_size > 1 else ""
            scheduler_addr = f"localhost:{scheduler_port}"
            schedulers.append(scheduler_addr)
            commands["scheduler" + suffix] = base + [
                "scheduler", "--host", "127.0.0.1", "--port", str(scheduler_port), *security(SCHEDULER),
                *self.scheduler_args]
            worker = base + ["worker", *model, "--host", "127.0.0.1", "--scheduler", scheduler_addr,
                             *security(WORKER), *self.worker_args]
            world = self.tp_size * self.pp_size
            if world == 1:
                commands["worker" + suffix] = worker + ["--port", str(worker_port)]
                continue
            if self.dist_port is None:
                self.dist_port = free_port()
            dist_port = self.dist_port if replica == 0 else free_port()
            for rank in range(world):  # rank 0 on worker_port, the others on free ports
                commands[f"worker-{rank}{suffix}"] = worker + [
                    "--port", str(worker_port if rank == 0 else 0), "--tp-size", str(self.tp_size),
                    "--pp-size", str(self.pp_size), "--rank", str(rank),
                    "--dist-init", f"tcp://127.0.0.1:{dist_port}"]
        commands["router"] = base + ["router", *model, "--host", "127.0.0.1", "--port", str(self.router_port),
                                     "--scheduler", ",".join(schedulers), "--http-port", str(self.http_port),
                                     *security(ROUTER), *self.router_args]
        for name in commands:
            # "worker@1" names every rank of replica 1's group ("worker-0@1", "worker-1@1").
            commands[name] = commands[name] + list(self.process_args.get(_without_rank(name), []))
        return commands

    def ports(self) -> list[tuple[int, int]]:
        """(scheduler port, worker port) of each replica."""
        extra = self.replica_ports or [(self.scheduler_port + 2 * i, self.worker_port + 2 * i)
                                       for i in range(1, self.dp_size)]
        if len(extra) < self.dp_size - 1:
            raise ValueError(f"dp_size {self.dp_size} needs {self.dp_size - 1} replica_ports, got {len(extra)}")
        return [(self.scheduler_port, self.worker_port), *extra[: self.dp_size - 1]]


def _serving(stub) -> bool:
    try:
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _without_rank(process_name: str) -> str:
    service, _, replica = process_name.partition("@")
    return service.split("-")[0] + (f"@{replica}" if replica else "")


def service_of(process_name: str) -> str:
    """"worker-1@2" -> "worker": the service a local cluster's process runs."""
    return process_name.split("@")[0].split("-")[0]


class LocalCluster:
    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.processes: dict[str, subprocess.Popen] = {}
        self._private_dir: tempfile.TemporaryDirectory | None = None
        self.credentials: ClusterCredentials | None = spec.credentials
        if not spec.insecure and self.credentials is None:
            # mkdtemp's directory is 0700: only this user can read the keys.
            self._private_dir = tempfile.TemporaryDirectory(prefix="llmserve-credentials-")
            self.credentials = write_credentials(Path(self._private_dir.name), keep_ca_key=False)

    @property
    def router_address(self) -> str:
        return f"localhost:{self.spec.router_port}"

    @property
    def http_url(self) -> str | None:
        """The OpenAI-compatible API's base URL (https unless insecure), or None when off."""
        if not self.spec.http_port:
            return None
        return f"{'http' if self.spec.insecure else 'https'}://localhost:{self.spec.http_port}/v1"

    @property
    def scheduler_address(self) -> str:
        return f"localhost:{self.spec.scheduler_port}"

    @property
    def scheduler_addresses(self) -> list[str]:
        """Every replica's scheduler, replica 0 first."""
        return [f"localhost:{scheduler_port}" for scheduler_port, _ in self.spec.ports()]

    @property
    def worker_address(self) -> str:
        return f"localhost:{self.spec.worker_port}"

    # --- talking to it: the credentials each hop wants ---------------------------------

    @property
    def api_key(self) -> str | None:
        return None if self.credentials is None else self.credentials.api_key

    @property
    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """The router's call metadata for a channel made without the key."""
        return () if self.api_key is None else (("authorization", f"Bearer {self.api_key}"),)

    def credentials_for(self, service: str = ROUTER, api_key: bool = True):
        """Channel credentials for calling `service` as its natural caller does: the
        router as a public client (the CA, the API key unless `api_key=False`); the
        scheduler with the router's certificate; a worker with the scheduler's. None
        when the cluster is insecure."""
        c = self.credentials
        if c is None:
            return None
        if service == ROUTER:
            return channel_credentials(c.ca, api_key=c.api_key if api_key else None)
        caller = ROUTER if service == SCHEDULER else SCHEDULER
        return channel_credentials(c.ca, c.cert(caller), c.key(caller))

    def address(self, service: str, replica: int = 0) -> str:
        if service == ROUTER:
            return self.router_address
        scheduler_port, worker_port = self.spec.ports()[replica]
        return f"localhost:{scheduler_port if service == SCHEDULER else worker_port}"

    def channel(self, service: str = ROUTER, api_key: bool = True, replica: int = 0) -> grpc.aio.Channel:
        """An asyncio channel to `service` (of data-parallel `replica`; see credentials_for)."""
        creds = self.credentials_for(service, api_key)
        if creds is None:
            return grpc.aio.insecure_channel(self.address(service, replica))
        return grpc.aio.secure_channel(self.address(service, replica), creds)

    def client(self, **kwargs):
        """An LLMServeClient for the router, with this cluster's CA and API key."""
        from llmserve.client import LLMServeClient

        if self.credentials is None:
            return LLMServeClient(self.router_address, insecure=True, **kwargs)
        return LLMServeClient(self.router_address, tls_ca=self.credentials.ca, api_key=self.api_key, insecure=False,
                              **kwargs)

    def start(self, timeout_s: float = 600.0) -> "LocalCluster":
        for name in self.spec.commands(self.credentials):
            self.spawn(name)
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def spawn(self, name: str) -> subprocess.Popen:
        """Starts (or restarts) one service; its stderr is appended to its log."""
        stderr = None
        if self.spec.log_dir is not None:
            self.spec.log_dir.mkdir(parents=True, exist_ok=True)
            stderr = open(self.spec.log_dir / f"{name}.log", "ab")
        cmd = self.spec.commands(self.credentials)[name]
        env = dict(os.environ, **self.spec.service_env.get(service_of(name), {}))
        workers = self.spec.tp_size * self.spec.pp_size * self.spec.dp_size
        if service_of(name) == "worker" and workers > 1 and "OMP_NUM_THREADS" not in env:
            # NOTE: ranks and replicas share this host's cores; don't oversubscribe them.
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
        self.processes[name] = subprocess.Popen(cmd, env=env, stderr=stderr, stdin=subprocess.DEVNULL)
        return self.processes[name]

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        creds = self.credentials_for(ROUTER)
        channel = grpc.insecure_channel(self.router_address) if creds is None else \
            grpc.secure_channel(self.router_address, creds)
        with channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                for name, proc in self.processes.items():
                    if proc.poll() is not None:
                        where = "its log" if self.spec.log_dir is not None else "its error is above"
                        raise StartupError(f"the {name} exited with code {proc.returncode} during start-up"
                                           + self._log_hint(name), f"{where}; --log-level DEBUG shows the "
                                                                   f"traceback")
                if _serving(stub) and all(self._scheduler_serving(a) for a in self.scheduler_addresses[1:]):
                    return
                if time.monotonic() > deadline:
                    raise StartupError(f"the cluster was not ready after {timeout_s:.0f} s",
                                       "--startup-timeout sets how long to wait")
                time.sleep(0.25)

    def _scheduler_serving(self, address: str) -> bool:
        """A replica's scheduler has its worker (the router serves once any replica does)."""
        creds = self.credentials_for(SCHEDULER)
        channel = grpc.insecure_channel(address) if creds is None else grpc.secure_channel(address, creds)
        with channel:
            return _serving(health_pb2_grpc.HealthStub(channel))

    def _log_hint(self, name: str) -> str:
        if self.spec.log_dir is None:
            return ""
        path = self.spec.log_dir / f"{name}.log"
        tail = path.read_text(errors="replace")[-3000:] if path.exists() else ""
        return f"\n--- {path} (tail) ---\n{tail}"

    def stop(self, timeout_s: float | None = None) -> dict[str, int]:
        """SIGTERM to every child (they drain in parallel: the router refuses new calls,
        the scheduler finishes its requests, the worker executes until the scheduler is
        done); SIGKILL whatever is left after `timeout_s`. Returns the exit codes."""
        if timeout_s is None:
            timeout_s = self.spec.shutdown_timeout_s + 15.0
        # Router first, so clients stop arriving; then the engines; the workers last.
        order = {"router": 0, "scheduler": 1, "worker": 2}
        for name in sorted(self.processes, key=lambda n: (order[service_of(n)], n)):
            proc = self.processes.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        codes = {}
        for name, proc in self.processes.items():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.error("%s did not exit within %.0f s of SIGTERM: killing it", name, timeout_s)
                proc.kill()
                proc.wait()
            codes[name] = proc.returncode
        if self._private_dir is not None:  # The throwaway keys go with the cluster.
            self._private_dir.cleanup()
        return codes

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# Settings a process of a local cluster gets from the launcher itself, not from the user.
_PER_PROCESS = ("host", "port", "metrics-port", "health-port", "shutdown-timeout")
_WORKER_ADDRESSING = ("scheduler", "advertise-host", "register-timeout", "rank", "dist-init", "dist-timeout")
# Credentials come from ClusterSpec too (a throwaway set, or --insecure for none).
_CREDENTIALS = ("tls-cert", "tls-key", "tls-ca", "api-key", "api-key-file")
_SECURITY = _CREDENTIALS + ("insecure",)
# The router's model and scheduler address come from ClusterSpec, like everyone's addresses.
# `up` keeps the router's --insecure: one flag for the whole cluster.
_ROUTER_SET_BY_LAUNCHER = _PER_PROCESS + _CREDENTIALS + ("scheduler", "model", "served-model-name", "http-port")


@dataclass(frozen=True)
class EngineSettings:
    """What an engine is built from, in process or as a local cluster: the worker's model
    and runner settings and the scheduler's, as the services declare them."""

    worker: WorkerConfig = group(WorkerConfig, skip=_PER_PROCESS + _SECURITY + _WORKER_ADDRESSING)
    scheduler: SchedulerServiceConfig = group(SchedulerServiceConfig, skip=_PER_PROCESS + _SECURITY + (
        "log-stats-interval", "step-timeout"))

    @property
    def scheduling(self) -> SchedulerConfig:
        return self.scheduler.scheduling

    def scheduler_argv(self) -> list[str]:
        return to_argv(self.scheduler, skip=_PER_PROCESS + _SECURITY)

    def worker_argv(self) -> list[str]:
        """The worker's runner flags (ClusterSpec adds the model, the launcher the group's shape)."""
        return to_argv(self.worker, skip=_PER_PROCESS + _SECURITY + _WORKER_ADDRESSING + (
            "tp-size", "pp-size", "model", "served-model-name"))


@dataclass(frozen=True)
class UpConfig:
    """`llmserve up`: every setting of the three services, but those the launcher sets
    per process (addresses, ranks), plus the cluster's own."""

    engine: EngineSettings = group(EngineSettings)
    router: RouterConfig = group(RouterConfig, skip=_ROUTER_SET_BY_LAUNCHER)
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


def metrics_port_owners(dp_size: int) -> list[str]:
    """Who serves metrics on --metrics-port + 0, 1, 2, ...: the router, then each replica's
    scheduler and worker."""
    if dp_size == 1:
        return ["router", "scheduler", "worker"]
    return ["router", *[f"{s}@{i}" for i in range(dp_size) for s in ("scheduler", "worker")]]


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

    worker = config.engine.worker
    check_ports_free(config)
    model_dir = resolve_model_dir(worker.model)  # Convert the default model once, before the children race.
    check_model_dir(model_dir)  # A model the worker cannot load fails here, in a line, before any process starts.
    ops = {name: ["--shutdown-timeout", str(config.shutdown_timeout)] for name in ("router", "scheduler", "worker")}
    metrics = {}
    if config.metrics_port:
        metrics = {name: ["--metrics-port", str(config.metrics_port + offset)]
                   for offset, name in enumerate(metrics_port_owners(config.dp_size))}
    spec = ClusterSpec(model_dir=model_dir, router_port=config.port, http_port=config.http_port,
                       scheduler_port=config.scheduler_port,
                       worker_port=config.worker_port, model_name=worker.served_model_name,
                       scheduler_args=config.engine.scheduler_argv() + ops["scheduler"],
                       worker_args=config.engine.worker_argv() + ops["worker"],
                       router_args=to_argv(config.router, skip=_ROUTER_SET_BY_LAUNCHER + ("insecure",)) + ops["router"],
                       shutdown_timeout_s=config.shutdown_timeout, log_level=log_level,
                       tp_size=worker.tp_size, pp_size=worker.pp_size, insecure=config.router.security.insecure,
                       dp_size=config.dp_size, process_args=metrics)
    config.router.security.warn_if_insecure("the local cluster (router, scheduler and worker)")
    cluster = LocalCluster(spec)
    # Ctrl-C reaches the whole foreground process group; the children shut down on it
    # by themselves, and stop() below makes sure none is left behind. SIGTERM reaches
    # this process only: it becomes KeyboardInterrupt, and stop() passes it on.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        cluster.start(timeout_s=config.startup_timeout)
        logger.info("cluster ready: router at %s (Ctrl-C stops it)", cluster.router_address)
        if cluster.http_url:
            logger.info("OpenAI-compatible API at %s", cluster.http_url)
        if cluster.credentials is not None:
            c = cluster.credentials
            logger.info("TLS CA certificate: %s; API key file: %s (removed when the cluster stops). Connect with "
                        "LLMSERVE_TLS_CA=%s LLMSERVE_API_KEY=$(cat %s) llmserve generate ...", c.ca, c.api_key_file,
                        c.ca, c.api_key_file)
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


def _run_up(config: UpConfig) -> int:
    return run_local_cluster(config, logging.getLevelName(logging.getLogger().getEffectiveLevel()))


COMMAND = Command("up", "start router, scheduler and worker on localhost", UpConfig, _run_up)


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
