"""Attention backends over a paged KV cache."""

from llmserve.worker.attention.backend import AttentionBackend, AttentionMetadata
from llmserve.worker.attention.torch_paged import TorchPagedAttention

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchPagedAttention"]
