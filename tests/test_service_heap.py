"""A started service's heap: frozen out of the collector's walks, young collections spaced
out (llmserve/contract/heap.py). Each case in a fresh interpreter: freezing the test
process's heap would change every later test's collections."""

from __future__ import annotations

import subprocess
import sys

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
