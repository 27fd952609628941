"""The data-parallel replicas the router serves from: one scheduler (and its workers)
each, found through --scheduler (discovery.py), each followed by its own supervisor.

    ReplicaSet ── resolve --scheduler every N s ──▶ Replica per address
    Replica.run: wait for a worker ─▶ open the Session ─▶ serve (health, load, KV events)
                 ◀──────── lost: its requests migrate, it clears its index, and retries ◀┘

A replica takes new requests only while its scheduler reports SERVING on a live session
and it is still listed; a replica that drains (NOT_SERVING) or vanishes from DNS stops
receiving them at once, and its running requests finish there (or migrate, if it dies).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

import grpc

from llmserve.contract.block_hash import prompt_block_hashes
from llmserve.contract.security import SecurityOptions
from llmserve.contract.startup_errors import StartupError
from llmserve.contract.step_budget import StepBudget
from llmserve.contract.worker_info import WorkerInfo
from llmserve.router.discovery import ReplicaAddress, SchedulerEntry, resolve_all, split_entries
from llmserve.router.kv_index import KvIndex
from llmserve.router.placements import Placements
from llmserve.router.routing import Candidate, RoutingPolicy
from llmserve.router.scheduler_link import SchedulerLink

logger = logging.getLogger(__name__)

HEALTH_POLL_S = 1.0  # How often each replica's health and load are re-read.


class Replica:
    """One scheduler: its session link, whether it serves, its load and its cache index."""

    def __init__(self, address: ReplicaAddress, security: SecurityOptions, max_message_bytes: int,
                 on_change: Callable[[], None], placements: Placements):
        self.address = address
        self.name = str(address)
        self.link = SchedulerLink(address.target, security, placements, max_message_bytes,
                                  tls_name=address.tls_name, name=self.name)
        # (worker info, KV blocks, step budget) once it served.
        self.info: tuple[WorkerInfo, int, StepBudget] | None = None
        self.serving = False  # Its scheduler says SERVING, on a live session.
        self.listed = True  # Still among --scheduler's replicas.
        self.saturated = False
        # Requests this router has running there. NOTE: only Placements.place/unplace move
        # it, so it always equals the placement records on this replica.
        self.in_flight = 0
        self.reported_load = 0  # Running + waiting sequences, as the scheduler last said.
        self.kv = KvIndex()
        self._on_change = on_change

    @property
    def routable(self) -> bool:
        return self.serving and self.listed and self.link.connected.is_set()

    @property
    def load(self) -> int:
        # The router's own count moves at once; the scheduler's covers other routers' requests.
        return max(self.in_flight, self.reported_load)

    def _set_serving(self, serving: bool) -> None:
        if serving != self.serving:
            self.serving = serving
            logger.info("router: replica %s %s", self.name, "serving" if serving else "not serving")
            self._on_change()

    async def run(self, startup_deadline: float | None) -> None:
        """Serves while it can, reconnects when it cannot, until it is no longer listed."""
        while self.listed:
            self.info = await self.link.wait_serving_info(startup_deadline)
            startup_deadline = None
            await self.link.connect()
            followers = [asyncio.create_task(self._follow_kv_events(), name=f"kv-events {self.name}"),
                         asyncio.create_task(self._follow_saturation(), name=f"saturation {self.name}")]
            try:
                self._set_serving(True)
                while not self.link.disconnected.is_set() and self.listed:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.link.disconnected.wait(), HEALTH_POLL_S)
                        break
                    await self._poll()
            finally:
                for task in followers:
                    task.cancel()
                self._set_serving(False)
                self.kv.clear()

    async def _poll(self) -> None:
        serving = await self.link.scheduler_serving()
        if serving and not self.serving:
            # A worker (re)registered: its KV cache may differ from the last one's.
            self.info = await self.link.wait_serving_info()
            self.kv.clear()
        load = await self.link.load() if serving else None
        if load is not None:
            self.reported_load = load.num_running + load.num_waiting
        self._set_serving(serving)

    async def _follow_saturation(self) -> None:
        """Admission control's verdict, as soon as the session carries it."""
        while True:
            await self.link.saturation_changed.wait()
            self.link.saturation_changed.clear()
            if self.link.saturated != self.saturated:
                self.saturated = self.link.saturated
                self._on_change()

    async def _follow_kv_events(self) -> None:
        """Keeps `kv` in step with the scheduler's prefix cache: resubscribes (resuming
        after the last batch it applied) whenever the stream ends."""
        while True:
            try:
                async for batch in self.link.kv_events(self.kv.sequence, self.kv.instance_id):
                    self.kv.apply(batch)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    logger.warning("router: scheduler %s publishes no KV events: cache-aware routing sees "
                                   "nothing cached there", self.name)
                    return
            await asyncio.sleep(0.5)

    async def close(self) -> None:
        await self.link.close()


