"""Which schedulers (one per data-parallel replica) the router talks to.

`--scheduler` lists host:port entries. An IP address is one replica. A host name is
looked up every --scheduler-resolve-interval seconds, and each address it resolves to
is a replica of its own: a Kubernetes headless Service resolves to one address per
ready pod, so replicas join and leave as pods do, with no cluster manager of ours.

A resolved replica is dialled by address, but its TLS certificate is checked against
the host name as written (the name the scheduler's certificate carries).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerEntry:
    """One --scheduler entry."""

    host: str
    port: int

    @property
    def is_address(self) -> bool:
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            return False
        return True


@dataclass(frozen=True)
class ReplicaAddress:
    """Where one replica's scheduler listens: the gRPC target to dial, the name its
    certificate must carry (None: the target's own host), and how logs call it."""

    target: str
    tls_name: str | None = None
    label: str = ""

    def __str__(self) -> str:
        return self.label or self.target


def split_entries(value: str) -> list[SchedulerEntry]:
    entries = []
    for raw in value.split(","):
        raw = raw.strip()
        host, sep, port = raw.rpartition(":")
        host = host.strip("[]")  # [::1]:50052
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{raw!r} is not host:port")
        entries.append(SchedulerEntry(host, int(port)))
    if len(set(entries)) != len(entries):
        raise ValueError(f"a scheduler is listed twice in {value!r}")
    return entries


def parse_scheduler_addresses(value: str) -> str:
    """The --scheduler flag's check: host:port[,host:port...] (kept as written)."""
    split_entries(value)
    return value


def _target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def resolve(entry: SchedulerEntry) -> list[ReplicaAddress]:
    """The replicas behind one entry now. A name with IPv4 addresses uses those only
    (`localhost` is one scheduler, not one per address family)."""
    if entry.is_address:
        return [ReplicaAddress(_target(entry.host, entry.port))]
    infos = await asyncio.get_running_loop().getaddrinfo(entry.host, entry.port, type=socket.SOCK_STREAM)
    v4 = sorted({info[4][0] for info in infos if info[0] == socket.AF_INET})
    v6 = sorted({info[4][0] for info in infos if info[0] == socket.AF_INET6})
    addresses = v4 or v6
    written = _target(entry.host, entry.port)
    return [ReplicaAddress(_target(a, entry.port), tls_name=entry.host,
                           label=written if len(addresses) == 1 else f"{written} ({a})") for a in addresses]


async def resolve_all(entries: list[SchedulerEntry], previous: dict[SchedulerEntry, list[ReplicaAddress]]
                      ) -> dict[SchedulerEntry, list[ReplicaAddress]]:
    """Every entry's replicas; an entry whose lookup fails keeps what it had (a DNS hiccup
    must not drop live replicas)."""
    found = {}
    for entry in entries:
        try:
            found[entry] = await resolve(entry)
        except OSError as err:
            if entry not in previous:
                logger.warning("router: cannot resolve scheduler %s: %s (retrying)", entry.host, err)
            found[entry] = previous.get(entry, [])
    return found
