"""A new user's mistakes, as a new user meets them: each ends in one line naming the
process, the cause and the fix, a non-zero exit code and no traceback (the traceback
only with --log-level DEBUG). Every test runs the real `llmserve` command."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from llmserve.launcher.cluster import free_port
from llmserve.worker.models.registry import supported_architectures


def start(*argv: str, debug: bool = False) -> subprocess.Popen:
    front = ["--log-level", "DEBUG"] if debug else []
    return subprocess.Popen([sys.executable, "-m", "llmserve.cli", *front, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)


def finish(proc: subprocess.Popen, timeout: float = 180) -> subprocess.CompletedProcess:
    stdout, stderr = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def llmserve(*argv: str, debug: bool = False, timeout: float = 180) -> subprocess.CompletedProcess:
    return finish(start(*argv, debug=debug), timeout)


def last_line(result: subprocess.CompletedProcess) -> str:
    return result.stderr.strip().splitlines()[-1]


def assert_one_line(argv: list[str], line: str) -> None:
    """`argv` fails with `line` as its last stderr line and no traceback; with DEBUG it
    fails the same way, the traceback included. (Both run at once: most of each is
    Python importing torch.)"""
    result, debug = map(finish, [start(*argv), start(*argv, debug=True)])
    assert result.returncode != 0, result.stderr[-2000:]
    assert last_line(result) == line, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert debug.returncode == result.returncode
    assert "Traceback (most recent call last)" in debug.stderr and line in debug.stderr.splitlines(), \
        debug.stderr[-2000:]


@contextmanager
def occupied_port():
    """A port some other process holds (a listening socket)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


MODEL_FIX = ("--model takes a local Hugging Face model directory (config.json, *.safetensors, tokenizer files), "
             "a GGUF file (or a directory holding one), or 'default' for the embedded SmolLM2-135M-Instruct")
# The registry's list, sorted (it grows with each architecture added).
ARCH_FIX = f"llmserve runs {', '.join(supported_architectures())}"


@pytest.fixture
def model_without_weights(tiny_llama_dir, tmp_path) -> Path:
    d = tmp_path / "no-weights"
    d.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", d / "config.json")
    (d / "pytorch_model.bin").write_bytes(b"")  # What an older checkpoint has instead.
    return d


@pytest.fixture
def model_of_unknown_architecture(tiny_llama_dir, tmp_path) -> Path:
    d = shutil.copytree(tiny_llama_dir, tmp_path / "gpt2")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    return d


def test_wrong_model_path(tmp_path):
    missing = tmp_path / "no-such-model"
    assert_one_line(["worker", "--insecure", "--model", str(missing), "--port", "0"],
                    f"worker: --model {missing}: no such directory ({MODEL_FIX})")
    # `up` says the same before it starts any process.
    assert_one_line(["up", "--insecure", "--model", str(missing), "--port", str(free_port())],
                    f"up: --model {missing}: no such directory ({MODEL_FIX})")


def test_directory_without_config(tmp_path):
    assert_one_line(["worker", "--insecure", "--model", str(tmp_path), "--port", "0"],
                    f"worker: --model {tmp_path} is not a Hugging Face model directory: it has no config.json "
                    f"({MODEL_FIX})")


def test_directory_without_safetensors(model_without_weights):
    assert_one_line(["worker", "--insecure", "--model", str(model_without_weights), "--port", "0"],
                    f"worker: --model {model_without_weights} has no *.safetensors weights (it has "
                    f"pytorch_model.bin) (llmserve loads safetensors checkpoints and GGUF files: save the model "
                    f"with transformers' save_pretrained(dir, safe_serialization=True), or pass a GGUF file as "
                    f"--model)")


def test_unsupported_architecture(model_of_unknown_architecture):
    d = model_of_unknown_architecture
    assert_one_line(["worker", "--insecure", "--model", str(d), "--port", "0"],
                    f"worker: --model {d}: unsupported model architecture GPT2LMHeadModel ({ARCH_FIX})")
    assert_one_line(["up", "--insecure", "--model", str(d), "--port", str(free_port())],
                    f"up: --model {d}: unsupported model architecture GPT2LMHeadModel ({ARCH_FIX})")


def test_service_port_in_use():
    with occupied_port() as port:
        assert_one_line(["scheduler", "--insecure", "--port", str(port)],
                        f"scheduler: cannot listen on 127.0.0.1:{port} for gRPC: address already in use "
                        f"(another process holds the port: stop it, or choose another with --port)")


def test_metrics_port_in_use():
    with occupied_port() as port:
        assert_one_line(["scheduler", "--insecure", "--port", "0", "--metrics-port", str(port)],
                        f"scheduler: cannot listen on 127.0.0.1:{port} for metrics: address already in use "
                        f"(another process holds the port: stop it, or choose another with --metrics-port)")


