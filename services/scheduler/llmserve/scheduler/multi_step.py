"""Multi-step scheduling (num_scheduler_steps K > 1, vLLM's `--num-scheduler-steps`).

When a step would only decode (every scheduled sample computes its one sampled token)
and nothing waits for admission or a swap-in, the plan asks the worker for up to K
decode steps back to back, the worker feeding each step's sampled tokens to the next.
The scheduler allocates the run's slots up front (lookahead) and applies the tokens when
the run's result comes back; tokens after a sample's stop are dropped. One plan, one
result and one output message per sample then stand for K tokens: the control plane's
cost per token falls by K.

With speculative decoding a step where any sample carries drafts is one step: the
drafts make that sample's row more than a plain decode, and verifying them already
yields up to 1 + drafts tokens per plan. Steps without drafts still run multi-step.

    K = 4, block_size = 4, a sample with positions 0..8 computed and token 9 sampled:
    positions:  [ 0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 14 15 ]
                                        ^^^^^^^^^^^^^ the run computes 9..12: the table
                                                      gets its 4th block before it starts
"""

from __future__ import annotations

from llmserve.scheduler.kv_cache_manager import KVCacheManager
from llmserve.scheduler.queues import Queues
from llmserve.scheduler.worker_view import ScheduledSample


def num_steps_for(num_scheduler_steps: int, max_model_len: int, kv: KVCacheManager, queues: Queues,
                  scheduled: list[ScheduledSample]) -> int:
    """Decode steps this plan runs back to back: 1, or with multi-step scheduling up to
    num_scheduler_steps when every scheduled sample is a plain decode and no sample
    waits for room (an arrival or a swapped request would otherwise wait for the run).
    Capped so that no sample passes its max_tokens or max_model_len, and shrunk until
    the run's extra slots fit in the free blocks."""
    k = num_scheduler_steps
    if k == 1 or not scheduled or queues.waiting or queues.swapped or kv.has_block_ops:
        return 1
    for item in scheduled:
        if not _plain_decode(item):
            return 1
        sample = item.sample
        k = min(k, sample.sampling.max_tokens - sample.num_output_tokens,
                max_model_len - sample.num_tokens)
    while k > 1 and kv.blocks_needed([(item.sample, k) for item in scheduled]) > kv.num_free_blocks:
        k -= 1
    return max(k, 1)


def _plain_decode(item: ScheduledSample) -> bool:
    """The sample computes just its last sampled token, and its table is unchanged."""
    sample = item.sample
    return (item.num_tokens == 1 and sample.num_uncomputed_tokens == 1 and not sample.is_root
            and not item.table_changed)


def allocate_lookahead(kv: KVCacheManager, scheduled: list[ScheduledSample], num_steps: int) -> None:
    """Grow each decoding sample's table to hold the run's num_steps tokens."""
    for item in scheduled:
        more = kv.allocate_slots(item.sample, num_steps)
        assert more is not None, "num_steps_for checked the free blocks"
        item.new_block_ids = item.new_block_ids + more
