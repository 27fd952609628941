"""Tensor- and pipeline-parallel process groups over torch.distributed.

World = PP stages x TP ranks; a rank's place in the grid:

    rank = pp_rank * tp_size + tp_rank

              tp_rank 0   tp_rank 1
    pp_rank 0   rank 0      rank 1     <- first stage: token embedding
    pp_rank 1   rank 2      rank 3     <- last stage: final norm, LM head, sampling

TP groups are the rows (two all-reduces per layer, one all-gather of logits), PP groups
the columns (hidden + residual sent stage to stage). The driver, whose sampled tokens
the scheduler takes, is the last stage's TP rank 0; it broadcasts them to every rank so
each keeps the same per-request token history.

Everything lives in a `ParallelState` passed explicitly; the only global state is what
torch.distributed itself keeps (the default process group).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0


class RendezvousError(RuntimeError):
    """A rank never joined, or the ranks disagree on what they serve."""


@dataclass(frozen=True)
class GroupHandle:
    """One process group as seen by this rank: its size, its rank in it, and the global
    ranks of its members. `group` is None when size == 1 (no collective is ever needed)
    or for a detached handle used to build shards without torch.distributed (tests)."""

    size: int = 1
    rank: int = 0
    ranks: tuple[int, ...] = (0,)
    group: object | None = field(default=None, compare=False, repr=False)

    @staticmethod
    def detached(size: int, rank: int) -> "GroupHandle":
        """Shape-only handle (weight loaders, memory checks); collectives raise."""
        return GroupHandle(size, rank, tuple(range(size)))

    def _need_group(self, what: str) -> None:
        if self.group is None:
            raise RuntimeError(f"{what} across {self.size} ranks needs an initialized process group")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place; returns x."""
        if self.size == 1:
            return x
        self._need_group("all_reduce")
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every member's x along `dim`, in group-rank order."""
        if self.size == 1:
            return x
        self._need_group("all_gather")
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)


SINGLE = GroupHandle()


