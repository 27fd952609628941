"""CLI flags: sizes, environment-variable defaults, and every service command parses."""

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

import pytest

from llmserve.cli import build_parser, load_commands, main
from llmserve.launcher.cluster import ClusterSpec
from llmserve.launcher.engine_settings import EngineSettings
from llmserve.launcher.up import UpConfig
from llmserve.scheduler.config import SchedulerServiceConfig
from llmserve.settings import Command, SettingsError, options, parse_bytes, resolve, setting, to_argv
from llmserve.worker.config import WorkerConfig


def parse(argv: list[str]):
    """argv -> the command's resolved config, as `llmserve` builds it."""
    args = build_parser().parse_args(argv)
    return resolve(load_commands()[args.command].config, args, file=args.config)


def launched_flags(engine: EngineSettings) -> dict[str, list[str]]:
    """The flags a local cluster gives each process of an engine of these settings (what
    follows `llmserve ... <service>` on its command line)."""
    spec = ClusterSpec(model_dir=Path("m"), scheduler=engine.scheduler, worker=engine.worker, insecure=True)
    return {name: command[command.index(name) + 1:] for name, command in spec.commands().items()}


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("512MB") == 512_000_000
    assert parse_bytes("1000") == 1000
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("lots")


def test_environment_variables_set_defaults_and_flags_win(monkeypatch):
    monkeypatch.setenv("LLMSERVE_KV_CACHE_MEMORY", "1GiB")
    monkeypatch.setenv("LLMSERVE_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("LLMSERVE_NO_CHUNKED_PREFILL", "true")
    worker = parse(["worker"])
    assert worker.runner.kv_cache_memory == 2**30
    scheduler = parse(["scheduler"])
    assert scheduler.scheduling.max_num_seqs == 7 and scheduler.scheduling.enable_chunked_prefill is False
    assert parse(["scheduler", "--max-num-seqs", "9"]).scheduling.max_num_seqs == 9
    assert parse(["scheduler", "--chunked-prefill"]).scheduling.enable_chunked_prefill is True
    monkeypatch.setenv("LLMSERVE_MAX_NUM_SEQS", "many")
    with pytest.raises(SettingsError, match="LLMSERVE_MAX_NUM_SEQS"):
        parse(["scheduler"])


@pytest.mark.parametrize("argv", [["up"], ["router"], ["scheduler"], ["worker"], ["generate", "hi"]])
def test_every_command_parses_with_defaults(argv):
    args = build_parser().parse_args(argv)
    assert args.command == argv[0]


@pytest.mark.parametrize("command,config_cls", [("up", UpConfig), ("scheduler", SchedulerServiceConfig),
                                                ("worker", WorkerConfig)])
def test_defaults_and_help_come_from_the_declaration(command, config_cls, capsys):
    """Nothing given: the config is the dataclass's own defaults; --help shows every
    setting with its default and its environment variable."""
    assert parse([command]) == config_cls()
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for opt in options(config_cls):
        assert f"--{opt.name}" in text and f"(default: {opt.shown_default}; env {opt.env})" in text, opt.name


@pytest.mark.parametrize("front", [["up"], ["bench", "serve"], ["bench", "throughput"]])
def test_scheduler_flags_reach_the_launched_scheduler_unchanged(front):
    from llmserve.bench.cli import BenchSettings

    given = ["--max-num-seqs", "7", "--max-num-batched-tokens", "300", "--no-chunked-prefill",
             "--no-prefix-caching", "--preemption-mode", "swap", "--stream-interval", "4",
             "--num-scheduler-steps", "8"]
    args = build_parser().parse_args(front + given)
    outer = resolve(UpConfig if front == ["up"] else BenchSettings, args).engine
    flags = launched_flags(outer)
    inner = parse(["scheduler", *flags["scheduler"]])
    for name in ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "enable_prefix_caching",
                 "preemption_mode", "num_scheduler_steps"):
        assert getattr(inner.scheduling, name) == getattr(outer.scheduling, name) \
            != getattr(SchedulerServiceConfig().scheduling, name), name
    assert inner.stream_interval == outer.scheduler.stream_interval == 4
    # The same budget sizes the worker's profiling forward.
    worker = parse(["worker", *flags["worker"]]).runner
    assert worker.max_num_batched_tokens == 300
    # ... and the step limit bounds the decode batches the worker captures as CUDA graphs.
    assert worker.max_num_seqs == 7
    for flag in ("--stream-interval", "--num-scheduler-steps"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["scheduler", flag, "0"])


def test_to_argv_round_trips_every_worker_setting():
    config = parse(["worker", "--dtype", "bfloat16", "--kv-cache-memory", "3MiB", "--swap-space", "0.5",
                    "--max-model-len", "77", "--tp-size", "2", "--rank", "1", "--served-model-name", "m"])
    assert config.runner.swap_space == 2**29 and config.runner.kv_cache_memory == 3 * 2**20
    assert parse(["worker", *to_argv(config)]) == config


def test_device_settings_reach_the_launched_worker():
    args = build_parser().parse_args(["up", "--device", "cuda", "--dtype", "float16", "--enforce-eager",
                                      "--gpu-memory-utilization", "0.8"])
    runner = parse(["worker", *launched_flags(resolve(UpConfig, args).engine)["worker"]]).runner
    assert (runner.device, runner.dtype, runner.enforce_eager, runner.gpu_memory_utilization) == \
        ("cuda", "float16", True, 0.8)
    assert parse(["worker"]).runner.device == "auto" and parse(["worker"]).runner.dtype == "auto"
    with pytest.raises(SystemExit):
        parse(["worker", "--device", "tpu"])


@dataclass(frozen=True)
class _Settings:
    size: int = setting(3, help="a size")


def test_a_command_with_its_own_summary_logs_the_config_only_at_debug(monkeypatch, caplog):
    """`up` logs one readable line per service itself: `llmserve` then logs the whole
    config (a 2,000-character repr) at DEBUG only; other commands still log it at INFO."""
    ran = []
    commands = {"quiet": Command("quiet", "", _Settings, ran.append, logs_config=True),
                "plain": Command("plain", "", _Settings, ran.append)}
    monkeypatch.setattr("llmserve.cli.load_commands", lambda only=None: commands)
    with caplog.at_level(logging.DEBUG):  # Every record, each at the level it was logged at.
        main(["--log-level", "INFO", "quiet", "--size", "4"])
        main(["--log-level", "INFO", "plain"])
    config_records = [(r.levelname, r.getMessage()) for r in caplog.records if r.getMessage().startswith("config:")]
    assert config_records == [("DEBUG", "config: _Settings(size=4)"), ("INFO", "config: _Settings(size=3)")]
    assert [c.size for c in ran] == [4, 3]


@pytest.mark.parametrize("argv,name", [
    (["scheduler", "--port", "1"], "scheduler"),
    (["--log-level", "DEBUG", "worker"], "worker"),
    (["--log-level=DEBUG", "up", "--prompt", "x"], "up"),
    (["--help"], None),
    ([], None),
])
def test_requested_command_is_the_first_positional_word(argv, name):
    from llmserve.cli import requested_command

    assert requested_command(argv) == name


def test_a_service_command_imports_no_other_distribution():
    """`llmserve scheduler` loads the scheduler's entry point only: loading every
    installed command would import bench and the worker (torch) into the scheduler."""
    import subprocess
    import sys

    code = ("import sys\nfrom llmserve.cli import main\n"
            "try:\n    main(['scheduler', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('llmserve.bench', "
            "'llmserve.worker', 'llmserve.launcher'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
