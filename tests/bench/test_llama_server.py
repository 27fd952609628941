"""llama-server's lifecycle (bench/llmserve/bench/llama_server.py), against the stand-in
llama-server of fake_llama_server.py: its command line, the wait for /health to say ok
(and the errors, with the log's tail, when it does not), and stopping it whatever
happens, SIGKILL when SIGTERM is not enough."""

from __future__ import annotations

import json
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from llmserve.bench.llama_server import LlamaServer, LlamaServerError, ServerSettings, _health, server_command
from llmserve.launcher.cluster import free_port
from tests.bench.llama_cpp_fakes import alive, fake_command, records


def test_the_server_command_line():
    cmd = server_command(Path("/b/llama-server"), Path("/m/x-q8_0.gguf"), 8123, ServerSettings(64, 448, 2))
    assert cmd == ["/b/llama-server", "-m", "/m/x-q8_0.gguf", "--host", "127.0.0.1", "--port", "8123",
                   "-np", "64", "-c", str(64 * 448), "-t", "2"]


def test_health_reads_loading_then_ok():
    """A tiny HTTP server answering as llama-server does: 503 while it loads, then ok."""
    answers = [(503, {"error": {"code": 503, "message": "Loading model"}}), (200, {"status": "ok"})]

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            code, body = answers.pop(0) if len(answers) > 1 else answers[0]
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    port = free_port()
    assert _health(f"http://127.0.0.1:{port}") == ""  # Nothing listening yet.
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert [_health(f"http://127.0.0.1:{port}") for _ in range(3)] == ["loading", "ok", "ok"]
    finally:
        server.shutdown()
        server.server_close()


def test_the_server_is_ready_only_once_health_says_ok(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_LOADING_S", "1.0")
    port = free_port()
    start = time.monotonic()
    with LlamaServer(fake_command(tmp_path, port), port) as server:
        assert time.monotonic() - start >= 1.0
        assert _health(server.url) == "ok"
        assert "2 slots, context 128, 1 threads" in server.log_tail()
    assert server.process.poll() is not None


def test_a_server_that_exits_at_start_up_reports_its_log(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_EXIT", "failed to load model 'm.gguf'")
    port = free_port()
    with pytest.raises(LlamaServerError, match="exited with code 1") as err:
        with LlamaServer(fake_command(tmp_path, port), port):
            pytest.fail("started")
    assert "failed to load model 'm.gguf'" in str(err.value)


def test_a_server_that_never_gets_ready_times_out_and_is_stopped(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_LOADING_S", "1000")
    monkeypatch.setenv("FAKE_LLAMA_RECORD", str(tmp_path / "record.jsonl"))
    port = free_port()
    with pytest.raises(LlamaServerError, match=r"did not report ok on /health within 1 s \(last: loading\)") as err:
        with LlamaServer(fake_command(tmp_path, port), port, startup_timeout_s=1.0):
            pytest.fail("started")
    assert "fake llama-server: 2 slots" in str(err.value)  # The log's tail.
    assert not alive(records(tmp_path / "record.jsonl")[0]["pid"])


def test_the_server_is_stopped_when_the_workload_raises(tmp_path):
    port = free_port()
    with pytest.raises(RuntimeError, match="the workload failed"):
        with LlamaServer(fake_command(tmp_path, port), port) as server:
            assert server.process.poll() is None
            log_dir = server.log_path.parent
            raise RuntimeError("the workload failed")
    assert server.process.returncode == -signal.SIGTERM
    assert not log_dir.exists()


def test_a_server_that_ignores_sigterm_is_killed(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_IGNORE_TERM", "1")
    port = free_port()
    with LlamaServer(fake_command(tmp_path, port), port, stop_grace_s=0.5) as server:
        pass
    assert server.process.returncode == -signal.SIGKILL
