"""A started service's heap: frozen out of the collector's walks, young collections spaced
out (llmserve/contract/heap.py). Each case in a fresh interpreter: freezing the test
process's heap would change every later test's collections."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from llmserve.contract.heap import YOUNG_COLLECTION_THRESHOLD

SCRIPT = """
import gc
from llmserve.contract.heap import freeze_startup_heap
before = gc.get_threshold()
kept = [[i] for i in range(1000)]  # objects alive at start-up
freeze_startup_heap()
print(before[0], gc.get_threshold()[0], gc.get_threshold()[1:] == before[1:], gc.get_freeze_count() >= 1000)
"""


def test_a_started_service_freezes_its_heap_and_spaces_young_collections():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, timeout=60)
    default, after, older_kept, frozen = out.stdout.split()
    assert int(default) < YOUNG_COLLECTION_THRESHOLD == int(after)
    assert older_kept == "True" and frozen == "True"


ENGINE_SCRIPT = """
import gc, json, sys
from pathlib import Path
from llmserve.contract.heap import freeze_startup_heap
from llmserve.contract.sampling import SamplingParams
from llmserve.launcher.engine import InProcessEngine
from llmserve.worker.config import RunnerConfig
from llmserve.worker.simulated_runner import SimulatedRunner

if sys.argv[2] == "service":
    freeze_startup_heap()
gc.set_threshold(900, 11, 12)
frozen_before = gc.get_freeze_count()
engine = InProcessEngine(SimulatedRunner(Path(sys.argv[1]), RunnerConfig(num_kv_blocks=32, block_size=4), 0.1))
seen = []
engine.run([(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0)) for i in range(2)],
           on_output=lambda out: seen.append((gc.get_threshold(), gc.get_freeze_count())))
after = [gc.get_threshold(), gc.get_freeze_count()]
print(json.dumps({"during": seen, "after": after, "frozen_before": frozen_before}))
"""


@pytest.mark.parametrize("process", ["caller", "service"])
def test_an_in_process_run_steps_with_the_services_collector_and_gives_the_callers_back(tmp_path, process):
    """InProcessEngine.run spaces young collections and keeps the caller's heap out of the
    walks while it steps; afterwards the caller's threshold is back, and its heap unfrozen
    unless something froze it before (a service or bench: that freeze stays)."""
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 100, "eos_token_id": 2,
                                                      "max_position_embeddings": 256}))
    out = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, str(tmp_path), process], capture_output=True,
                         text=True, check=True, timeout=120)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(got["during"]) == 8  # 2 requests x 4 tokens, one output each
    assert all(threshold == [YOUNG_COLLECTION_THRESHOLD, 11, 12] and frozen > 1000
               for threshold, frozen in got["during"])
    assert got["after"][0] == [900, 11, 12]
    if process == "caller":
        assert got["frozen_before"] == 0 and got["after"][1] == 0
    else:
        # Still frozen (unfrozen it would read 0; frozen objects freed meanwhile leave it).
        assert got["frozen_before"] > 1000 and got["after"][1] > got["frozen_before"] // 2