class ReplicaSet:
    """Every replica of --scheduler, the routing policy that picks among them, and the
    table of the requests placed on them (`placements`: the router's only one)."""

    def __init__(self, scheduler_spec: str, security: SecurityOptions, max_message_bytes: int,
                 policy: RoutingPolicy, resolve_interval_s: float = 10.0):
        self.entries: list[SchedulerEntry] = split_entries(scheduler_spec)
        self.placements = Placements()
        self.security = security
        self.max_message_bytes = max_message_bytes
        self.policy = policy
        self.resolve_interval_s = resolve_interval_s
        self.replicas: dict[str, Replica] = {}  # By target.
        self.changed = asyncio.Event()  # Set when a replica starts or stops serving, or joins or leaves.
        self._resolved: dict[SchedulerEntry, list[ReplicaAddress]] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._discovery: asyncio.Task | None = None
        self._startup_deadline: float | None = None

    # --- membership --------------------------------------------------------------------

    async def start(self, connect_timeout_s: float) -> None:
        """Resolves --scheduler and starts a supervisor per replica (returns at once)."""
        self._startup_deadline = asyncio.get_running_loop().time() + connect_timeout_s
        await self._refresh()
        if any(not e.is_address for e in self.entries):
            self._discovery = asyncio.create_task(self._rediscover_forever(), name="scheduler discovery")

    async def _rediscover_forever(self) -> None:
        while True:
            await asyncio.sleep(self.resolve_interval_s)
            await self._refresh()

    async def _refresh(self) -> None:
        self._resolved = await resolve_all(self.entries, self._resolved)
        addresses = {a.target: a for found in self._resolved.values() for a in found}
        for target, address in addresses.items():
            if target not in self.replicas:
                replica = Replica(address, self.security, self.max_message_bytes, self._changed, self.placements)
                self.replicas[target] = replica
                if len(self.entries) > 1 or len(addresses) > 1:
                    logger.info("router: replica %s joins", replica.name)
                self._tasks[target] = asyncio.create_task(self._supervise(replica), name=f"replica {replica.name}")
        for target in set(self.replicas) - set(addresses):
            replica = self.replicas[target]
            if replica.listed:
                logger.info("router: replica %s left --scheduler's addresses: no new requests go there",
                            replica.name)
                replica.listed = False
                if not replica.link.connected.is_set():
                    self._tasks[target].cancel()  # Still waiting for it: nothing runs there.
                self._changed()

    async def _supervise(self, replica: Replica) -> None:
        try:
            await replica.run(self._startup_deadline)
        finally:
            # Unlisted: it takes no new requests; its running ones end there (or migrate).
            while replica.in_flight:
                await asyncio.sleep(0.5)
            await replica.close()
            self.replicas.pop(replica.address.target, None)
            self._tasks.pop(replica.address.target, None)

    def _changed(self) -> None:
        self.changed.set()

    async def wait_serving(self, timeout_s: float) -> None:
        """Returns once some replica serves; a StartupError naming why none does after
        `timeout_s` (--connect-timeout)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.serving:
            if loop.time() >= deadline:
                raise self._startup_error(timeout_s)
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), min(0.5, deadline - loop.time()))

    def _startup_error(self, timeout_s: float) -> StartupError:
        waiting = [r.link for r in self.replicas.values()]
        if not waiting:
            return StartupError(f"no scheduler address resolved after {timeout_s:.0f} s "
                                f"({', '.join(f'{e.host}:{e.port}' for e in self.entries)})",
                                "check --scheduler's host names; --connect-timeout sets how long to wait")
        if len(waiting) == 1:
            link = waiting[0]
            return StartupError(f"{link.waiting or 'no answer from the scheduler at ' + link.name} after "
                                f"{timeout_s:.0f} s", f"{link.fix or 'see its log'}; --connect-timeout sets how "
                                                      f"long to wait")
        reasons = "; ".join(link.waiting or f"{link.name}: no answer" for link in waiting)
        return StartupError(f"no replica serves after {timeout_s:.0f} s: {reasons}",
                            "are the schedulers and their workers running? --connect-timeout sets how long to wait")

    # --- routing -----------------------------------------------------------------------

    @property
    def serving(self) -> bool:
        return any(r.routable for r in self.replicas.values())

    @property
    def saturated(self) -> bool:
        """Every serving replica refuses new work (admission control)."""
        routable = [r for r in self.replicas.values() if r.routable]
        return bool(routable) and all(r.saturated for r in routable)

    def routable(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.routable]

    def serving_infos(self) -> list[tuple[WorkerInfo, int, StepBudget]]:
        return [r.info for r in self.replicas.values() if r.routable and r.info is not None]

    def choose(self, prompt_ids: Sequence[int], exclude: Sequence[Replica] = (),
               cache_salt: str = "") -> tuple[Replica, int] | None:
        """The replica for a request of these prompt ids and cache salt (not one of
        `exclude`), and the prompt tokens it is expected to hold cached; None when no
        replica can take it."""
        replicas = [r for r in self.routable() if r not in exclude]
        if not replicas:
            return None
        unsaturated = [r for r in replicas if not r.saturated]
        replicas = unsaturated or replicas  # All saturated: the scheduler's refusal says so, with a retry hint.
        hashes: dict[int, list[bytes]] = {}
        candidates = {}
        for replica in replicas:
            block_size = replica.info[0].block_size if replica.info else 0
            cached = 0
            if block_size and self.policy.name == "cache-aware":
                if block_size not in hashes:
                    hashes[block_size] = prompt_block_hashes(prompt_ids, block_size, cache_salt)
                # The last prompt token is always computed (its logits are sampled).
                cached = min(replica.kv.matched_blocks(hashes[block_size]) * block_size, len(prompt_ids) - 1)
            candidates[replica.name] = (replica, Candidate(replica.name, replica.load, max(0, cached)))
        chosen = self.policy.choose([c for _, c in candidates.values()])
        replica = candidates[chosen.name][0]
        if replica.info and replica.info[0].block_size in hashes:
            replica.kv.expect(hashes[replica.info[0].block_size])
        return replica, chosen.cached_tokens

    async def close(self) -> None:
        if self._discovery is not None:
            self._discovery.cancel()
        for task in list(self._tasks.values()):
            task.cancel()
        for replica in list(self.replicas.values()):
            await replica.close()
