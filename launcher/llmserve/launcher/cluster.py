"""A local cluster: router, scheduler and worker as processes on localhost (with
--dp-size N, N replicas of scheduler + worker group behind the one router).

Used by `llmserve up` (up.py), the end-to-end tests and the benchmarks. Each child is
the same `llmserve <service>` command that docker-compose or Kubernetes would run. Its
settings are its service's own typed config (ClusterSpec.router, .scheduler, .worker)
with the addresses, ranks and credentials the cluster assigns, rendered as flags once
(ClusterSpec.commands). Secure by default: unless the spec says `insecure`, the cluster
makes a throwaway CA, one certificate per role and an API key in a private temporary
directory (removed by stop()), and every hop runs mutual TLS.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.certs import ClusterCredentials, write_credentials
from llmserve.contract.api_keys import ApiKeyOptions
from llmserve.contract.grpc_server import ServerOptions
from llmserve.contract.parent_watch import EXIT_WITH_PARENT_ENV
from llmserve.contract.peers import ROUTER, SCHEDULER, WORKER
from llmserve.contract.security import SecurityOptions, channel_credentials
from llmserve.contract.startup_errors import StartupError
from llmserve.router.config import RouterConfig
from llmserve.scheduler.config import SchedulerServiceConfig
from llmserve.settings import to_argv
from llmserve.worker.config import WorkerConfig

logger = logging.getLogger(__name__)

# Flags rendered even at their default: the cluster assigns them, and an LLMSERVE_*
# variable in this process's environment (which the children inherit) must not move them.
ASSIGNED = ("model", "host", "port", "scheduler", "http-port", "insecure", "shutdown-timeout", "tp-size", "pp-size",
            "rank", "dist-init")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics_port_owners(dp_size: int) -> list[str]:
    """Who serves metrics on ClusterSpec.metrics_port + 0, 1, 2, ...: the router, then each
    replica's scheduler and worker group."""
    if dp_size == 1:
        return ["router", "scheduler", "worker"]
    return ["router", *[f"{s}@{i}" for i in range(dp_size) for s in ("scheduler", "worker")]]


