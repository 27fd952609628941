"""Routing across data-parallel replicas, without processes: the policies, the KV index
built from KV events, --scheduler's parsing and resolution, and ReplicaSet.choose."""

from __future__ import annotations

import pytest

from llmserve.contract.block_hash import prompt_block_hashes
from llmserve.contract.security import SecurityOptions
from llmserve.contract.worker_info import WorkerInfo
from llmserve.internal.v1 import scheduler_pb2
from llmserve.router.discovery import SchedulerEntry, parse_scheduler_addresses, resolve, split_entries
from llmserve.router.kv_index import KvIndex
from llmserve.router.replicas import ReplicaSet
from llmserve.router.routing import CacheAware, Candidate, LeastLoad, RoundRobin, make_policy


def test_round_robin_takes_turns_whatever_the_order():
    policy = RoundRobin()
    a, b = Candidate("a", 0, 0), Candidate("b", 5, 100)
    picks = [policy.choose([a, b] if i % 2 else [b, a]).name for i in range(4)]
    assert picks == ["a", "b", "a", "b"]


def test_least_load_picks_the_idlest():
    assert LeastLoad().choose([Candidate("a", 3, 0), Candidate("b", 1, 0), Candidate("c", 2, 0)]).name == "b"


def test_cache_aware_prefers_the_longest_cached_prefix_then_the_lighter():
    policy = CacheAware()
    assert policy.choose([Candidate("a", 0, 0), Candidate("b", 3, 64)]).name == "b"
    assert policy.choose([Candidate("a", 2, 64), Candidate("b", 1, 64)]).name == "b"
    # Nothing cached anywhere: least load.
    assert policy.choose([Candidate("a", 2, 0), Candidate("b", 1, 0)]).name == "b"


def test_cache_aware_balances_a_hot_prefix():
    policy = CacheAware(abs_threshold=8, rel_threshold=1.5)
    # The replica holding the prefix is 10 requests ahead: the idle one takes it.
    assert policy.choose([Candidate("hot", 10, 512), Candidate("idle", 0, 0)]).name == "idle"
    # A small lead is not an imbalance: the cache wins.
    assert policy.choose([Candidate("hot", 6, 512), Candidate("idle", 0, 0)]).name == "hot"


def test_make_policy_knows_each_name():
    assert {make_policy(n).name for n in ("cache-aware", "least-load", "round-robin")} == {
        "cache-aware", "least-load", "round-robin"}
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")


def batch(sequence, *events, snapshot=False, instance="i1", block_size=4):
    return scheduler_pb2.KvEventBatch(sequence=sequence, instance_id=instance, snapshot=snapshot,
                                      block_size=block_size, events=list(events))


def stored(h: bytes, parent: bytes = b""):
    return scheduler_pb2.KvEvent(stored=scheduler_pb2.BlockStored(block_hash=h, parent_block_hash=parent,
                                                                  num_tokens=4))


def removed(h: bytes):
    return scheduler_pb2.KvEvent(removed=scheduler_pb2.BlockRemoved(block_hash=h))


def test_kv_index_follows_events_and_counts_leading_blocks():
    tokens = list(range(13))
    h = prompt_block_hashes(tokens, 4)
    assert len(h) == 3  # Full blocks only.
    index = KvIndex()
    index.apply(batch(1, stored(h[0]), stored(h[1], h[0]), stored(h[2], h[1])))
    assert index.matched_blocks(h) == 3
    index.apply(batch(2, removed(h[1])))
    assert index.matched_blocks(h) == 1  # A hole ends the prefix.
    index.apply(batch(3, scheduler_pb2.KvEvent(cleared=scheduler_pb2.AllBlocksCleared())))
    assert index.matched_blocks(h) == 0
    assert (index.instance_id, index.sequence, index.block_size) == ("i1", 3, 4)


def test_kv_index_restarts_on_a_snapshot_or_a_new_instance():
    h = prompt_block_hashes(list(range(8)), 4)
    index = KvIndex()
    index.apply(batch(5, stored(h[0]), stored(h[1], h[0])))
    index.apply(batch(1, stored(h[0]), instance="i2"))  # The scheduler restarted.
    assert index.matched_blocks(h) == 1
    index.apply(batch(7, snapshot=True, instance="i2"))
    assert index.matched_blocks(h) == 0


