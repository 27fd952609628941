"""Which internal peer may call what.

Mutual TLS proves a peer holds a certificate from the cluster's CA; its role comes from
the certificate's subject CN (`llmserve-router`, `llmserve-scheduler`,
`llmserve-worker`). A valid certificate of the wrong role is refused with
PERMISSION_DENIED: a router cannot register as a worker and take the live worker's
place, and only the scheduler drives a worker. The other internal calls (health,
GetStats, GetServingInfo, Describe, and the routing inputs SubscribeKvEvents and
GetLoad) are open to any holder of a cluster certificate, the router's included.
"""

from __future__ import annotations

import grpc

ROUTER, SCHEDULER, WORKER = "router", "scheduler", "worker"
ROLES = (ROUTER, SCHEDULER, WORKER)


def common_name(role: str) -> str:
    """The subject CN of a certificate for `role`."""
    return f"llmserve-{role}"


def peer_names(context: grpc.aio.ServicerContext) -> list[str]:
    """The CNs of the TLS peer's certificate (empty on a plaintext connection)."""
    return [name.decode(errors="replace") for name in context.auth_context().get("x509_common_name", ())]


class PeerCheck:
    """Refuses calls from peers whose certificate does not name the expected role.
    `enforce=False` (a service run with --insecure: no certificates at all) lets all in."""

    def __init__(self, enforce: bool):
        self.enforce = enforce

    async def require(self, context: grpc.aio.ServicerContext, role: str, method: str) -> None:
        if not self.enforce:
            return
        names = peer_names(context)
        if common_name(role) not in names:
            shown = ", ".join(names) or "none"
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"{method} is for the llmserve {role} only; the caller's certificate names "
                                f"{shown} (expected CN {common_name(role)})")
