"""The router's grpc.health.v1 statuses: liveness and readiness for traffic, apart.

    ""                        SERVING while the router has a scheduler whose worker can
                              run steps (liveness: a supervisor restarts on failure)
    llmserve.v1.Generation    the same, and NOT_SERVING while the scheduler is saturated
                              (readiness: a load balancer sends new requests elsewhere)

A saturated replica is healthy, only full: it must leave the rotation without being
restarted. Kubernetes probes one service name per probe (readiness `grpc: {port: 50051,
service: llmserve.v1.Generation}`, liveness `service: ""`), as do Envoy's and most
load balancers' gRPC health checks, so the two statuses are the whole interface.
Requests that still arrive are not turned away here: the scheduler decides (one of
better priority may displace a queued one).
"""

from __future__ import annotations

import logging

from llmserve.contract.grpc_server import NOT_SERVING, SERVING, ServiceServer

logger = logging.getLogger(__name__)


class RouterHealth:
    """Publishes "" and the service's own status from two facts: serving and saturated."""

    def __init__(self, server: ServiceServer) -> None:
        """Statuses go to `server`'s health service (its name is `server.service_name`)."""
        self.server = server
        self.serving = False  # The scheduler has a worker that runs steps.
        self.saturated = False  # The scheduler refuses new requests (admission control).
        self._published: tuple[bool, bool] | None = None

    async def update(self, *, serving: bool | None = None, saturated: bool | None = None) -> None:
        """Change either fact; the statuses are re-published when they change."""
        if serving is not None:
            self.serving = serving
        if saturated is not None:
            if saturated != self.saturated:
                logger.info("scheduler %s: %s", "saturated" if saturated else "no longer saturated",
                            f"{self.server.service_name} health NOT_SERVING" if saturated else "accepting requests")
            self.saturated = saturated
        state = (self.serving, self.serving and not self.saturated)
        if state == self._published:
            return
        self._published = state
        await self.server.health.set("", SERVING if state[0] else NOT_SERVING)
        await self.server.health.set(self.server.service_name, SERVING if state[1] else NOT_SERVING)
