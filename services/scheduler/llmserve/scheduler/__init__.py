"""The scheduler service: request queues, the paged KV cache's block tables, step plans."""

from llmserve.scheduler.block_pool import BlockPool
from llmserve.scheduler.kv_cache_manager import KVCacheManager
from llmserve.scheduler.request import Request, RequestStatus
from llmserve.scheduler.scheduler import Scheduler, SchedulerConfig, SchedulerStats

__all__ = [
    "BlockPool",
    "KVCacheManager",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
]
