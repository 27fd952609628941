"""The baseline users compare against: HF transformers `generate`, static batches.

Requests are batched in arrival order, left-padded; each batch generates as many
tokens as its longest request needs, and only each request's own output length counts
as useful (what a static-batch server would return).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from llmserve.bench.workloads import BenchRequest


def run_hf_static(model_dir: Path, requests: list[BenchRequest], batch_size: int = 16,
                  dtype: torch.dtype = torch.float32) -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # Outputs run their full length, like ours.
    pad_id = 0
    start = time.perf_counter()
    useful = 0
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids):] = 1
        new_tokens = max(r.output_len for r in batch)
        config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                  pad_token_id=pad_id)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        useful += sum(r.output_len for r in batch)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "output_tokens": useful, "output_tokens_per_s": useful / seconds,
            "batch_size": batch_size}
