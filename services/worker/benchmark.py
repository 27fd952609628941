"""Time ModelRunner steps against HF transformers' forward on the same machine.

  python -m llmserve.worker.benchmark [--model DIR] [--dtype float32] [--batches 16,64]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from llmserve.model_store import resolve_model_dir
from llmserve.plan import CachedRequestData, NewRequestData, StepPlan, WorkerSamplingParams
from llmserve.worker.model_runner import ModelRunner


def _time(fn, reps: int) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1000


def bench_runner(runner: ModelRunner, batch: int, ctx: int, reps: int) -> float:
    """Median ms of one decode step for `batch` requests with `ctx` tokens of context."""
    bs, g = runner.block_size, WorkerSamplingParams(temperature=0.0)
    nb = -(-(ctx + reps + 2) // bs)
    rng = random.Random(0)
    plan = StepPlan(0, finished_request_ids=list(runner.batch.states))
    for i in range(batch):
        plan.new_requests.append(NewRequestData(
            f"r{i}", [rng.randrange(1000) for _ in range(ctx)], ctx, g, list(range(i * nb, (i + 1) * nb)), 0, ctx))
    runner.execute(plan)
    step = [1]

    def decode():
        n = ctx + step[0] - 1
        runner.execute(StepPlan(step[0], cached_requests=[CachedRequestData(f"r{i}", [], n, 1) for i in range(batch)]))
        step[0] += 1

    return _time(decode, reps)


def bench_prefill(runner: ModelRunner, n: int, reps: int) -> float:
    g = WorkerSamplingParams(temperature=0.0)
    nb = -(-n // runner.block_size)
    ids = [random.Random(1).randrange(1000) for _ in range(n)]
    k = [0]

    def prefill():
        rid = f"p{k[0]}"
        k[0] += 1
        runner.execute(StepPlan(k[0], new_requests=[NewRequestData(rid, ids, n, g, list(range(nb)), 0, n)],
                                finished_request_ids=list(runner.batch.states)))

    return _time(prefill, reps)


def bench_hf(model_dir, dtype, batch: int, ctx: int, reps: int) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    with torch.inference_mode():
        ids = torch.randint(0, 1000, (batch, ctx))
        out = hf(ids, use_cache=True)
        cache = out.past_key_values
        nxt = torch.randint(0, 1000, (batch, 1))

        def decode():
            hf(nxt, past_key_values=cache, use_cache=True)
            cache.crop(-1)

        d = _time(decode, reps)
        p = _time(lambda: hf(torch.randint(0, 1000, (1, 256))), max(2, reps // 2))
    return d, p


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--ctx", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-hf", action="store_true")
    a = ap.parse_args()
    model_dir = resolve_model_dir(a.model)
    batches = [int(b) for b in a.batches.split(",")]
    runner = ModelRunner(model_dir, a.dtype, num_kv_blocks=max(batches) * (-(-(a.ctx + a.reps + 2) // 16)) + 32)
    with torch.inference_mode():
        for b in batches:
            print(f"ours decode batch {b:3d} ctx {a.ctx}: {bench_runner(runner, b, a.ctx, a.reps):7.1f} ms")
        print(f"ours prefill 256:                {bench_prefill(runner, 256, a.reps):7.1f} ms")
    if not a.no_hf:
        dt = runner.dtype
        del runner
        for b in batches:
            d, p = bench_hf(model_dir, dt, b, a.ctx, a.reps)
            print(f"HF   decode batch {b:3d} ctx {a.ctx}: {d:7.1f} ms   (HF prefill 256: {p:.1f} ms)")


if __name__ == "__main__":
    main()
