"""What a worker serves, reported when it registers with the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class WorkerInfo:
    model: str
    model_path: str
    num_kv_blocks: int
    block_size: int
    dtype: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = field(default=())
    tensor_parallel_size: int = 1
    bos_token_id: int = -1
    num_cpu_blocks: int = 0  # Swap space, in blocks.
    device: str = "cpu"  # "cpu", or "cuda (<GPU name>)"
    cuda_graphs: bool = False  # Decode steps replay CUDA graphs.
    quantization: str = "none"  # "none", "int8" (W8A8 where the CPU has VNNI), "int8-weight-only"
    dtype_reason: str = ""  # Why `dtype`: --dtype auto's choice and its grounds, or "--dtype".
    # The device's total memory (CUDA; 0 on the CPU): with `device` it picks the step
    # budget by device (contract/step_budget.py), on both sides of the registration.
    device_memory_bytes: int = 0
    # Every layer attends to the last W tokens only (0: some layer sees every token): the
    # scheduler then releases the blocks a sequence's window has left behind.
    sliding_window: int = 0
