"""`llmserve bench quality`: what a dtype or a quantization costs in accuracy, against
float32 on the same model and text.

Teacher forcing: the text's tokens go through our model (the worker's own classes, paged
KV cache, chunked prefill as the scheduler would cut it) and every position's logits are
kept. Two figures per variant:
  - perplexity: exp(mean negative log-likelihood of each next token), and its change
    relative to float32's;
  - next-token agreement: the share of positions where the variant's argmax equals
    float32's argmax (what a greedy decode would pick, one token at a time).

The text is `stdlib_docstrings()`: the docstrings of Python's `json`, `argparse`,
`collections` and `functools` modules and their public members (`inspect.getdoc`, PSF
licence), English prose with some code. It is built from this interpreter's standard
library, so it is fixed for a Python version and needs no file or download.
"""

from __future__ import annotations

import importlib
import inspect
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from llmserve.contract.arith import cdiv

TEXT_MODULES = ("json", "argparse", "collections", "functools")
DEFAULT_MAX_TOKENS = 2048
CHUNK_TOKENS = 256  # prefill chunk: the scheduler's step budget order of magnitude
BLOCK_SIZE = 16


def stdlib_docstrings(modules: tuple[str, ...] = TEXT_MODULES) -> str:
    """The modules' docstrings, then their public members' in name order, as one text."""
    parts = []
    for name in modules:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for attr in sorted(getattr(module, "__all__", [])):
            doc = inspect.getdoc(getattr(module, attr, None))
            if doc and getattr(getattr(module, attr), "__module__", name).startswith(name):
                parts.append(doc)
    return "\n\n".join(p for p in parts if p)


@dataclass(frozen=True)
class Variant:
    """One way to run the model: its dtype and weight quantization."""

    dtype: str
    quantization: str = "none"

    @property
    def name(self) -> str:
        return self.dtype if self.quantization == "none" else f"{self.quantization} ({self.dtype})"


def teacher_forced_logits(model, token_ids: list[int], chunk: int = CHUNK_TOKENS) -> torch.Tensor:
    """logits [len(token_ids), vocab] (float32) at every position, through the paged KV
    cache in prefill chunks of `chunk` tokens (one sequence)."""
    from llmserve.worker.attention import TorchPagedAttention
    from llmserve.worker.kv_cache import allocate_kv_caches
    from llmserve.worker.models.decoder import head_dim_of, local_kv_heads

    cfg, n = model.config, len(token_ids)
    num_blocks = cdiv(n, BLOCK_SIZE)
    dtype = model.model.norm.weight.dtype
    caches = allocate_kv_caches(model.num_local_layers, num_blocks, BLOCK_SIZE, local_kv_heads(cfg, 1),
                                head_dim_of(cfg), dtype)
    table = list(range(num_blocks))  # the sequence's blocks, in order
    out = []
    with torch.inference_mode():
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            positions = torch.arange(start, end)
            meta = TorchPagedAttention.build_metadata([end - start], [end], [table], positions.clone(), BLOCK_SIZE)
            hidden = model(torch.tensor(token_ids[start:end]), positions, caches, meta)  # [chunk, hidden]
            out.append(model.compute_logits(hidden).float())  # [chunk, vocab]
    return torch.cat(out)


def perplexity(logits: torch.Tensor, token_ids: list[int]) -> float:
    """exp(mean NLL of token i+1 given logits at i), over the n-1 predicted tokens."""
    targets = torch.tensor(token_ids[1:])
    nll = torch.nn.functional.cross_entropy(logits[:-1], targets)
    return math.exp(nll.item())


def agreement(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """Share of positions where the two argmaxes agree."""
    return (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()


def evaluate(model_dir: Path, variants: list[Variant], token_ids: list[int]) -> dict:
    """Perplexity and argmax agreement with float32 for each variant (float32 first)."""
    from llmserve.worker.models.loader import load_model

    rows, reference = {}, None
    for variant in [Variant("float32"), *[v for v in variants if v != Variant("float32")]]:
        model = load_model(model_dir, variant.dtype, quantization=variant.quantization)
        start = time.perf_counter()
        logits = teacher_forced_logits(model, token_ids)
        seconds = time.perf_counter() - start
        reference = logits if reference is None else reference
        rows[variant.name] = {"dtype": variant.dtype, "quantization": variant.quantization,
                              "perplexity": perplexity(logits, token_ids),
                              "agreement_with_float32": agreement(logits, reference), "seconds": seconds}
        del model
    base = rows["float32"]["perplexity"]
    for row in rows.values():
        row["perplexity_change"] = row["perplexity"] / base - 1
    return rows


def text_token_ids(model_dir: Path, max_tokens: int) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return tokenizer(stdlib_docstrings(), add_special_tokens=False)["input_ids"][:max_tokens]


def print_table(rows: dict, num_tokens: int) -> None:
    print(f"teacher-forced over {num_tokens} tokens of {', '.join(TEXT_MODULES)} docstrings:", flush=True)
    print(f"{'variant':<28} {'perplexity':>10} {'vs fp32':>8} {'argmax = fp32':>13}", flush=True)
    for name, row in rows.items():
        print(f"{name:<28} {row['perplexity']:>10.3f} {100 * row['perplexity_change']:>+7.2f}% "
              f"{100 * row['agreement_with_float32']:>12.2f}%", flush=True)


def bench_quality(args) -> int:
    from llmserve.bench.report import machine_info, save_report
    from llmserve.model_store import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    token_ids = text_token_ids(model_dir, args.max_tokens)
    variants = [Variant(d, q) for d in args.dtypes for q in ("none",)]
    variants += [Variant(d, q) for d in args.quantized_dtype for q in args.quantization if q != "none"]
    rows = evaluate(model_dir, variants, token_ids)
    print_table(rows, len(token_ids))
    report = {"kind": "quality", "machine": machine_info(), "command": " ".join(args.argv),
              "text": f"docstrings of {', '.join(TEXT_MODULES)}", "num_tokens": len(token_ids), "variants": rows}
    save_report(report, args.output_dir, f"quality-{time.strftime('%Y%m%d-%H%M%S')}.json")
    return 0

