from llmserve.contract.sampling import SamplingParams
from llmserve.scheduler.kv_cache_manager import KVCacheManager
from llmserve.scheduler.prefix_cache import hash_block
from llmserve.scheduler.request import Request, Sample


def make_request(request_id: str, num_prompt_tokens: int) -> Sample:
    """The only sample of a one-sample request."""
    request = Request(request_id, list(range(num_prompt_tokens)), SamplingParams(), frozenset())
    (sample,) = request.first_samples()
    return sample


def test_new_blocks_as_tokens_cross_block_boundaries():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    r = make_request("a", 6)
    assert kv.allocate_slots(r, 6) == [0, 1]  # Tokens 0-3 -> block 0, 4-5 -> block 1.
    r.num_computed_tokens = 6
    assert kv.allocate_slots(r, 1) == []  # Token 6 fits block 1.
    r.num_computed_tokens = 7
    assert kv.allocate_slots(r, 1) == []  # Token 7 fills block 1.
    r.num_computed_tokens = 8
    assert kv.allocate_slots(r, 1) == [2]  # Token 8 starts block 2.
    r.num_computed_tokens = 9
    assert kv.allocate_slots(r, 4) == [3]  # Tokens 9-12 -> blocks 2 and 3.
    assert kv.get_block_ids(r) == [0, 1, 2, 3]
    assert kv.num_free_blocks == 1
    assert kv.usage == 0.8


def test_exhaustion_returns_none_and_allocates_nothing():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    a, b = make_request("a", 12), make_request("b", 9)
    assert kv.allocate_slots(a, 12) == [0, 1, 2]
    assert kv.allocate_slots(b, 9) is None  # Needs 3 blocks, 2 free.
    assert kv.get_block_ids(b) == []
    assert kv.num_free_blocks == 2
    kv.free(a)  # Tail first.
    assert kv.pool.free_block_ids() == [3, 4, 2, 1, 0]
    assert kv.allocate_slots(b, 9) == [3, 4, 2]
    assert kv.get_block_ids(b) == [3, 4, 2]


def test_free_is_idempotent_and_returns_a_copy():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = make_request("a", 3)
    kv.allocate_slots(a, 3)
    table = kv.get_block_ids(a)
    table.append(99)
    assert kv.get_block_ids(a) == [0]
    kv.free(a)
    kv.free(a)
    assert kv.num_free_blocks == 2
    assert kv.usage == 0.0


def test_prefix_keys_are_chained_sha256_digests():
    tokens = list(range(100, 116))
    key = hash_block(None, tokens)
    assert isinstance(key, bytes) and len(key) == 32  # SHA-256, not a 64-bit hash()
    assert hash_block(None, tuple(tokens)) == key  # the same prefix, however it is held
    # Pinned: cached prefixes keep their keys across versions (SHA-256 over parent + int64 ids).
    assert key.hex() == "201bed9520fb52ef3cd9efb74e17ea93a401bf44d65b68125fc4836b10011d5d"
    # Every input names the block: a token, the parent prefix.
    assert hash_block(None, tokens[:-1] + [117]) != key
    assert hash_block(key, tokens) != key and hash_block(key, tokens) != hash_block(hash_block(None, [1] * 16), tokens)
    # Ids are packed at fixed width: [1, 2] and [12] (or 258 = 0x0102) cannot alias.
    assert hash_block(None, [1, 2]) != hash_block(None, [12]) != hash_block(None, [258])
