"""The baselines users compare against: HF transformers on the same weights.

- `hf`: `generate` with static batches in arrival order, left-padded; each batch
  generates as many tokens as its longest request needs, and only each request's own
  output length counts as useful (what a static-batch server would return).
- `hf-cb`: transformers' own continuous batching (the ContinuousBatchingManager behind
  `generate_batch`), each request with its own max_new_tokens.

Both run on the engine's device in its dtype (on CUDA: the model and its inputs there,
clocks read once the device is idle).
"""

from __future__ import annotations

from pathlib import Path

import torch

from llmserve.bench.clock import now
from llmserve.bench.workloads import BenchRequest


def _load(model_dir: Path, dtype: torch.dtype, device: torch.device, attn_implementation: str | None = None):
    from transformers import AutoModelForCausalLM

    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kwargs).to(device).eval()
    model.generation_config.eos_token_id = None  # Outputs run their full length, like ours.
    return model


def _left_padded(batch: list[BenchRequest], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask, both [len(batch), longest prompt], prompts right-aligned."""
    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, r in enumerate(batch):
        ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
        mask[row, width - len(r.prompt_token_ids):] = 1
    return ids.to(device), mask.to(device)


def _generate(model, batch: list[BenchRequest], pad_id: int, device: torch.device) -> list[list[int]]:
    """Greedy `generate` of one static batch for its longest output; each row's own
    output_len tokens of it."""
    from transformers import GenerationConfig

    ids, mask = _left_padded(batch, pad_id, device)
    config = GenerationConfig(max_new_tokens=max(r.output_len for r in batch), do_sample=False,
                              eos_token_id=None, pad_token_id=pad_id)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)  # [B, width + new]
    width = ids.shape[1]
    return [out[row, width:width + r.output_len].tolist() for row, r in enumerate(batch)]


def run_hf_static(model_dir: Path, requests: list[BenchRequest], batch_size: int = 16,
                  dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> dict:
    device = torch.device(device)
    model = _load(model_dir, dtype, device)
    pad_id = 0
    # Warm-up, as the engine gets one: first calls pay for lazy initialisation (cuBLAS
    # handles, kernel choices), not for generating.
    _generate(model, [BenchRequest(requests[0].prompt_token_ids[:16], 2)], pad_id, device)
    outputs = {}
    start = now(device)
    for i in range(0, len(requests), batch_size):
        for row, ids in enumerate(_generate(model, requests[i:i + batch_size], pad_id, device)):
            outputs[f"r{i + row}"] = ids
    seconds = now(device) - start
    useful = sum(r.output_len for r in requests)
    return {"seconds": seconds, "output_tokens": useful, "output_tokens_per_s": useful / seconds,
            "batch_size": batch_size, "outputs": outputs}


def run_hf_continuous(model_dir: Path, requests: list[BenchRequest], dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu") -> dict:
    from transformers import GenerationConfig

    device = torch.device(device)
    model = _load(model_dir, dtype, device, attn_implementation="sdpa")
    config = GenerationConfig(max_new_tokens=max(r.output_len for r in requests), do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    outputs = {}
    start = now(device)
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5) as manager:
        ids = {manager.add_request(r.prompt_token_ids, request_id=f"r{i}", max_new_tokens=r.output_len): f"r{i}"
               for i, r in enumerate(requests)}
        while len(outputs) < len(requests):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching stopped early")
                continue
            if result.is_finished():
                outputs[ids[result.request_id]] = list(result.generated_tokens)
    seconds = now(device) - start
    useful = sum(len(v) for v in outputs.values())
    return {"seconds": seconds, "output_tokens": useful, "output_tokens_per_s": useful / seconds,
            "outputs": outputs}