def test_kv_index_expectations_count_until_they_lapse():
    now = [100.0]
    index = KvIndex(clock=lambda: now[0])
    h = prompt_block_hashes(list(range(8)), 4)
    index.expect(h)
    assert index.matched_blocks(h) == 2
    now[0] += 31
    assert index.matched_blocks(h) == 0


def test_scheduler_flag_parses_lists_and_refuses_garbage():
    assert split_entries("a:1, b:2,[::1]:3") == [SchedulerEntry("a", 1), SchedulerEntry("b", 2),
                                                  SchedulerEntry("::1", 3)]
    for bad in ("a", "a:x", ":5", "a:1,a:1", "a:70000"):
        with pytest.raises(ValueError):
            parse_scheduler_addresses(bad)


async def test_resolution_uses_ipv4_addresses_and_checks_the_name():
    (address,) = await resolve(SchedulerEntry("localhost", 50052))
    assert (address.target, address.tls_name, str(address)) == ("127.0.0.1:50052", "localhost", "localhost:50052")
    (literal,) = await resolve(SchedulerEntry("127.0.0.2", 7))
    assert (literal.target, literal.tls_name) == ("127.0.0.2:7", None)


def info(block_size=4) -> WorkerInfo:
    return WorkerInfo(model="m", model_path="/m", num_kv_blocks=16, block_size=block_size, dtype="float32",
                      max_model_len=64, vocab_size=100)


async def serving_set(policy: str, n: int = 2) -> ReplicaSet:
    """A ReplicaSet over addresses nobody listens on, its replicas marked serving by hand."""
    replicas = ReplicaSet(",".join(f"127.0.0.{i + 1}:9" for i in range(n)), SecurityOptions(insecure=True),
                          1 << 20, make_policy(policy))
    await replicas._refresh()
    for task in replicas._tasks.values():
        task.cancel()
    for replica in replicas.replicas.values():
        replica.info = (info(), 16)
        replica.serving = True
        replica.link.connected.set()
    return replicas


async def test_choose_follows_the_cache_and_expects_what_it_placed():
    replicas = await serving_set("cache-aware")
    a, b = sorted(replicas.replicas.values(), key=lambda r: r.name)
    prompt = list(range(20))
    h = prompt_block_hashes(prompt, 4)
    b.kv.apply(batch(1, stored(h[0]), stored(h[1], h[0])))
    replica, cached = replicas.choose(prompt)
    assert (replica, cached) == (b, 8)
    # A new prefix goes to the idler one, which is then expected to hold it...
    other = list(range(100, 120))
    b.in_flight = 3
    replica, cached = replicas.choose(other)
    assert (replica, cached) == (a, 0)
    # ...so the next request of that prefix follows it before any event arrives.
    a.in_flight = 1
    assert replicas.choose(other + [7]) == (a, 20)  # 5 full blocks of 4
    # Excluded (a migration) or not serving: the other one.
    assert replicas.choose(other, exclude=[a])[0] is b
    a.serving = False
    assert replicas.choose(other)[0] is b
    b.serving = False
    assert replicas.choose(other) is None
    await replicas.close()


async def test_a_salted_request_follows_only_its_salts_cached_blocks():
    replicas = await serving_set("cache-aware")
    a, b = sorted(replicas.replicas.values(), key=lambda r: r.name)
    prompt = list(range(20))
    unsalted, salted = prompt_block_hashes(prompt, 4), prompt_block_hashes(prompt, 4, "tenant")
    b.kv.apply(batch(1, stored(unsalted[0]), stored(unsalted[1], unsalted[0])))
    a.kv.apply(batch(1, stored(salted[0])))
    b.in_flight = a.in_flight = 1
    assert replicas.choose(prompt) == (b, 8)
    assert replicas.choose(prompt, cache_salt="tenant") == (a, 4)
    # The placement expects the salt's keys on its replica, not the unsalted ones.
    assert a.kv.matched_blocks(salted) == 5 and a.kv.matched_blocks(unsalted) == 0
    await replicas.close()


async def test_saturated_replicas_are_avoided_while_another_is_not():
    replicas = await serving_set("least-load")
    a, b = sorted(replicas.replicas.values(), key=lambda r: r.name)
    b.in_flight = 5
    a.saturated = True
    assert replicas.choose([1, 2, 3])[0] is b
    b.saturated = True
    assert replicas.saturated and replicas.choose([1, 2, 3])[0] is a  # All full: the scheduler refuses with a hint.
    await replicas.close()
