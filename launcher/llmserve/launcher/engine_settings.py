"""The settings of an engine as `llmserve up` and `llmserve bench` take them: the worker's
and the scheduler's own config classes, minus what a launcher assigns to each process.

The skip lists below say only which flags these commands offer. The values reach the
processes as typed configs (ClusterSpec.worker, .scheduler, .router), rendered as flags
once, in cluster.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.scheduler.config import SchedulerConfig, SchedulerServiceConfig
from llmserve.settings import group
from llmserve.worker.config import WorkerConfig

# Where each process listens and whom it calls, its rank in a group, how long it drains:
# the launcher assigns them per process (cluster.py), never the user of `up` or `bench`.
PER_PROCESS = ("host", "port", "metrics-port", "health-port", "shutdown-timeout", "scheduler", "advertise-host",
               "register-timeout", "rank", "dist-init", "dist-timeout")
# Credentials come from the cluster too (a throwaway set, or none with --insecure).
CREDENTIALS = ("tls-cert", "tls-key", "tls-ca", "api-key", "api-key-file")
SET_BY_LAUNCHER = PER_PROCESS + CREDENTIALS + ("insecure",)


@dataclass(frozen=True)
class EngineSettings:
    """What an engine is built from, in process or as a local cluster: the worker's model
    and runner settings and the scheduler's, as the services declare them."""

    # --simulated-step-ms is `llmserve bench overhead`'s own (the in-process engine has no simulated worker).
    worker: WorkerConfig = group(WorkerConfig, skip=SET_BY_LAUNCHER + ("simulated-step-ms",))
    scheduler: SchedulerServiceConfig = group(SchedulerServiceConfig, skip=SET_BY_LAUNCHER + (
        "log-stats-interval", "step-timeout"))

    @property
    def scheduling(self) -> SchedulerConfig:
        return self.scheduler.scheduling
