"""ModelRunner: loads the model, owns the KV cache and the request states, executes
one StepPlan at a time."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from llmserve.plan import SampledToken, StepPlan, StepResult
from llmserve.worker_info import WorkerInfo
from llmserve.worker import kv_cache as kvc
from llmserve.worker.attention import backend_class, install_backend
from llmserve.worker.input_batch import InputBatch
from llmserve.worker.models.llama import head_dim_of
from llmserve.worker.models.loader import load_config, load_model, parse_dtype
from llmserve.worker.sampler import Sampler


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def eos_token_ids(model_dir: Path, config) -> tuple[int, ...]:
    """Union of config.json's and generation_config.json's eos ids (int or list)."""
    ids = _as_ids(getattr(config, "eos_token_id", None))
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        ids += _as_ids(json.loads(gen.read_text()).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))


class ModelRunner:
    def __init__(
        self,
        model_dir: Path,
        dtype: str = "float32",
        block_size: int = 16,
        kv_cache_memory_bytes: int | None = None,
        num_kv_blocks: int | None = None,
        max_model_len: int | None = None,
        model_name: str | None = None,
        sampler_seed: int | None = None,
        attention_backend: str = "auto",
    ):
        self.model_dir = Path(model_dir)
        self.dtype = parse_dtype(dtype)
        self.block_size = block_size
        self.config = load_config(self.model_dir)
        self.model = load_model(self.model_dir, self.dtype, self.config)
        cfg = self.config
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        window = getattr(cfg, "sliding_window", None)
        if window and getattr(cfg, "use_sliding_window", True):
            # NOTE: no sliding-window attention: cap the length where full attention is exact.
            self.max_model_len = min(self.max_model_len, window)
        num_layers, kvh, hd = cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim_of(cfg)
        if num_kv_blocks is None:
            budget = kv_cache_memory_bytes if kv_cache_memory_bytes is not None else kvc.default_kv_cache_bytes()
            num_kv_blocks = kvc.num_blocks_for_budget(budget, kvc.bytes_per_block(block_size, kvh, hd, num_layers, self.dtype))
        self.num_kv_blocks = num_kv_blocks
        self.kv_caches = kvc.allocate_kv_caches(num_layers, num_kv_blocks, block_size, kvh, hd, self.dtype)
        # "auto": Triton where the KV cache lives on CUDA, torch elsewhere.
        self.attention_backend = backend_class(attention_backend, self.kv_caches[0].device)
        install_backend(self.model, self.attention_backend)
        self.batch = InputBatch(block_size, num_kv_blocks, self.max_model_len, self.attention_backend)
        self.sampler = Sampler(sampler_seed)
        self._info = WorkerInfo(
            model=model_name or self.model_dir.name,
            model_path=str(self.model_dir),
            num_kv_blocks=num_kv_blocks,
            block_size=block_size,
            dtype="bfloat16" if self.dtype == torch.bfloat16 else "float32",
            max_model_len=self.max_model_len,
            vocab_size=cfg.vocab_size,
            eos_token_ids=eos_token_ids(self.model_dir, cfg),
            bos_token_id=cfg.bos_token_id if getattr(cfg, "bos_token_id", None) is not None else -1,
        )

    @property
    def info(self) -> WorkerInfo:
        return self._info

    def reset_requests(self) -> None:
        """Forget every request (a new scheduler stream resends them in full)."""
        self.batch.states.clear()

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step. Raises ValueError on an inconsistent plan (states unchanged)."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            rows = self.batch.apply_plan(plan)
            sampled: list[SampledToken] = []
            if rows:
                sampled = self._run(rows)
        return StepResult(step_id=plan.step_id, sampled=sampled, execute_seconds=time.perf_counter() - t0)

    def _run(self, rows) -> list[SampledToken]:
        inp = self.batch.build_inputs(rows)
        hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta)  # [T, hidden]
        for st, n in rows:
            st.num_computed_tokens += n
        if not inp.sample_states:
            return []
        logits = self.model.compute_logits(hidden[inp.sample_indices])  # [S, vocab]
        states = inp.sample_states
        tokens, logprobs = self.sampler(
            logits, [s.sampling for s in states], [s.num_output_tokens for s in states]
        )
        out = []
        for st, tok, lp in zip(states, tokens, logprobs):
            st.token_ids.append(tok)
            out.append(SampledToken(st.request_id, tok, lp))
        return out
