"""A service started by a launcher (LocalCluster) stops when the launcher is gone, even
killed with SIGKILL (contract/parent_watch.py); one started by hand is not watched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from llmserve.contract.parent_watch import EXIT_WITH_PARENT_ENV

# A launcher in miniature: starts a scheduler as LocalCluster does, prints its pid, waits.
LAUNCHER = """
import os, subprocess, sys, time
env = dict(os.environ, {env}=str(os.getpid()) if {watched} else "")
child = subprocess.Popen([sys.executable, "-m", "llmserve.cli", "scheduler", "--insecure", "--port", "0"], env=env,
                         stdin=subprocess.DEVNULL, stderr=open({log!r}, "wb"))
print(child.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    """Running (an orphan's zombie, which a container's init may never reap, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _orphan_after_launcher_killed(tmp_path: Path, watched: bool) -> tuple[int, str]:
    log = tmp_path / "scheduler.log"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER.format(env=EXIT_WITH_PARENT_ENV, watched=watched,
                                                                       log=str(log))],
                                stdout=subprocess.PIPE, text=True)
    pid = int(launcher.stdout.readline())
    deadline = time.monotonic() + 60
    while "listening" not in log.read_text(errors="replace") and time.monotonic() < deadline:
        time.sleep(0.2)  # (started and serving: its event loop runs the watch)
    launcher.kill()
    launcher.wait()
    return pid, str(log)


def test_a_launchers_service_stops_when_the_launcher_is_killed(tmp_path):
    pid, log = _orphan_after_launcher_killed(tmp_path, watched=True)
    deadline = time.monotonic() + 20
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = _alive(pid)
    if alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, Path(log).read_text()[-2000:]
    assert "is gone: stopping" in Path(log).read_text()


def test_a_service_started_by_hand_is_not_watched(tmp_path):
    pid, log = _orphan_after_launcher_killed(tmp_path, watched=False)
    try:
        time.sleep(3)  # (three polls' worth)
        assert _alive(pid), Path(log).read_text()[-2000:]
    finally:
        os.kill(pid, signal.SIGTERM)


def test_local_cluster_names_itself_to_what_it_spawns(monkeypatch, tmp_path):
    from llmserve.launcher import cluster as cluster_module

    seen = []
    monkeypatch.setattr(cluster_module.subprocess, "Popen", lambda cmd, env, **kw: seen.append(env) or object())
    spec = cluster_module.ClusterSpec(model_dir=tmp_path, router_port=1, scheduler_port=2, worker_port=3,
                                      insecure=True)
    cluster_module.LocalCluster(spec).spawn("scheduler")
    assert seen and seen[0][EXIT_WITH_PARENT_ENV] == str(os.getpid())
