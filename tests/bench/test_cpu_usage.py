"""The per-process CPU figures `bench serve --launch` reports come from /proc/<pid>/stat."""

from __future__ import annotations

import os
import sys
import time

import pytest

from llmserve.bench.cpu_usage import cpu_per_step, process_cpu_seconds


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_cpu_seconds_of_a_process_grow_by_the_cpu_it_burns():
    before = process_cpu_seconds(os.getpid())
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    burned = process_cpu_seconds(os.getpid()) - before
    assert 0.25 <= burned <= 0.6  # /proc counts in clock ticks (10 ms); this process also has other threads.


def test_a_gone_process_has_no_figure_and_steps_divide_the_difference():
    assert process_cpu_seconds(2**22 + 12345) is None  # Above pid_max's default: no such process.
    report = cpu_per_step({"router": 1.0, "client": 2.0}, {"router": 1.5, "client": 2.2}, num_steps=100)
    assert report["seconds"] == pytest.approx({"router": 0.5, "client": 0.2})
    assert report["ms_per_step"] == pytest.approx({"router": 5.0, "client": 2.0})
    assert cpu_per_step({"router": 1.0}, {"router": 1.5}, num_steps=0)["ms_per_step"] == {}
