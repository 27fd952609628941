"""Attention backends over a paged KV cache."""

from llmserve.worker.attention.backend import AttentionBackend, AttentionMetadata
from llmserve.worker.attention.selector import BACKEND_CHOICES, backend_class, install_backend
from llmserve.worker.attention.torch_paged import TorchPagedAttention

__all__ = [
    "AttentionBackend", "AttentionMetadata", "BACKEND_CHOICES", "TorchPagedAttention", "backend_class",
    "install_backend",
]
