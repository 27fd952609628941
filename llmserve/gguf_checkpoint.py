"""GGUF checkpoints (llama.cpp's one-file format) served as model directories.

Every service reads a model directory: the router its tokenizer, the scheduler and the
worker config.json. A GGUF holds all of that as metadata, so `write_model_dir` writes it
out once (config.json, generation_config.json and the tokenizer with its chat template,
through transformers' GGUF readers) into a directory under the cache, beside `gguf.json`,
a record naming the file and its tensor types. The weights stay in the GGUF: the worker
reads them from the memory-mapped file one tensor at a time, dequantizing each as it is
copied into its parameter (worker/models/gguf_weights.py).

NOTE: not transformers' `from_pretrained(..., gguf_file=...)` for the weights: it
dequantizes every tensor of the file into one float32 state dict before building its
model (the whole model twice over in float32 at the peak), and ours would then copy it
once more. Tensor by tensor, the host holds one dequantized tensor at a time.

No torch here: `llmserve up` and the router resolve a GGUF too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import Counter
from pathlib import Path

from llmserve.contract.startup_errors import StartupError

RECORD = "gguf.json"
# Written last, so a directory without it is one that did not finish.
COMPLETE_MARKER = ".llmserve-complete"
# general.architecture -> how its tensors are laid out. Only architectures whose tensors map
# one to one onto a model class of ours (models/registry.py). `permuted_qk`: llama.cpp's
# converter reorders each head's q/k rows for its interleaved rotary (the worker undoes it).
# Mistral GGUFs say "llama" (transformers tells them apart by general.name).
ARCHITECTURES: dict[str, dict] = {
    "llama": {"permuted_qk": True},
    "qwen2": {"permuted_qk": False},
}
# config.json model_type (transformers' reading of the file) -> our registry's class name.
MODEL_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
# Tensors llama.cpp writes that change the model in ways we do not apply: refuse, not ignore.
UNSUPPORTED_TENSORS = {"rope_freqs.weight": "Llama 3.1-style rope frequency factors"}


def find_gguf(path: Path) -> Path | None:
    """The GGUF file `path` names: itself, or the one *.gguf of a directory that has no
    config.json (None when `path` is neither; StartupError when a directory holds several)."""
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise StartupError(f"--model {path} holds {len(found)} GGUF files ({', '.join(p.name for p in found[:3])})",
                           "pass the one to serve: --model DIR/NAME.gguf")
    return found[0] if found else None


def _scan(gguf_path: Path) -> dict:
    """The record's facts, from the file's header (memory-mapped; no tensor is read)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else "(none)"
    types = Counter(t.tensor_type.name for t in reader.tensors)
    # The checkpoint's precision is its matrices' (norms and biases are F32 in every GGUF).
    matrices = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2)
    unsupported = sorted(t.name for t in reader.tensors if t.name in UNSUPPORTED_TENSORS)
    return {"architecture": arch, "weight_type": matrices.most_common(1)[0][0] if matrices else "F32",
            "tensor_types": dict(types), "unsupported_tensors": unsupported}


def check_supported(gguf_path: Path, facts: dict) -> None:
    """StartupError, in one line, unless the GGUF's architecture and tensors are ones we run."""
    arch = facts["architecture"]
    if arch not in ARCHITECTURES:
        raise StartupError(f"--model {gguf_path}: unsupported GGUF architecture '{arch}'",
                           f"llmserve runs GGUF architectures {', '.join(sorted(ARCHITECTURES))}; "
                           f"others as a Hugging Face directory of a supported architecture")
    if facts["unsupported_tensors"]:
        name = facts["unsupported_tensors"][0]
        raise StartupError(f"--model {gguf_path}: the GGUF carries {name} ({UNSUPPORTED_TENSORS[name]}), "
                           f"which llmserve does not apply", "serve the model's Hugging Face directory instead")


def write_record(model_dir: Path, gguf_path: Path, facts: dict, weights_in_gguf: bool) -> None:
    record = {"gguf": str(gguf_path.resolve()), "weights_in_gguf": weights_in_gguf, **facts}
    tmp = model_dir / f"{RECORD}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(model_dir / RECORD)  # Atomic: a reader sees the whole record or none.


def read_record(model_dir: Path) -> dict | None:
    """The directory's gguf.json (None for a plain HF directory)."""
    path = Path(model_dir) / RECORD
    return json.loads(path.read_text()) if path.is_file() else None


def quantized_weight_type(model_dir: Path) -> str | None:
    """The GGUF type its matrices are stored in ("Q4_1", "Q8_0", ...) when the directory
    comes from a quantized GGUF, else None (float GGUFs and HF directories)."""
    record = read_record(model_dir)
    if record is None or record["weight_type"] in FLOAT_TYPES:
        return None
    return record["weight_type"]


def gguf_weights(model_dir: Path) -> Path | None:
    """The GGUF file the worker reads this directory's weights from, if it does."""
    record = read_record(model_dir)
    return Path(record["gguf"]) if record is not None and record["weights_in_gguf"] else None


def _write_metadata(gguf_path: Path, out_dir: Path, facts: dict) -> None:
    """config.json, generation_config.json and the tokenizer files, from the GGUF's metadata."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    src, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(src, gguf_file=name)
    config.architectures = [MODEL_CLASSES.get(config.model_type, config.model_type)]
    if facts["weight_type"] in FLOAT_TYPES:  # `--dtype auto` reads it as it reads any checkpoint's.
        config.dtype = FLOAT_TYPES[facts["weight_type"]]
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(src, gguf_file=name).save_pretrained(out_dir)


def model_dir_for(gguf_path: Path, root: Path) -> Path:
    """Where the GGUF's directory lives under `root`: keyed by the file's path, size and
    time, so a replaced file gets a fresh one; named after the file (the served name)."""
    stat = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return root / "gguf" / key / gguf_path.stem


def gguf_model_dir(gguf_path: Path, root: Path) -> Path:
    """The model directory of `gguf_path` (weights read from the GGUF itself), written
    under `root` on first use; StartupError for an architecture we do not run."""
    out_dir = model_dir_for(gguf_path, root)
    if (out_dir / COMPLETE_MARKER).is_file():
        return out_dir
    facts = _scan(gguf_path)
    check_supported(gguf_path, facts)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    _write_metadata(gguf_path, tmp, facts)
    write_record(tmp, gguf_path, facts, weights_in_gguf=True)
    (tmp / COMPLETE_MARKER).write_text(str(gguf_path))
    try:
        tmp.rename(out_dir)
    except OSError:  # Another process finished the same directory first; theirs is as good.
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
