"""The scheduler service: request queues, the paged KV cache's block tables, step plans."""

from llmserve.scheduler.block_pool import BlockPool
from llmserve.scheduler.kv_cache_manager import KVCacheManager
from llmserve.scheduler.request import Request, RequestStatus, Sample
from llmserve.scheduler.scheduler import Scheduler, SchedulerConfig, SchedulerStats

__all__ = [
    "BlockPool",
    "KVCacheManager",
    "Request",
    "RequestStatus",
    "Sample",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
]
