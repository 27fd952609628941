"""The local cluster's command lines (launcher/cluster.py) and `up`'s start-up lines, without
starting a process: each process's typed config is rendered as flags once, and the flags
give back exactly that config."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from llmserve.certs import ClusterCredentials
from llmserve.cli import build_parser, load_commands
from llmserve.launcher.cluster import ClusterSpec, LocalCluster
from llmserve.launcher.up import UpConfig, cluster_spec, startup_lines
from llmserve.settings import resolve

UP_FLAGS = ["--max-num-seqs", "7", "--dtype", "bfloat16", "--kv-cache-memory", "1GiB", "--metrics-port", "9000",
            "--shutdown-timeout", "5", "--routing-policy", "round-robin", "--served-model-name", "tiny",
            "--no-prefix-caching", "--dp-size", "2", "--tp-size", "2", "--stream-interval", "4",
            "--max-message-bytes", "8MiB", "--http-port", "8123"]


def up_spec(argv: list[str], model_dir: Path = Path("/models/tiny")) -> ClusterSpec:
    args = build_parser().parse_args(["up", *argv])
    return cluster_spec(resolve(UpConfig, args, environ={}), model_dir)


def service_config(command: list[str]):
    """A child's command line -> the config its service resolves from it (no environment)."""
    commands = load_commands()
    args = build_parser(commands).parse_args(command[command.index("--log-level") + 2:])
    return resolve(commands[args.command].config, args, environ={})


@pytest.mark.parametrize("insecure", [False, True])
def test_every_command_line_gives_back_its_process_config(insecure):
    spec = up_spec(UP_FLAGS + (["--insecure"] if insecure else []))
    credentials = None if insecure else ClusterCredentials(Path("/creds"))
    configs = spec.process_configs(credentials)
    commands = spec.commands(credentials)
    assert list(commands) == ["scheduler@0", "worker-0@0", "worker-1@0", "scheduler@1", "worker-0@1", "worker-1@1",
                              "router"]
    for name, command in commands.items():
        assert service_config(command) == configs[name], name


def test_the_cluster_assigns_addresses_ranks_and_credentials():
    spec = up_spec(UP_FLAGS)
    configs = spec.process_configs(ClusterCredentials(Path("/creds")))
    router, worker = configs["router"], configs["worker-1@1"]
    assert (router.model, router.served_model_name, router.server.port, router.http_port) == \
        ("/models/tiny", "tiny", 50051, 8123)
    assert router.scheduler_address == "localhost:50052,localhost:50054"
    assert router.routing_policy == "round-robin" and router.api.api_key_file == Path("/creds/api-key")
    assert (worker.scheduler_address, worker.rank, worker.server.port, worker.tp_size) == ("localhost:50054", 1, 0, 2)
    assert worker.security.tls_cert == Path("/creds/worker.crt") and worker.security.insecure is False
    assert worker.runner.kv_cache_memory == 2**30 and worker.runner.max_num_seqs == 7
    # Metrics: the router, then each replica's scheduler and worker group, on consecutive ports.
    assert [configs[n].server.metrics_port for n in ("router", "scheduler@0", "worker-0@0", "worker-1@0",
                                                      "scheduler@1", "worker-0@1")] == [9000, 9001, 9002, 9002,
                                                                                        9003, 9004]
    assert {c.server.shutdown_timeout for c in configs.values()} == {5.0}
    assert configs["scheduler@1"].stream_interval == 4


def test_assigned_settings_are_flags_even_at_their_default():
    """An LLMSERVE_* variable in the launcher's environment reaches every child: what the
    cluster assigns must be on the command line, where it wins over the environment."""
    spec = ClusterSpec(model_dir=Path("/m"))
    commands = spec.commands(ClusterCredentials(Path("/creds")))
    worker = commands["worker"]
    for flag in ("--model", "--host", "--port", "--scheduler", "--no-insecure", "--shutdown-timeout"):
        assert flag in worker, flag
    assert worker[worker.index("--port") + 1] == "50053"  # The worker's declared default, still given.
    assert "--http-port" in commands["router"] and "--no-insecure" in commands["scheduler"]
    # Extra flags of tests come after the rendered ones: argparse keeps the last.
    spec.worker_args = ["--port", "6000"]
    assert service_config(spec.commands(ClusterCredentials(Path("/creds")))["worker"]).server.port == 6000


def test_a_restarted_process_gets_the_same_command_line():
    """A TP group's rendezvous port is chosen when the commands are made: a rank that is
    restarted must find its group's port again, in every replica."""
    spec = ClusterSpec(model_dir=Path("/m"), tp_size=2, dp_size=2, insecure=True)
    cluster = LocalCluster(spec)
    first = cluster.commands
    assert cluster.commands is first
    dist = {name: cmd[cmd.index("--dist-init") + 1] for name, cmd in first.items() if "--dist-init" in cmd}
    assert dist["worker-0@1"] == dist["worker-1@1"] != dist["worker-0@0"] == dist["worker-1@0"]


def test_startup_logs_one_readable_line_per_service():
    spec = up_spec(UP_FLAGS)
    lines = startup_lines(spec)
    assert len(lines) == 3 and all(len(line) < 250 for line in lines), lines
    router, scheduler, worker = lines
    assert router.startswith("router: model tiny, port 50051, HTTP port 8123, metrics port 9000")
    assert "routing round-robin" in router and router.endswith("TLS + API key")
    assert scheduler.startswith("scheduler x 2 replicas: port 50052, 50054, metrics port 9001, 9003")
    assert "max-num-seqs 7" in scheduler and scheduler.endswith("mutual TLS")
    assert worker.startswith("worker x 2 replicas: model /models/tiny, device auto, dtype bfloat16")
    assert "tp 2 x pp 1, port 50053, 50055, metrics port 9002, 9004" in worker
    insecure = startup_lines(replace(spec, insecure=True))
    assert insecure[0].endswith("plaintext, no API key (--insecure)") and insecure[1].endswith("(--insecure)")
