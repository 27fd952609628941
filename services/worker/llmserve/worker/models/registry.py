"""config.json `architectures` -> model class."""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llmserve.worker.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llmserve.worker.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llmserve.worker.models.llama", "Qwen2ForCausalLM"),
    "GemmaForCausalLM": ("llmserve.worker.models.gemma", "GemmaForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(config: Any) -> type[nn.Module]:
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if arch in _MODELS:
            module, cls = _MODELS[arch]
            return getattr(importlib.import_module(module), cls)
    raise ValueError(f"unsupported model architecture {archs or '(none in config.json)'}; "
                     f"supported: {', '.join(supported_architectures())}")
