"""What a model directory must hold before the worker loads it: a config.json naming a
supported architecture, and safetensors weights.

Cheap (one JSON file, one directory listing, no torch), so `llmserve up` checks the model
here before it starts any process, and the worker before it loads a byte of weights.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmserve.contract.startup_errors import StartupError
from llmserve.worker.models.registry import check_architectures


def check_weights(model_dir: Path) -> list[Path]:
    """The directory's *.safetensors files, in load order; StartupError if it has none."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in Path(model_dir).glob("*") if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
        found = f" (it has {', '.join(others[:3])})" if others else ""
        raise StartupError(f"--model {model_dir} has no *.safetensors weights{found}",
                           "llmserve loads safetensors checkpoints only: save the model with transformers' "
                           "save_pretrained(dir, safe_serialization=True)")
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
