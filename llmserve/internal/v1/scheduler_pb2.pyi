from llmserve.v1 import generation_pb2 as _generation_pb2
from llmserve.internal.v1 import sampling_pb2 as _sampling_pb2
from llmserve.internal.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AddRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "n", "priority", "deadline_ms", "cache_salt", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _sampling_pb2.SamplingParams
    n: int
    priority: int
    deadline_ms: int
    cache_salt: str
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., n: _Optional[int] = ..., priority: _Optional[int] = ..., deadline_ms: _Optional[int] = ..., cache_salt: _Optional[str] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class AbortRequests(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RouterMessage(_message.Message):
    __slots__ = ("add", "abort", "consumed")
    ADD_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    add: AddRequest
    abort: AbortRequests
    consumed: int
    def __init__(self, add: _Optional[_Union[AddRequest, _Mapping]] = ..., abort: _Optional[_Union[AbortRequests, _Mapping]] = ..., consumed: _Optional[int] = ...) -> None: ...

class RequestOutput(_message.Message):
    __slots__ = ("request_id", "new_token_ids", "logprobs", "finish_reason", "num_cached_tokens", "error", "stop_token_id", "index", "error_code", "retry_after_ms", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprobs]
    finish_reason: _generation_pb2.FinishReason
    num_cached_tokens: int
    error: str
    stop_token_id: int
    index: int
    error_code: int
    retry_after_ms: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_generation_pb2.FinishReason, str]] = ..., num_cached_tokens: _Optional[int] = ..., error: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., index: _Optional[int] = ..., error_code: _Optional[int] = ..., retry_after_ms: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class SchedulerUpdate(_message.Message):
    __slots__ = ("outputs", "saturated", "acknowledge")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    SATURATED_FIELD_NUMBER: _ClassVar[int]
    ACKNOWLEDGE_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[RequestOutput]
    saturated: bool
    acknowledge: bool
    def __init__(self, outputs: _Optional[_Iterable[_Union[RequestOutput, _Mapping]]] = ..., saturated: _Optional[bool] = ..., acknowledge: _Optional[bool] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("address", "info", "rank", "tp_size", "pp_size")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    address: str
    info: _worker_pb2.WorkerInfo
    rank: int
    tp_size: int
    pp_size: int
    def __init__(self, address: _Optional[str] = ..., info: _Optional[_Union[_worker_pb2.WorkerInfo, _Mapping]] = ..., rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., pp_size: _Optional[int] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("num_waiting", "num_running", "num_total_blocks", "num_free_blocks", "num_preemptions", "num_steps", "num_finished", "num_aborted", "worker_ready", "prompt_tokens_total", "generation_tokens_total", "num_swapped", "kv_cache_usage", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions_recompute", "num_preemptions_swap", "num_swapped_out_blocks", "num_cached_blocks", "num_cpu_blocks", "num_free_cpu_blocks", "num_allocated_blocks", "num_cow_copies", "num_failed", "num_orphaned_blocks", "num_queued_requests", "num_queued_tokens", "max_queued_requests", "max_queued_tokens", "saturated", "num_refused", "num_expired", "spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_accepted_per_position")
    class NumRefusedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_FIELD_NUMBER: _ClassVar[int]
    NUM_ABORTED_FIELD_NUMBER: _ClassVar[int]
    WORKER_READY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_SWAP_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_OUT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_ALLOCATED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_COW_COPIES_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_FIELD_NUMBER: _ClassVar[int]
    NUM_ORPHANED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SATURATED_FIELD_NUMBER: _ClassVar[int]
    NUM_REFUSED_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    num_waiting: int
    num_running: int
    num_total_blocks: int
    num_free_blocks: int
    num_preemptions: int
    num_steps: int
    num_finished: int
    num_aborted: int
    worker_ready: bool
    prompt_tokens_total: int
    generation_tokens_total: int
    num_swapped: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions_recompute: int
    num_preemptions_swap: int
    num_swapped_out_blocks: int
    num_cached_blocks: int
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    num_allocated_blocks: int
    num_cow_copies: int
    num_failed: int
    num_orphaned_blocks: int
    num_queued_requests: int
    num_queued_tokens: int
    max_queued_requests: int
    max_queued_tokens: int
    saturated: bool
    num_refused: _containers.ScalarMap[str, int]
    num_expired: int
    spec_num_drafts: int
    spec_num_draft_tokens: int
    spec_num_accepted_tokens: int
    spec_accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_steps: _Optional[int] = ..., num_finished: _Optional[int] = ..., num_aborted: _Optional[int] = ..., worker_ready: _Optional[bool] = ..., prompt_tokens_total: _Optional[int] = ..., generation_tokens_total: _Optional[int] = ..., num_swapped: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions_recompute: _Optional[int] = ..., num_preemptions_swap: _Optional[int] = ..., num_swapped_out_blocks: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., num_cpu_blocks: _Optional[int] = ..., num_free_cpu_blocks: _Optional[int] = ..., num_allocated_blocks: _Optional[int] = ..., num_cow_copies: _Optional[int] = ..., num_failed: _Optional[int] = ..., num_orphaned_blocks: _Optional[int] = ..., num_queued_requests: _Optional[int] = ..., num_queued_tokens: _Optional[int] = ..., max_queued_requests: _Optional[int] = ..., max_queued_tokens: _Optional[int] = ..., saturated: _Optional[bool] = ..., num_refused: _Optional[_Mapping[str, int]] = ..., num_expired: _Optional[int] = ..., spec_num_drafts: _Optional[int] = ..., spec_num_draft_tokens: _Optional[int] = ..., spec_num_accepted_tokens: _Optional[int] = ..., spec_accepted_per_position: _Optional[_Iterable[int]] = ...) -> None: ...

class GetServingInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetBlockAuditRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BlockHolder(_message.Message):
    __slots__ = ("request_id", "index", "is_root")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    IS_ROOT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    is_root: bool
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., is_root: _Optional[bool] = ...) -> None: ...

class HeldBlock(_message.Message):
    __slots__ = ("block_id", "holders")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    block_id: int
    holders: _containers.RepeatedCompositeFieldContainer[BlockHolder]
    def __init__(self, block_id: _Optional[int] = ..., holders: _Optional[_Iterable[_Union[BlockHolder, _Mapping]]] = ...) -> None: ...

class BlockAudit(_message.Message):
    __slots__ = ("gpu_blocks", "cpu_blocks", "orphaned_gpu_blocks", "orphaned_cpu_blocks", "problems", "num_total_blocks", "num_free_blocks")
    GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ORPHANED_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ORPHANED_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    gpu_blocks: _containers.RepeatedCompositeFieldContainer[HeldBlock]
    cpu_blocks: _containers.RepeatedCompositeFieldContainer[HeldBlock]
    orphaned_gpu_blocks: _containers.RepeatedScalarFieldContainer[int]
    orphaned_cpu_blocks: _containers.RepeatedScalarFieldContainer[int]
    problems: _containers.RepeatedScalarFieldContainer[str]
    num_total_blocks: int
    num_free_blocks: int
    def __init__(self, gpu_blocks: _Optional[_Iterable[_Union[HeldBlock, _Mapping]]] = ..., cpu_blocks: _Optional[_Iterable[_Union[HeldBlock, _Mapping]]] = ..., orphaned_gpu_blocks: _Optional[_Iterable[int]] = ..., orphaned_cpu_blocks: _Optional[_Iterable[int]] = ..., problems: _Optional[_Iterable[str]] = ..., num_total_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ...) -> None: ...

class ServingInfo(_message.Message):
    __slots__ = ("worker", "num_kv_blocks", "max_num_batched_tokens", "max_num_seqs", "step_budget_reason")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    STEP_BUDGET_REASON_FIELD_NUMBER: _ClassVar[int]
    worker: _worker_pb2.WorkerInfo
    num_kv_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    step_budget_reason: str
    def __init__(self, worker: _Optional[_Union[_worker_pb2.WorkerInfo, _Mapping]] = ..., num_kv_blocks: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., step_budget_reason: _Optional[str] = ...) -> None: ...

class SubscribeKvEventsRequest(_message.Message):
    __slots__ = ("after_sequence", "instance_id")
    AFTER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    after_sequence: int
    instance_id: str
    def __init__(self, after_sequence: _Optional[int] = ..., instance_id: _Optional[str] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("sequence", "instance_id", "snapshot", "block_size", "events")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    instance_id: str
    snapshot: bool
    block_size: int
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    def __init__(self, sequence: _Optional[int] = ..., instance_id: _Optional[str] = ..., snapshot: _Optional[bool] = ..., block_size: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ...) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: BlockStored
    removed: BlockRemoved
    cleared: AllBlocksCleared
    def __init__(self, stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hash", "parent_block_hash", "num_tokens")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    parent_block_hash: bytes
    num_tokens: int
    def __init__(self, block_hash: _Optional[bytes] = ..., parent_block_hash: _Optional[bytes] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hash",)
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    def __init__(self, block_hash: _Optional[bytes] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Load(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_swapped", "num_free_blocks", "num_total_blocks", "kv_usage", "num_waiting_tokens", "serving")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_swapped: int
    num_free_blocks: int
    num_total_blocks: int
    kv_usage: float
    num_waiting_tokens: int
    serving: bool
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_swapped: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., kv_usage: _Optional[float] = ..., num_waiting_tokens: _Optional[int] = ..., serving: _Optional[bool] = ...) -> None: ...
