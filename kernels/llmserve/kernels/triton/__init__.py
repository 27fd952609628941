"""Triton kernels for the GPU path, each with a plain torch reference beside it.

Importing this package imports triton. Under TRITON_INTERPRET=1 (set before the import)
the kernels run on CPU tensors through Triton's interpreter: that is how tests verify
them on machines without a GPU.
"""

from llmserve.kernels.triton.fused_moe import fused_moe
from llmserve.kernels.triton.kv_cache import reshape_and_cache
from llmserve.kernels.triton.norm import rms_norm
from llmserve.kernels.triton.paged_attention import paged_attention_decode, paged_attention_varlen
from llmserve.kernels.triton.rotary import rotary_embedding
from llmserve.kernels.triton.sampling import top_k_top_p_filter

__all__ = [
    "fused_moe", "paged_attention_decode", "paged_attention_varlen", "reshape_and_cache", "rms_norm",
    "rotary_embedding", "top_k_top_p_filter",
]
