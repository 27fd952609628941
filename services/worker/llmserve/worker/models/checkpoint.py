"""What a model directory must hold before the worker loads it: a config.json naming a
supported architecture, and safetensors weights.

Cheap (one JSON file, one directory listing, no torch), so `llmserve up` checks the model
here before it starts any process, and the worker before it loads a byte of weights.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmserve.contract.startup_errors import StartupError
from llmserve.gguf_checkpoint import gguf_weights
from llmserve.worker.models.registry import check_architectures


def check_weights(model_dir: Path) -> list[Path]:
    """The directory's *.safetensors files, in load order, or the one GGUF its weights are
    read from (a GGUF's directory, gguf_checkpoint.py); StartupError if it has neither."""
    gguf = gguf_weights(Path(model_dir))
    if gguf is not None:
        if not gguf.is_file():
            raise StartupError(f"--model {model_dir}: its GGUF {gguf} is gone", "pass the GGUF file as --model again")
        return [gguf]
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in Path(model_dir).glob("*") if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
        found = f" (it has {', '.join(others[:3])})" if others else ""
        raise StartupError(f"--model {model_dir} has no *.safetensors weights{found}",
                           "llmserve loads safetensors checkpoints and GGUF files: save the model with "
                           "transformers' save_pretrained(dir, safe_serialization=True), or pass a GGUF file as --model")
    return files


def check_model_dir(model_dir: Path) -> None:
    """StartupError unless `model_dir` names a supported architecture and holds weights."""
    config_path = Path(model_dir) / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise StartupError(f"cannot read {config_path}: {err}",
                           "--model takes a local Hugging Face model directory") from err
    archs = config.get("architectures") if isinstance(config, dict) else None
    check_architectures(list(archs or []), str(model_dir))
    check_weights(model_dir)
