"""Model FLOPs and the machine's matmul peak, for MFU (model FLOP utilisation); model
bytes and the machine's memory bandwidth, for the roofline floor of a run.

Achieved model FLOP/s counts only the work the model needs (vLLM/PaLM convention):
  2 x (parameters of the linear layers) per computed token
+ 2 x (LM head parameters) per token whose logits are computed (only sampled ones here)
+ 4 x heads x head_dim x layers per query-key pair attention scores (QK^T and AV).
It is divided by a matmul peak measured in the same process on the same dtype, so the
ratio needs no datasheet.

Roofline floor: a step cannot take less than max(FLOPs / peak, bytes / bandwidth), where
bytes = every linear weight once + the LM head when logits are computed + the K/V of
every attended token + the K/V written. Summed over a run's steps it is the time a
perfect implementation would need on this machine for the same schedule.

Layer-by-layer floor: the same, but with the products (linear layers and LM head: their
FLOPs, their weights) and attention (its FLOPs, the K/V) each bound on its own and
added, as an engine that runs a layer's products and its attention one after the other
would be. Where the products are compute-bound and attention memory-bound (decode at
tens of rows on a few CPU cores), this floor is well above the first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.bench.clock import best_rate
from llmserve.kernels import cpu as cpu_kernels
from llmserve.worker.layers.packed_weight import onednn_packing_available


@dataclass(frozen=True)
class ModelFlops:
    linear_params: int  # Per token, all layers: q, k, v, o, gate, up, down.
    lm_head_params: int
    attention_flops_per_pair: int

    @classmethod
    def from_config(cls, cfg) -> "ModelFlops":
        hidden, layers = cfg.hidden_size, cfg.num_hidden_layers
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        head_dim = getattr(cfg, "head_dim", None) or hidden // heads
        attn = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden
        mlp = 3 * hidden * cfg.intermediate_size
        return cls(
            linear_params=layers * (attn + mlp),
            lm_head_params=hidden * cfg.vocab_size,
            attention_flops_per_pair=4 * heads * head_dim * layers,
        )

    def step_flops(self, computed_tokens: int, logits_tokens: int, attention_pairs: int) -> int:
        return self.product_flops(computed_tokens, logits_tokens) + self.attention_flops(attention_pairs)

    def product_flops(self, computed_tokens: int, logits_tokens: int) -> int:
        """The linear layers' and the LM head's."""
        return 2 * self.linear_params * computed_tokens + 2 * self.lm_head_params * logits_tokens

    def attention_flops(self, attention_pairs: int) -> int:
        return self.attention_flops_per_pair * attention_pairs


@dataclass(frozen=True)
class ModelBytes:
    linear_bytes: int  # All linear weights of all layers, read once per step.
    lm_head_bytes: int
    kv_bytes_per_token: int  # K and V of one token over all layers.

    @classmethod
    def from_config(cls, cfg, dtype: torch.dtype, quantization: str = "none") -> "ModelBytes":
        """Weights and K/V in `dtype`, except with int8 `quantization`: its linear weights
        are one byte each (their float32 scales, 4 bytes a row, left out), and so is the LM
        head under W8A8 ("int8"; embedding.py); the K/V stays in `dtype`."""
        size = torch.finfo(dtype).bits // 8
        flops = ModelFlops.from_config(cfg)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        linear_size = 1 if quantization != "none" else size
        head_size = 1 if quantization == "int8" else size
        return cls(linear_bytes=flops.linear_params * linear_size, lm_head_bytes=flops.lm_head_params * head_size,
                   kv_bytes_per_token=2 * cfg.num_key_value_heads * head_dim * cfg.num_hidden_layers * size)

    def step_bytes(self, computed_tokens: int, logits_tokens: int, kv_tokens_read: int) -> int:
        return self.weight_bytes(logits_tokens) + self.kv_bytes(computed_tokens, kv_tokens_read)

    def weight_bytes(self, logits_tokens: int) -> int:
        return self.linear_bytes + (self.lm_head_bytes if logits_tokens else 0)

    def kv_bytes(self, computed_tokens: int, kv_tokens_read: int) -> int:
        """The K/V attention reads, and the K/V of the computed tokens written."""
        return self.kv_bytes_per_token * (kv_tokens_read + computed_tokens)


def measure_memory_bandwidth(nbytes: int = 2**30, seconds: float = 1.0, device: torch.device | str = "cpu") -> float:
    """Bytes/s the memory streams at, from a buffer far larger than any cache (best of
    several passes): the bandwidth decode steps are bound by.

    CPU: reads only (a sum over the buffer). CUDA: a device-to-device copy, counting the
    bytes read plus the bytes written (the datasheet's HBM figure counts both ways)."""
    device = torch.device(device)
    if device.type == "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)  # [nbytes]
        dst = torch.empty_like(src)
        return best_rate(lambda: dst.copy_(src), 2 * nbytes, device, seconds, reps=4)
    buf = torch.ones(nbytes // 4, dtype=torch.float32)  # [nbytes / 4]; written, so its pages are in
    return best_rate(buf.sum, nbytes, device, seconds)


def measure_matmul_peak(dtype: torch.dtype = torch.float32, size: int | None = None, seconds: float = 1.5,
                        device: torch.device | str = "cpu", quantization: str = "none") -> float:
    """FLOP/s of a large square matmul on this device, now (best of several runs): on the
    CPU the faster of torch's matmul and oneDNN's linear with a weight packed ahead (the
    engine's CPU products use either, by a timing per machine). With W8A8 int8
    (`quantization="int8"`, where the CPU has VNNI) the products run in int8: the faster
    of torch's int8 matmul and our W8A8 kernel, ~2x bfloat16's peak.

    NOTE: torch.mm alone understated some CPUs: on a 2-core AMD EPYC (family 26, AVX-512)
    its float32 GEMM (MKL) ran at 204 GFLOP/s where oneDNN's reached 473, and runs then
    read as over 100% of their roofline floor; in bfloat16, 793 against 946.

    size: 2048 on the CPU; 8192 on CUDA, where a smaller product leaves tensor cores idle
    between tiles and would understate the peak (so overstate MFU)."""
    device = torch.device(device)
    size = size or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(size, size, dtype=dtype, device=device)  # [size, size]
    b = torch.randn(size, size, dtype=dtype, device=device)  # [size, size]
    if device.type == "cuda":
        return best_rate(lambda: torch.mm(a, b), 2 * size**3, device, seconds, reps=10)
    if quantization == "int8" and cpu_kernels.w8a8_supported():
        return _int8_peak(a, size, seconds)
    products = [lambda: torch.mm(a, b)]
    if onednn_packing_available() and dtype in (torch.float32, torch.bfloat16):
        packed = torch.ops.mkldnn._reorder_linear_weight(b, size)  # b as an [out, in] weight
        products.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
    return _fastest(products, size, seconds)


def _fastest(products: list, size: int, seconds: float) -> float:
    """The best FLOP/s among CPU products of a [size, size] by a [size, size], `seconds` shared."""
    return max(best_rate(product, 2 * size**3, "cpu", seconds / len(products)) for product in products)


def _int8_peak(a: torch.Tensor, size: int, seconds: float) -> float:
    """Multiply-adds x 2 per second of int8 products of a [size, size]: torch's int8 x int8
    matmul and our W8A8 kernel (activations quantized on the fly), the faster one."""
    q = torch.randint(-127, 128, (size, size), dtype=torch.int8)  # [size, size] weight
    packed, scales = cpu_kernels.w8a8_pack_weight(q), torch.ones(size)  # [size] float32
    products = [lambda: cpu_kernels.w8a8_linear(a, packed, scales)]
    if hasattr(torch, "_int_mm"):
        a8 = torch.randint(-127, 128, (size, size), dtype=torch.int8)  # [size, size] activations
        products.append(lambda: torch._int_mm(a8, q.t()))
    return _fastest(products, size, seconds)


def measure_peak_and_bandwidth(dtype: torch.dtype, device: torch.device | str, seconds: float = 1.0
                               ) -> tuple[float, float]:
    """This device's matmul FLOP/s in `dtype` and its memory bytes/s, now: `seconds` of
    sampling for the bandwidth, 1.5x that for the peak (the defaults above)."""
    return (measure_matmul_peak(dtype, seconds=1.5 * seconds, device=device),
            measure_memory_bandwidth(seconds=seconds, device=device))
