"""The services' event loop (llmserve/contract/event_loop.py): uvloop's unless
LLMSERVE_EVENT_LOOP says asyncio; a value naming neither stops the service with its name.
Each case in a fresh interpreter, as a service starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from llmserve.contract.event_loop import ENV

SCRIPT = """
import asyncio
from llmserve.contract.grpc_server import run_until_signal
seen = []
async def serve(config, stop):
    seen.append(type(asyncio.get_running_loop()).__module__)
print(run_until_signal(serve, None), seen[0] if seen else "-")
"""


@pytest.mark.parametrize("value,code,loop_module", [(None, "0", "uvloop"), ("uvloop", "0", "uvloop"),
                                                    ("asyncio", "0", "asyncio.unix_events"), ("tokio", "2", "-")])
def test_a_service_runs_on_the_loop_it_is_told(value, code, loop_module):
    env = {k: v for k, v in os.environ.items() if k != ENV} | ({ENV: value} if value else {})
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.split() == [code, loop_module], out.stderr
    if code == "2":
        assert f"{ENV}='tokio'" in out.stderr and "uvloop, asyncio" in out.stderr
