"""config.json `architectures` -> model class."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from llmserve.contract.startup_errors import StartupError

if TYPE_CHECKING:  # NOTE: no torch at import: `llmserve up` checks a model's architecture here first.
    from torch import nn

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llmserve.worker.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llmserve.worker.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llmserve.worker.models.llama", "Qwen2ForCausalLM"),
    "GemmaForCausalLM": ("llmserve.worker.models.gemma", "GemmaForCausalLM"),
    "Qwen3ForCausalLM": ("llmserve.worker.models.qwen3", "Qwen3ForCausalLM"),
    "Gemma2ForCausalLM": ("llmserve.worker.models.gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("llmserve.worker.models.gemma2", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("llmserve.worker.models.phi3", "Phi3ForCausalLM"),
    "MixtralForCausalLM": ("llmserve.worker.models.mixtral", "MixtralForCausalLM"),
    "Qwen3MoeForCausalLM": ("llmserve.worker.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "OlmoeForCausalLM": ("llmserve.worker.models.olmoe", "OlmoeForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def check_architectures(archs: list[str], model_dir: str = "") -> str:
    """The first supported one of config.json's `architectures`; StartupError if none is."""
    for arch in archs:
        if arch in _MODELS:
            return arch
    named = ", ".join(archs) if archs else "(none named in config.json)"
    where = f"--model {model_dir}: " if model_dir else ""
    raise StartupError(f"{where}unsupported model architecture {named}",
                       f"llmserve runs {', '.join(supported_architectures())}")


def model_class(config: Any) -> type[nn.Module]:
    arch = check_architectures(list(getattr(config, "architectures", None) or []))
    module, cls = _MODELS[arch]
    return getattr(importlib.import_module(module), cls)
