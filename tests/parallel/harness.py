"""Runs a tiny model on one rank of a TP x PP group (spawned processes, gloo) and greedy-
decodes a few prompts through the paged KV cache, the way a worker step does."""

from __future__ import annotations

import os
import pickle
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

BLOCK = 4


@dataclass
class RankResult:
    rank: int
    tokens: list[list[int]]  # generated ids per prompt (identical on every rank)
    logits: list[torch.Tensor] | None  # per prompt [steps, V]: the driver only
    param_shapes: dict[str, tuple[int, ...]]  # this rank's resident parameters
    kv_cache_shape: tuple[int, ...]
    num_kv_caches: int


def resident_weight_shapes(model) -> dict[str, tuple[int, ...]]:
    """Parameter name -> the [out, in] shape this rank multiplies by. A weight held only in
    its GEMM library's packed layout (its dense Parameter emptied at load) reports the
    packed operand's shape; an LM head held as its transposed copy reports that."""
    shapes = {}
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            shape = tuple(p.shape)
            if name == "weight" and p.numel() == 0:
                packed = getattr(module, "packed", None) or getattr(module, "w_packed", None)
                if packed is not None:
                    shape = (packed.out_features, packed.in_features)
                elif getattr(module, "w_t", None) is not None and module.w_t.numel():
                    shape = tuple(module.w_t.t().shape)
            shapes.setdefault(full, shape)
    return shapes


def greedy(model, parallel, prompts: list[list[int]], steps: int, dtype: torch.dtype = torch.float32
           ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill every prompt in one step, then `steps - 1` batched decode steps (KV cache in `dtype`)."""
    from llmserve.worker.attention import TorchPagedAttention
    from llmserve.worker.kv_cache import allocate_kv_caches
    from llmserve.worker.models.decoder import head_dim_of, local_kv_heads
    from llmserve.worker.pipeline import forward_step

    cfg = model.config
    need = [-(-(len(p) + steps) // BLOCK) for p in prompts]
    free = list(range(sum(need)))[::-1]  # non-contiguous, descending block ids
    tables = [[free.pop(0) for _ in range(n)] for n in need]
    kv = allocate_kv_caches(model.num_local_layers, sum(need), BLOCK, local_kv_heads(cfg, parallel.tp.size),
                            head_dim_of(cfg), dtype)
    seqs = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    out_tokens: list[list[int]] = [[] for _ in prompts]
    out_logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    for _ in range(steps):
        ids, pos, slots, qlens, slens, sample = [], [], [], [], [], []
        for i, s in enumerate(seqs):
            p = list(range(computed[i], len(s)))
            ids += s[computed[i]:]
            pos += p
            slots += [tables[i][j // BLOCK] * BLOCK + j % BLOCK for j in p]
            qlens.append(len(p))
            slens.append(len(s))
            sample.append(len(ids) - 1)
            computed[i] = len(s)
        meta = TorchPagedAttention.build_metadata(qlens, slens, tables, torch.tensor(slots), BLOCK)
        with torch.inference_mode():
            logits = forward_step(model, parallel, torch.tensor(ids), torch.tensor(pos), kv, meta,
                                  torch.tensor(sample))
        picked = logits.argmax(-1) if parallel.is_driver else torch.empty(len(seqs), dtype=torch.long)
        picked = parallel.broadcast_tensor_from_driver(picked).tolist()
        for i, t in enumerate(picked):
            seqs[i].append(t)
            out_tokens[i].append(t)
            if parallel.is_driver:
                out_logits[i].append(logits[i])
    return out_tokens, [torch.stack(l) if l else None for l in out_logits]


def run_rank(rank: int, tp: int, pp: int, port: int, jobs: list[tuple[str, list[list[int]], int]], queue) -> None:
    """Spawned entry point: one rank, every job (model dir, prompts, steps) in turn."""
    try:
        torch.set_num_threads(1)
        from llmserve.worker.distributed import DistInit, init_parallel, shutdown_parallel
        from llmserve.worker.models.loader import load_model

        parallel = init_parallel(DistInit(tp, pp, rank, f"tcp://127.0.0.1:{port}", timeout_s=60))
        results = []
        for model_dir, prompts, steps in jobs:
            model = load_model(Path(model_dir), "float32", parallel=parallel)
            tokens, logits = greedy(model, parallel, prompts, steps)
            shapes = resident_weight_shapes(model)
            from llmserve.worker.models.decoder import head_dim_of, local_kv_heads
            kv_shape = (2, 1, BLOCK, local_kv_heads(model.config, tp), head_dim_of(model.config))
            results.append(RankResult(rank, tokens, logits if parallel.is_driver else None, shapes, kv_shape,
                                      model.num_local_layers))
        # NOTE: plain pickle bytes, not torch's shared-memory tensor passing (the child may
        # exit before the parent maps the shared storage).
        queue.put((rank, pickle.dumps(results), None))
        shutdown_parallel(parallel)
    except BaseException:  # noqa: BLE001 - reported to the parent test
        queue.put((rank, None, traceback.format_exc()))


def run_group(tp: int, pp: int, jobs, timeout_s: float = 240.0) -> dict[int, list[RankResult]]:
    """Spawn tp*pp ranks of `run_rank`; returns rank -> its results, one per job."""
    return spawn_ranks(run_rank, tp, pp, jobs, timeout_s=timeout_s)


def spawn_ranks(target, tp: int, pp: int, *args, timeout_s: float = 240.0) -> dict:
    """Spawn tp*pp processes of target(rank, tp, pp, port, *args, queue); each puts
    (rank, pickled result, error). Returns rank -> unpickled result."""
    import torch.multiprocessing as mp

    from llmserve.launcher.cluster import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    env_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        procs = [ctx.Process(target=target, args=(r, tp, pp, port, *args, queue), daemon=True)
                 for r in range(tp * pp)]
        for p in procs:
            p.start()
    finally:
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_threads
    out, errors = {}, []
    try:
        for _ in procs:
            rank, results, err = queue.get(timeout=timeout_s)
            if err:
                errors.append(f"rank {rank}:\n{err}")
            out[rank] = pickle.loads(results) if results is not None else None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert not errors, "\n".join(errors)
    return out