@dataclass(frozen=True)
class ParallelState:
    tp: GroupHandle = SINGLE
    pp: GroupHandle = SINGLE
    world: GroupHandle = SINGLE
    # Where this rank's collectives run: NCCL moves device tensors only, gloo host ones.
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp.rank == self.pp.size - 1

    @property
    def driver_rank(self) -> int:
        """Global rank that samples: TP rank 0 of the last PP stage."""
        return (self.pp.size - 1) * self.tp.size

    @property
    def is_driver(self) -> bool:
        return self.rank == self.driver_rank

    def stage_layers(self, num_layers: int) -> tuple[int, int]:
        """[start, end) of the decoder layers this PP stage holds (remainder to early stages)."""
        return stage_layer_range(num_layers, self.pp.size, self.pp.rank)

    # ---- pipeline hand-off ----------------------------------------------------------

    def send_to_next_stage(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """hidden, residual: [T, H] -> the same TP rank of the next stage (one message)."""
        dst = self.rank + self.tp.size
        dist.send(torch.stack([hidden, residual]).contiguous(), dst=dst)

    def recv_from_prev_stage(self, num_tokens: int, hidden_size: int, dtype: torch.dtype,
                             device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's (hidden, residual), each [T, H]; T is known from the plan."""
        buf = torch.empty(2, num_tokens, hidden_size, dtype=dtype, device=device)
        dist.recv(buf, src=self.rank - self.tp.size)
        return buf[0], buf[1]

    def broadcast_from_driver(self, values: list[int]) -> list[int]:
        """The driver's list of ints on every rank (every rank passes a list of the same length)."""
        if self.world.size == 1:
            return values
        t = torch.tensor(values if self.is_driver else [0] * len(values), dtype=torch.long, device=self.device)
        return self.broadcast_tensor_from_driver(t).tolist()

    def broadcast_tensor_from_driver(self, t: torch.Tensor) -> torch.Tensor:
        """The driver's `t` on every rank, in place (others pass a tensor of the same shape
        and dtype on this rank's device: with NCCL the bytes never touch the host)."""
        if self.world.size > 1:
            dist.broadcast(t, src=self.driver_rank, group=self.world.group)
        return t

    def min_over_world(self, value: int) -> int:
        if self.world.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.world.group)
        return int(t.item())


def stage_layer_range(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    if num_layers < pp_size:
        raise ValueError(f"{num_layers} layers cannot be split across {pp_size} pipeline stages")
    return pp_rank * num_layers // pp_size, (pp_rank + 1) * num_layers // pp_size


def grid_groups(tp_size: int, pp_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """Global ranks of every TP group (rows) and every PP group (columns)."""
    tp = [[p * tp_size + t for t in range(tp_size)] for p in range(pp_size)]
    pp = [[p * tp_size + t for p in range(pp_size)] for t in range(tp_size)]
    return tp, pp


# ---- start-up -----------------------------------------------------------------------


@dataclass(frozen=True)
class DistInit:
    tp_size: int = 1
    pp_size: int = 1
    rank: int = 0
    init_method: str | None = None  # tcp://HOST:PORT; None: MASTER_ADDR / MASTER_PORT
    timeout_s: float = DEFAULT_TIMEOUT_S  # joining, and every collective afterwards

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @staticmethod
    def from_env(tp_size: int, pp_size: int, rank: int | None = None, init_method: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> "DistInit":
        """Flags win; RANK / WORLD_SIZE from the environment fill the gaps."""
        if rank is None:
            rank = int(os.environ.get("RANK", "0"))
        env_world = os.environ.get("WORLD_SIZE")
        if env_world is not None and tp_size * pp_size > 1 and int(env_world) != tp_size * pp_size:
            raise ValueError(f"WORLD_SIZE={env_world} but --tp-size {tp_size} x --pp-size {pp_size} "
                             f"= {tp_size * pp_size}")
        return DistInit(tp_size, pp_size, rank, init_method, timeout_s)

    def address(self) -> tuple[str, int]:
        if self.init_method:
            url = urlparse(self.init_method)
            if url.scheme != "tcp" or not url.hostname or not url.port:
                raise ValueError(f"--dist-init must look like tcp://HOST:PORT (got {self.init_method!r})")
            return url.hostname, url.port
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port:
            raise ValueError("a parallel worker needs --dist-init tcp://HOST:PORT or MASTER_ADDR/MASTER_PORT")
        return host, int(port)


def rendezvous(store, rank: int, world_size: int, payload: dict, timeout_s: float,
               poll_s: float = 0.05) -> list[dict]:
    """Store-based barrier: each rank publishes `payload`; returns every rank's payload in
    rank order, or raises RendezvousError naming the ranks still missing at the deadline."""
    store.set(f"join/{rank}", json.dumps(payload))
    deadline = time.monotonic() + timeout_s
    _wait_keys(store, "join", rank, world_size, deadline, timeout_s, poll_s)
    payloads = [json.loads(store.get(f"join/{r}")) for r in range(world_size)]
    # NOTE: rank 0 hosts the store: it leaves only once every rank has read the payloads.
    store.set(f"read/{rank}", "1")
    if rank == 0:
        _wait_keys(store, "read", rank, world_size, deadline, timeout_s, poll_s)
    return payloads


def _wait_keys(store, prefix: str, rank: int, world_size: int, deadline: float, timeout_s: float,
               poll_s: float) -> None:
    while True:
        missing = [r for r in range(world_size) if not store.check([f"{prefix}/{r}"])]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise RendezvousError(
                f"rank {rank}: timed out after {timeout_s:.0f} s waiting for rank(s) {missing} of "
                f"{world_size} to join (are all {world_size} worker processes started with the same "
                f"--dist-init address?)")
        time.sleep(poll_s)


def check_agreement(payloads: list[dict], keys: tuple[str, ...]) -> None:
    """Every rank must report the same value for each key (model path, dtype, ...)."""
    for key in keys:
        values = {r: p.get(key) for r, p in enumerate(payloads)}
        if len(set(map(json.dumps, values.values()))) > 1:
            detail = ", ".join(f"rank {r}: {v!r}" for r, v in values.items())
            raise RendezvousError(f"ranks disagree on {key}: {detail}")


def backend_for(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


# NOTE: set before NCCL starts. Without record_stream the caching allocator frees a
# collective's buffers as soon as the issuing stream is done with them (NCCL's own
# streams are synchronized by the process group), saving memory; cuMem-based NCCL
# buffers have broken CUDA graph capture of collectives on some drivers.
NCCL_ENV_HINTS = {"TORCH_NCCL_AVOID_RECORD_STREAMS": "1", "NCCL_CUMEM_ENABLE": "0"}


def init_parallel(cfg: DistInit, payload: dict | None = None, agree_on: tuple[str, ...] = (),
                  device: torch.device | str = "cpu") -> ParallelState:
    """Join the world, check the ranks agree on `agree_on` keys of their payloads, and
    build the TP and PP groups. With a world of 1 nothing is initialized."""
    if cfg.world_size == 1:
        return ParallelState()
    if not 0 <= cfg.rank < cfg.world_size:
        raise ValueError(f"rank {cfg.rank} outside 0..{cfg.world_size - 1}")
    host, port = cfg.address()
    timeout = timedelta(seconds=cfg.timeout_s)
    t0 = time.perf_counter()
    try:
        store = dist.TCPStore(host, port, cfg.world_size, is_master=cfg.rank == 0, timeout=timeout,
                              wait_for_workers=False)
    except (RuntimeError, TimeoutError) as err:  # a client that never reaches rank 0's store
        raise RendezvousError(f"rank {cfg.rank}: could not reach rank 0's store at {host}:{port} within "
                              f"{cfg.timeout_s:.0f} s (rank(s) [0] missing?): {err}") from err
    payloads = rendezvous(dist.PrefixStore("llmserve", store), cfg.rank, cfg.world_size,
                          payload or {}, cfg.timeout_s)
    check_agreement(payloads, agree_on)
    device = torch.device(device)
    backend = backend_for(device)
    if backend == "nccl":
        for key, value in NCCL_ENV_HINTS.items():
            os.environ.setdefault(key, value)
    # NOTE: `timeout` bounds every collective too. Under NCCL the watchdog aborts the
    # communicator and ends this process when a peer stops answering for that long, so a
    # dead peer shows as a lost worker (UNAVAILABLE at the scheduler), never as a hang.
    dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=cfg.rank,
                            world_size=cfg.world_size, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    state = _build_state(cfg.tp_size, cfg.pp_size, cfg.rank, timeout, device)
    logger.info("rank %d/%d joined in %.2f s: tp rank %d/%d, pp rank %d/%d (%s)", cfg.rank, cfg.world_size,
                time.perf_counter() - t0, state.tp.rank, cfg.tp_size, state.pp.rank, cfg.pp_size, backend)
    return state


def _build_state(tp_size: int, pp_size: int, rank: int, timeout: timedelta,
                 device: torch.device = torch.device("cpu")) -> ParallelState:
    tp_groups, pp_groups = grid_groups(tp_size, pp_size)
    tp = pp = None
    # NOTE: new_group is collective: every rank creates every group, in the same order.
    for ranks in tp_groups:
        g = dist.new_group(ranks, timeout=timeout) if tp_size > 1 else None
        if rank in ranks:
            tp = GroupHandle(tp_size, ranks.index(rank), tuple(ranks), g)
    for ranks in pp_groups:
        g = dist.new_group(ranks, timeout=timeout) if pp_size > 1 else None
        if rank in ranks:
            pp = GroupHandle(pp_size, ranks.index(rank), tuple(ranks), g)
    world_size = tp_size * pp_size
    world = GroupHandle(world_size, rank, tuple(range(world_size)), dist.group.WORLD)
    return ParallelState(tp=tp, pp=pp, world=world, device=device)


def shutdown_parallel(state: ParallelState) -> None:
    if state.world.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
