"""One llama.cpp `llama-server` process for the length of a benchmark run: its command
line, starting it on a free port, waiting until /health says it has loaded its model, and
stopping it (SIGTERM, then SIGKILL) whatever happens in between, Ctrl-C included."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

# Loading the largest of our GGUFs (the F32 one) takes seconds; a minute or more means
# something is wrong, and waiting longer only delays the error.
STARTUP_TIMEOUT_S = 180.0
STOP_GRACE_S = 10.0
LOG_TAIL_CHARS = 3000


class LlamaServerError(RuntimeError):
    """llama-server did not start: exited, or never reported ok (the log's tail attached)."""


@dataclass(frozen=True)
class ServerSettings:
    """What llama-server is told about the workload: `slots` requests decode together
    (its continuous batching), each within `slot_context` tokens; `threads` CPU threads."""

    slots: int
    slot_context: int
    threads: int

    @property
    def context(self) -> int:
        """llama-server's -c: the KV cache of all slots together (it gives each c / np)."""
        return self.slots * self.slot_context


def server_command(binary: Path, gguf: Path, port: int, settings: ServerSettings) -> list[str]:
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(settings.slots), "-c", str(settings.context), "-t", str(settings.threads)]


def _health(url: str) -> str:
    """/health's status: "ok" once the model is loaded, "loading" (HTTP 503) before, ""
    while nothing listens yet."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return json.loads(response.read() or b"{}").get("status", "")
    except urllib.error.HTTPError as err:  # 503 while loading the model.
        return "loading" if err.code == 503 else f"HTTP {err.code}"
    except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
        return ""


class LlamaServer:
    """A context manager: `with LlamaServer(cmd) as server:` starts `cmd`, returns once
    `server.url`/health reports ok, and stops the process on the way out.

    The process's output goes to a log file of its own (a pipe nobody reads would fill
    up and stall it); its tail is in every start-up error."""

    def __init__(self, command: list[str], port: int, startup_timeout_s: float = STARTUP_TIMEOUT_S,
                 stop_grace_s: float = STOP_GRACE_S, env: dict[str, str] | None = None):
        self.command = command
        self.url = f"http://127.0.0.1:{port}"
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.env = env
        self.process: subprocess.Popen | None = None
        self._log_dir: tempfile.TemporaryDirectory | None = None

    @property
    def log_path(self) -> Path:
        return Path(self._log_dir.name) / "llama-server.log"

    def log_tail(self) -> str:
        path = self.log_path
        return path.read_text(errors="replace")[-LOG_TAIL_CHARS:] if path.exists() else ""

    def __enter__(self) -> "LlamaServer":
        self._log_dir = tempfile.TemporaryDirectory(prefix="llmserve-llama-server-")
        try:
            with open(self.log_path, "wb") as log:
                self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, env={**os.environ, **(self.env or {})})
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        status = ""
        while True:
            if self.process.poll() is not None:
                raise LlamaServerError(self._failure(f"exited with code {self.process.returncode} during start-up"))
            status = _health(self.url)
            if status == "ok":
                return
            if time.monotonic() > deadline:
                raise LlamaServerError(self._failure(f"did not report ok on /health within "
                                                     f"{self.startup_timeout_s:.0f} s (last: {status or 'no answer'})"))
            time.sleep(0.2)

    def _failure(self, what: str) -> str:
        return f"llama-server {what}: {' '.join(self.command)}\n--- its log (tail) ---\n{self.log_tail()}"

    def stop(self) -> None:
        """SIGTERM, SIGKILL after `stop_grace_s`; then the log goes too. Idempotent."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(self.stop_grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log_dir is not None:
            self._log_dir.cleanup()
            self._log_dir = None
