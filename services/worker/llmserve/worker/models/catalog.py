"""What each registered architecture is, for people choosing a model: the families, an
example checkpoint or two, the features switched on, how it parallelizes and which
quantizations apply. The documentation's supported-models page is generated from this
table (docs/hooks/reference.py), and tests/worker/test_model_catalog.py keeps it and the
registry (registry.py) naming the same architectures.

No torch here: `llmserve up` and the docs build read it without loading a model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelFamily:
    name: str
    architectures: tuple[str, ...]  # config.json `architectures` values
    examples: tuple[str, ...]  # Hub checkpoints of this shape
    features: str  # what differs from the shared Llama-style decoder
    tensor_parallel: bool = True
    pipeline_parallel: bool = True
    quantization: str = "int8 (W8A8 or weight-only) on the projections"
    gguf: bool = False  # `--model FILE.gguf` loads this family


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("Llama", ("LlamaForCausalLM",),
                ("meta-llama/Llama-3.2-1B-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct (embedded)"),
                "RMSNorm, SiLU-gated MLP, RoPE (default, llama3, linear, dynamic, YaRN, LongRoPE)", gguf=True),
    ModelFamily("Mistral", ("MistralForCausalLM",), ("mistralai/Mistral-7B-Instruct-v0.3",),
                "the Llama block; a `sliding_window` windows every layer, and blocks older than the "
                "window go back to the pool", gguf=True),
    ModelFamily("Qwen2 / Qwen2.5", ("Qwen2ForCausalLM",), ("Qwen/Qwen2.5-7B-Instruct",),
                "q/k/v biases; windowed layers where the config turns them on", gguf=True),
    ModelFamily("Qwen3", ("Qwen3ForCausalLM",), ("Qwen/Qwen3-8B", "Qwen/Qwen3-0.6B"),
                "QK-norm (an RMSNorm over each q and k head before RoPE), no biases"),
    ModelFamily("Gemma", ("GemmaForCausalLM",), ("google/gemma-2b-it",),
                "(1 + w) RMSNorm, GeGLU, embeddings scaled by sqrt(hidden)"),
    ModelFamily("Gemma 2 / Gemma 3 (text)", ("Gemma2ForCausalLM", "Gemma3ForCausalLM"),
                ("google/gemma-2-9b-it", "google/gemma-3-1b-it"),
                "sandwich norms; Gemma 2: attention and final logit soft-caps, alternating windowed and "
                "global layers; Gemma 3: QK-norm, 5 windowed : 1 global, a RoPE base per layer type"),
    ModelFamily("Phi-3 / Phi-4-mini", ("Phi3ForCausalLM",),
                ("microsoft/Phi-3-mini-128k-instruct", "microsoft/Phi-4-mini-instruct"),
                "fused qkv and gate_up tensors in the checkpoint, LongRoPE, partial rotary"),
    ModelFamily("Mixtral", ("MixtralForCausalLM",), ("mistralai/Mixtral-8x7B-Instruct-v0.1",),
                "mixture of experts (top-k of the router's softmax), experts sharded by tensor parallelism",
                quantization="int8 on the attention projections; experts stay in the model dtype"),
    ModelFamily("Qwen3-MoE", ("Qwen3MoeForCausalLM",), ("Qwen/Qwen3-30B-A3B",),
                "mixture of experts (softmax, top-k, renormalized), QK-norm",
                quantization="int8 on the attention projections; experts stay in the model dtype"),
    ModelFamily("OLMoE", ("OlmoeForCausalLM",), ("allenai/OLMoE-1B-7B-0924",),
                "mixture of experts; q/k norms over the whole projection",
                quantization="int8 on the attention projections; experts stay in the model dtype"),
)


def family_of(architecture: str) -> ModelFamily | None:
    return next((f for f in FAMILIES if architecture in f.architectures), None)
