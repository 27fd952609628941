"""Fixtures that start real three-process clusters on free localhost ports."""

from __future__ import annotations

import pytest

from llmserve.launcher.cluster import ClusterSpec, LocalCluster, free_port
from llmserve.model_store import default_model_dir


@pytest.fixture(scope="session")
def model_dir():
    return default_model_dir()


# The references are transformers' float32: `--dtype auto` would serve the embedded model's
# Q4_1 as int8 or bfloat16 (worker/cpu_dtype.py). A test's own --dtype comes later and wins.
FLOAT32 = ["--dtype", "float32"]


def start_cluster(model_dir, log_dir, scheduler_args=(), worker_args=()) -> LocalCluster:
    spec = ClusterSpec(
        model_dir=model_dir,
        router_port=free_port(),
        http_port=free_port(),  # The OpenAI-compatible API (tests/e2e/test_openai_api.py).
        scheduler_port=free_port(),
        worker_port=free_port(),
        scheduler_args=list(scheduler_args),
        worker_args=FLOAT32 + list(worker_args),
        log_dir=log_dir,
    )
    return LocalCluster(spec).start(timeout_s=300)


@pytest.fixture(scope="session")
def cluster(model_dir, tmp_path_factory):
    """The default configuration: float32, a KV cache far larger than the tests need."""
    c = start_cluster(model_dir, tmp_path_factory.mktemp("cluster-logs"), worker_args=["--kv-cache-memory", "512MiB"])
    yield c
    c.stop()
