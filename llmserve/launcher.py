"""A local cluster: router, scheduler and worker as three processes on localhost.

Used by `llmserve up` and by the end-to-end tests. Each child is the same
`llmserve <service>` command that docker-compose or Kubernetes would run.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ClusterSpec:
    model_dir: Path
    router_port: int = 50051
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
    # Environment variables for one service's processes on top of this process's own:
    # {"router" | "scheduler" | "worker": {name: value}} ("worker": every rank of a group).
    service_env: dict[str, dict[str, str]] = field(default_factory=dict)

    def commands(self) -> dict[str, list[str]]:
        base = [sys.executable, "-m", "llmserve.cli", "--log-level", self.log_level]
        model = ["--model", str(self.model_dir)]
        if self.model_name:
            model += ["--served-model-name", self.model_name]
        scheduler_addr = f"localhost:{self.scheduler_port}"
        worker = base + ["worker", *model, "--host", "127.0.0.1", "--scheduler", scheduler_addr, *self.worker_args]
        commands = {
            "scheduler": base + ["scheduler", "--host", "127.0.0.1", "--port", str(self.scheduler_port),
                                 *self.scheduler_args],
        }
        world = self.tp_size * self.pp_size
        if world == 1:
            commands["worker"] = worker + ["--port", str(self.worker_port)]
        else:
            if self.dist_port is None:
                self.dist_port = free_port()
            for rank in range(world):  # rank 0 on worker_port, the others on free ports
                commands[f"worker-{rank}"] = worker + [
                    "--port", str(self.worker_port if rank == 0 else 0), "--tp-size", str(self.tp_size),
                    "--pp-size", str(self.pp_size), "--rank", str(rank),
                    "--dist-init", f"tcp://127.0.0.1:{self.dist_port}"]
        commands["router"] = base + ["router", *model, "--host", "127.0.0.1", "--port", str(self.router_port),
                                     "--scheduler", scheduler_addr, *self.router_args]
        return commands


class LocalCluster:
    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.processes: dict[str, subprocess.Popen] = {}

    @property
    def router_address(self) -> str:
        return f"localhost:{self.spec.router_port}"

    @property
    def scheduler_address(self) -> str:
        return f"localhost:{self.spec.scheduler_port}"

    def start(self, timeout_s: float = 600.0) -> "LocalCluster":
        for name in self.spec.commands():
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
        cmd = self.spec.commands()[name]
        env = dict(os.environ, **self.spec.service_env.get(name.split("-")[0], {}))
        world = self.spec.tp_size * self.spec.pp_size
        if name.startswith("worker-") and "OMP_NUM_THREADS" not in env:
            # NOTE: ranks of one group share this host's cores; don't oversubscribe them.
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world))
        self.processes[name] = subprocess.Popen(cmd, env=env, stderr=stderr, stdin=subprocess.DEVNULL)
        return self.processes[name]

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.router_address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                for name, proc in self.processes.items():
                    if proc.poll() is not None:
                        raise RuntimeError(f"{name} exited with code {proc.returncode} during start-up"
                                           + self._log_hint(name))
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"cluster not ready after {timeout_s:.0f} s")
                time.sleep(0.25)

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
        # Router first, so clients stop arriving; then the engine; the worker last.
        workers = sorted(n for n in self.processes if n.startswith("worker"))
        for name in ("router", "scheduler", *workers):
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
        return codes

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def scheduler_flags(args) -> list[str]:
    """The scheduler's command-line flags back from parsed ones (`llmserve up`, and the
    clusters `llmserve bench` launches)."""
    flags = ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--preemption-mode", args.preemption_mode, "--stream-interval", str(args.stream_interval),
             "--num-scheduler-steps", str(args.num_scheduler_steps)]
    return flags + ["--no-chunked-prefill"] * args.no_chunked_prefill + ["--no-prefix-caching"] * args.no_prefix_caching


def run_local_cluster(args) -> int:
    """`llmserve up`: start the cluster, answer --prompt if given, else serve until Ctrl-C."""
    from llmserve.model_store import resolve_model_dir

    model_dir = resolve_model_dir(args.model)  # Convert the default model once, before the children race.
    scheduler_args = scheduler_flags(args)
    worker_args = ["--dtype", args.dtype, "--block-size", str(args.block_size),
                   "--attention-backend", args.attention_backend, "--swap-space", str(args.swap_space),
                   "--gpu-memory-utilization", str(args.gpu_memory_utilization),
                   "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.kv_cache_memory is not None:
        worker_args += ["--kv-cache-memory", str(args.kv_cache_memory)]
    if args.num_kv_blocks is not None:
        worker_args += ["--num-kv-blocks", str(args.num_kv_blocks)]
    if args.max_model_len is not None:
        worker_args += ["--max-model-len", str(args.max_model_len)]
    ops = {"router": [], "scheduler": [], "worker": []}
    for offset, name in enumerate(ops):
        ops[name] += ["--shutdown-timeout", str(args.shutdown_timeout)]
        if args.metrics_port:
            ops[name] += ["--metrics-port", str(args.metrics_port + offset)]
    scheduler_args += ops["scheduler"]
    worker_args += ops["worker"]
    spec = ClusterSpec(router_args=ops["router"], shutdown_timeout_s=args.shutdown_timeout,model_dir=model_dir, router_port=args.port, scheduler_port=args.scheduler_port,
                       worker_port=args.worker_port, model_name=args.served_model_name,
                       scheduler_args=scheduler_args, worker_args=worker_args, log_level=args.log_level,
                       tp_size=args.tp_size, pp_size=args.pp_size)
    cluster = LocalCluster(spec)
    # Ctrl-C reaches the whole foreground process group; the children shut down on it
    # by themselves, and stop() below makes sure none is left behind. SIGTERM reaches
    # this process only: it becomes KeyboardInterrupt, and stop() passes it on.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        cluster.start(timeout_s=args.startup_timeout)
        logger.info("cluster ready: router at %s (Ctrl-C stops it)", cluster.router_address)
        if args.prompt is not None:
            return asyncio.run(_answer(cluster.router_address, args.prompt, args.max_tokens))
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


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


async def _answer(target: str, prompt: str, max_tokens: int) -> int:
    from llmserve.client import LLMServeClient

    print(f">>> {prompt}", flush=True)
    async with LLMServeClient(target) as client:
        async for delta in client.generate(messages=[{"role": "user", "content": prompt}],
                                           max_tokens=max_tokens, temperature=0.0):
            print(delta.text, end="", flush=True)
    print(flush=True)
    return 0