def test_up_checks_its_ports_before_loading_a_model(tmp_path):
    """A second `up` on a busy port fails at once: no process started, no model loaded
    (the model given does not even exist: the ports come first)."""
    with occupied_port() as port:
        start = time.monotonic()
        result = llmserve("up", "--model", str(tmp_path / "never-read"), "--scheduler-port", str(port))
        elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert last_line(result) == (f"up: cannot listen on 127.0.0.1:{port} for the scheduler: address already in use "
                                 f"(another process holds the port: stop it, or choose another with "
                                 f"--scheduler-port)"), result.stderr[-2000:]
    assert "[worker]" not in result.stderr and "[router]" not in result.stderr  # No child was started.
    assert "Traceback" not in result.stderr
    # Python's start and imports take most of it (~2-3 s on a busy 2-core machine).
    assert elapsed < 15, elapsed


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # As check_ports_free binds.
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@contextmanager
def occupied_port_after_two_free():
    """An occupied port p whose two ports below it are free: the metrics ports p - 2 and
    p - 1 come before p in the check, and another process holding one of them would make
    the check name that one."""
    for _ in range(50):
        with occupied_port() as port:
            if _bindable(port - 2) and _bindable(port - 1):
                yield port
                return
    pytest.fail("no occupied port with two free ports below it")


def test_port_check_itself_is_immediate():
    from llmserve.contract.startup_errors import StartupError
    from llmserve.launcher.up import UpConfig, check_ports_free

    with occupied_port_after_two_free() as port:
        start = time.monotonic()
        with pytest.raises(StartupError, match=f"127.0.0.1:{port} for the worker's metrics: address already in use"):
            check_ports_free(UpConfig(port=free_port(), scheduler_port=free_port(), worker_port=free_port(),
                                      metrics_port=port - 2))
        assert time.monotonic() - start < 0.5
    check_ports_free(UpConfig(port=free_port(), scheduler_port=free_port(), worker_port=free_port()))


def test_worker_that_cannot_reach_its_scheduler(tiny_llama_dir):
    """It says what it tried and why every few seconds, then gives up after
    --register-timeout with one line (not ~127 s of silence and DEADLINE_EXCEEDED)."""
    scheduler = f"localhost:{free_port()}"  # Nothing listens there.
    argv = ["worker", "--insecure", "--model", str(tiny_llama_dir), "--port", "0", "--scheduler", scheduler,
            "--register-timeout", "7", "--num-kv-blocks", "8", "--swap-space", "0"]
    result, debug = map(finish, [start(*argv), start(*argv, debug=True)])
    assert result.returncode != 0
    retries = [line for line in result.stderr.splitlines()
               if f"worker: cannot register with scheduler at {scheduler}: connection refused (is the scheduler "
                  f"running? --scheduler sets its address); retrying for " in line]
    assert len(retries) >= 2, result.stderr[-3000:]  # At once, then every 5 s.
    assert last_line(result) == (f"worker: cannot register with scheduler at {scheduler} after 7 s: connection "
                                 f"refused (is the scheduler running? --scheduler sets its address; "
                                 f"--register-timeout sets how long to try)"), result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "DEADLINE_EXCEEDED" not in result.stderr
    assert debug.returncode != 0 and "Traceback (most recent call last)" in debug.stderr


def test_router_with_a_model_directory_without_tokenizer(tiny_llama_dir):
    # The tiny test models carry weights and config only.
    assert_one_line(["router", "--insecure", "--model", str(tiny_llama_dir), "--port", "0", "--metrics-port", "0"],
                    f"router: cannot load a tokenizer from {tiny_llama_dir} (no tokenizer files) (the router needs "
                    f"the model's tokenizer.json (or tokenizer.model) and tokenizer_config.json beside config.json)")


def test_router_that_cannot_reach_its_scheduler():
    """The router too: says why it waits every few seconds, gives up after --connect-timeout."""
    scheduler = f"localhost:{free_port()}"  # Nothing listens there.
    result = llmserve("router", "--insecure", "--model", "default", "--port", "0", "--metrics-port", "0",
                      "--scheduler", scheduler, "--connect-timeout", "7")
    assert result.returncode != 0
    fix = "is the scheduler running? --scheduler sets its address"
    waits = [line for line in result.stderr.splitlines()
             if f"router: cannot reach the scheduler at {scheduler}: connection refused ({fix}); waiting " in line]
    assert len(waits) >= 1, result.stderr[-3000:]  # Every 5 s, from 5 s on.
    assert last_line(result) == (f"router: cannot reach the scheduler at {scheduler}: connection refused after 7 s "
                                 f"({fix}; --connect-timeout sets how long to wait)"), result.stderr[-3000:]
    assert "Traceback" not in result.stderr


def test_cli_mistake_is_one_line():
    result = llmserve("scheduler", "--max-num-seqs", "0")
    assert result.returncode == 2
    assert result.stderr.strip() == ("llmserve scheduler: argument --max-num-seqs: must be at least 1, got 0 "
                                     "(see llmserve scheduler --help)")


def test_generate_without_a_cluster():
    port = free_port()
    result = llmserve("generate", "Hi", "--target", f"localhost:{port}", "--insecure")
    assert result.returncode != 0
    assert last_line(result) == (f"generate: cannot reach the router at localhost:{port}: connection refused "
                                 f"(is `llmserve up` running? --target sets the router's address)")
    assert "Traceback" not in result.stderr


def test_generate_stops_at_256_tokens_unless_told():
    from llmserve.cli import build_parser

    assert build_parser().parse_args(["generate", "Hi"]).max_tokens == 256
    assert build_parser().parse_args(["generate", "Hi", "--max-tokens", "9"]).max_tokens == 9
