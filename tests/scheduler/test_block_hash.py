"""The shared block key (llmserve.contract.block_hash) is the one the prefix cache uses,
and its byte encoding is the documented one."""

import hashlib
import struct

import pytest

from llmserve.contract.block_hash import hash_block, prompt_block_hashes

from .scheduler_testkit import FakeWorker, make_scheduler, params, run_until_done


def test_the_encoding_is_sha256_of_the_parent_then_little_endian_int64_ids():
    first = hashlib.sha256(struct.pack("<3q", 1, 2, 70_000)).digest()
    assert hash_block(None, [1, 2, 70_000]) == first
    assert hash_block(b"", [1, 2, 70_000]) == first
    second = hashlib.sha256(first + struct.pack("<3q", -1, 0, 2**40)).digest()
    assert hash_block(first, [-1, 0, 2**40]) == second


def test_prompt_block_hashes_chain_the_full_blocks_only():
    tokens = list(range(10))
    h0 = hash_block(None, tokens[0:4])
    h1 = hash_block(h0, tokens[4:8])
    assert prompt_block_hashes(tokens, 4) == [h0, h1]
    assert prompt_block_hashes(tokens[:3], 4) == []
    assert prompt_block_hashes(tokens[:8], 4) == [h0, h1]
    with pytest.raises(ValueError):
        prompt_block_hashes(tokens, 0)


def test_the_prefix_cache_keys_blocks_with_the_shared_hash():
    scheduler = make_scheduler(num_blocks=16, block_size=4, enable_prefix_caching=True)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    scheduler.add_request("a", prompt, params(max_tokens=1))
    run_until_done(scheduler, FakeWorker(4))
    cached = set(scheduler.kv.pool._cached)
    # The prompt's two full blocks (the last one is never a hit, but it is cached).
    assert set(prompt_block_hashes(prompt, 4)) <= cached
