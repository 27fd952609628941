"""The shared block key (llmserve.contract.block_hash) is the one the prefix cache uses,
and its byte encoding is the documented one."""

import hashlib
import struct

import pytest

from llmserve.contract.block_hash import hash_block, prompt_block_hashes, salt_key

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


def test_a_decoded_block_is_keyed_by_the_prompt_and_output_tokens_it_holds():
    # Blocks 0-1 prompt only, block 2 straddles the prompt's end, 3-4 outputs only: the
    # cache's keys are the chain over all_token_ids, read a block at a time.
    scheduler = make_scheduler(num_blocks=16, block_size=4, enable_prefix_caching=True)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    scheduler.add_request("a", prompt, params(max_tokens=12))
    sample = next(iter(scheduler.live.samples()))
    run_until_done(scheduler, FakeWorker(4))
    tokens = sample.all_token_ids
    assert len(tokens) == 22
    for start in range(len(tokens)):
        for end in range(start, len(tokens) + 1):
            assert sample.token_ids_between(start, end) == tokens[start:end]
    # (the last token's KV is never computed: five full blocks)
    assert set(prompt_block_hashes(tokens[:20], 4)) <= set(scheduler.kv.pool._cached)


def test_a_cache_salt_chains_the_first_block_from_the_salts_own_key():
    tokens = list(range(8))
    salted_root = hashlib.sha256(b"llmserve cache salt\x00tenant-a").digest()
    assert salt_key("tenant-a") == salted_root and salt_key("") is None
    h0 = hashlib.sha256(salted_root + struct.pack("<4q", 0, 1, 2, 3)).digest()
    assert prompt_block_hashes(tokens, 4, "tenant-a") == [h0, hash_block(h0, tokens[4:])]
    assert prompt_block_hashes(tokens, 4, "") == prompt_block_hashes(tokens, 4)
    keys = {tuple(prompt_block_hashes(tokens, 4, salt)) for salt in ("", "tenant-a", "tenant-b")}
    assert len(keys) == 3  # Every block differs between salts, the later ones by the chain.
    assert not set(prompt_block_hashes(tokens, 4, "tenant-a")) & set(prompt_block_hashes(tokens, 4))


def test_requests_share_cached_blocks_only_with_the_same_salt():
    scheduler = make_scheduler(num_blocks=32, block_size=4, enable_prefix_caching=True)
    prompt = list(range(5, 18))  # 13 tokens: three full blocks, all but the last a possible hit.
    worker = FakeWorker(4)

    def admitted(request_id: str, cache_salt: str) -> int:
        request = scheduler.add_request(request_id, prompt, params(max_tokens=1), cache_salt=cache_salt)
        run_until_done(scheduler, worker)
        return request.num_cached_tokens

    assert admitted("unsalted", "") == 0
    assert admitted("tenant-a", "a") == 0  # The unsalted request's blocks are not a's.
    assert admitted("tenant-a-again", "a") == 12
    assert admitted("tenant-b", "b") == 0
    assert admitted("unsalted-again", "") == 12
    # The cache holds each salt's keys as the router computes them.
    cached = set(scheduler.kv.pool._cached)
    for salt in ("", "a", "b"):
        assert set(prompt_block_hashes(prompt, 4, salt)) <= cached