@dataclass
class ClusterSpec:
    """What a local cluster runs. `router`, `scheduler` and `worker` are the services' own
    settings; the cluster overrides in them what it assigns per process (model directory,
    addresses, ports, ranks, credentials, drain time) and renders each process's config
    as flags once (commands())."""

    model_dir: Path
    router: RouterConfig = field(default_factory=RouterConfig)
    scheduler: SchedulerServiceConfig = field(default_factory=SchedulerServiceConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)  # Its served_model_name is the router's too.
    router_port: int = 50051
    http_port: int = 0  # The router's OpenAI-compatible HTTP API (0: off).
    scheduler_port: int = 50052
    worker_port: int = 50053
    metrics_port: int = 0  # Prometheus: metrics_port_owners()[i] on metrics_port + i (0: the configs' own).
    # Extra flags for every process of one service, after the rendered ones (tests vary a setting this way).
    scheduler_args: list[str] = field(default_factory=list)
    worker_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    shutdown_timeout_s: float = 30.0  # The children's own drain time; stop() waits a bit longer.
    log_dir: Path | None = None  # Children's stderr goes here (else inherited).
    log_level: str = "INFO"
    tp_size: int = 1  # A TP x PP group: one worker process per rank ("worker-0", "worker-1", ...).
    pp_size: int = 1
    dist_port: int | None = None  # Rendezvous port of replica 0's group (a free one when None; others: free ones).
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
    _replica_dist_ports: dict[int, int] = field(default_factory=dict, init=False, repr=False)

    def commands(self, credentials: ClusterCredentials | None = None) -> dict[str, list[str]]:
        """Each process's command line; `credentials` is required unless `insecure`."""
        base = [sys.executable, "-m", "llmserve.cli", "--log-level", self.log_level]
        extra = {ROUTER: self.router_args, SCHEDULER: self.scheduler_args, WORKER: self.worker_args}
        commands = {}
        for name, config in self.process_configs(credentials).items():
            service = service_of(name)
            # "worker@1" names every rank of replica 1's group ("worker-0@1", "worker-1@1").
            commands[name] = [*base, service, *to_argv(config, always=ASSIGNED), *extra[service],
                              *self.process_args.get(_without_rank(name), [])]
        return commands

    def process_configs(self, credentials: ClusterCredentials | None = None) -> dict[str, Any]:
        """Each process's typed config, by process name: dp 1: "scheduler", "worker" (or
        "worker-<rank>"), "router"; dp N: the same names + "@<replica>" but the router's."""
        if not self.insecure and credentials is None:
            raise ValueError("a secure cluster needs credentials (or insecure=True)")
        configs: dict[str, Any] = {}
        for replica, (scheduler_port, worker_port) in enumerate(self.ports()):
            suffix = f"@{replica}" if self.dp_size > 1 else ""
            configs["scheduler" + suffix] = replace(
                self.scheduler, server=self._server(self.scheduler.server, "scheduler" + suffix, scheduler_port),
                security=self._security(SCHEDULER, credentials))
            configs.update(self._worker_group(replica, suffix, worker_port, credentials))
        api = ApiKeyOptions() if self.insecure else ApiKeyOptions(api_key_file=credentials.api_key_file)
        configs["router"] = replace(
            self.router, model=str(self.model_dir), served_model_name=self.worker.served_model_name,
            server=self._server(self.router.server, "router", self.router_port), http_port=self.http_port,
            scheduler_address=",".join(f"localhost:{port}" for port, _ in self.ports()),
            security=self._security(ROUTER, credentials), api=api)
        return configs

    def _worker_group(self, replica: int, suffix: str, worker_port: int,
                      credentials: ClusterCredentials | None) -> dict[str, WorkerConfig]:
        """One replica's worker process, or one per rank of its TP x PP group (rank 0 on
        `worker_port`, the others on free ports)."""
        scheduler_port = self.ports()[replica][0]
        worker = replace(self.worker, model=str(self.model_dir), scheduler_address=f"localhost:{scheduler_port}",
                         security=self._security(WORKER, credentials), tp_size=self.tp_size, pp_size=self.pp_size)
        world = self.tp_size * self.pp_size
        if world == 1:
            return {"worker" + suffix: replace(worker, server=self._server(worker.server, "worker" + suffix,
                                                                           worker_port))}
        if self.dist_port is None:
            self.dist_port = free_port()
        # Chosen once per replica: every rendering (and so every rank) names the same port.
        dist_port = self._replica_dist_ports.setdefault(replica, self.dist_port if replica == 0 else free_port())
        dist_init = f"tcp://127.0.0.1:{dist_port}"
        return {f"worker-{rank}{suffix}": replace(
            worker, rank=rank, dist_init=dist_init,
            server=self._server(worker.server, "worker" + suffix, worker_port if rank == 0 else 0))
            for rank in range(world)}

    def _server(self, server: ServerOptions, owner: str, port: int) -> ServerOptions:
        """A process's listening settings: loopback, its port, its metrics port, the drain time."""
        owners = metrics_port_owners(self.dp_size)
        metrics_port = self.metrics_port + owners.index(owner) if self.metrics_port else server.metrics_port
        return replace(server, host="127.0.0.1", port=port, metrics_port=metrics_port,
                       shutdown_timeout=self.shutdown_timeout_s)

    def _security(self, role: str, credentials: ClusterCredentials | None) -> SecurityOptions:
        # insecure=False is rendered too (--no-insecure, see ASSIGNED): an LLMSERVE_INSECURE
        # in this process's environment must not turn a child insecure behind the launcher's back.
        if self.insecure:
            return SecurityOptions(insecure=True)
        return SecurityOptions(tls_cert=credentials.cert(role), tls_key=credentials.key(role), tls_ca=credentials.ca)

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
    """The processes of one ClusterSpec on this host, and how to reach them.

    start() spawns every process (router last) and waits until the router serves and
    every replica's scheduler has its worker group; stop() drains them in order (router,
    schedulers, workers) and returns their exit codes. spawn(name) restarts one process
    with the same command line (tests kill and restart workers). channel(), client() and
    credentials_for() give a caller the credentials each hop expects; with a secure spec
    and no credential set, the cluster writes a throwaway one that stop() removes. A
    context manager: `with LocalCluster(spec) as cluster: ...`.
    """

    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.processes: dict[str, subprocess.Popen] = {}
        self._commands: dict[str, list[str]] | None = None
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

    @property
    def commands(self) -> dict[str, list[str]]:
        """Each process's command line, made once: a restarted process gets the same ports
        (a group's rendezvous port among them)."""
        if self._commands is None:
            self._commands = self.spec.commands(self.credentials)
        return self._commands

    def start(self, timeout_s: float = 600.0) -> "LocalCluster":
        for name in self.commands:
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
        cmd = self.commands[name]
        env = dict(os.environ, **self.spec.service_env.get(service_of(name), {}))
        env[EXIT_WITH_PARENT_ENV] = str(os.getpid())  # Gone with this process, even SIGKILLed (parent_watch.py).
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
