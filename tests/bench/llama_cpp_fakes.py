"""What the llama.cpp tests stand in for llama-server with (fake_llama_server.py), and
what they look at it through."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from llmserve.bench.llama_server import ServerSettings, server_command

FAKE_SERVER = Path(__file__).with_name("fake_llama_server.py")


def fake_command(tmp_path: Path, port: int) -> list[str]:
    """llama-server's command line for 2 slots of 64 tokens, 1 thread, run by the stand-in."""
    return [sys.executable, str(FAKE_SERVER),
            *server_command(Path("llama-server"), tmp_path / "m.gguf", port, ServerSettings(2, 64, 1))[1:]]


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
