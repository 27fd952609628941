"""`llmserve bench overhead`'s third table (after the cluster's phases and its processes'
CPU): the in-process engine (launcher/engine.py, what `bench offline` and `bench
decode-floor` drive) over the same simulated device, its serial loop against its
pipelined one, no process or network in between.

Per decode batch B: B requests of `prompt_len` random tokens, prefilled, then `steps`
whole engine steps timed after a few untimed ones (the simulated device runs each step
for X ms on its own thread, as a GPU would). Busy % = X x steps / wall; host ms per step
= what the serial loop's wall adds to X. Every output token is checked against the
simulated worker's function.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from llmserve.contract.sampling import SamplingParams

WARMUP_STEPS = 4


def measure(model_dir: Path, step_ms: float, batch: int, pipelined: bool, prompts: list[list[int]], steps: int,
            model: dict) -> dict:
    """One loop at one batch size: wall ms per decode step, busy %, and whether every token
    is the simulated worker's."""
    from llmserve.bench.overhead import expected_tokens
    from llmserve.launcher.engine import InProcessEngine
    from llmserve.scheduler.config import SchedulerConfig
    from llmserve.worker.config import RunnerConfig
    from llmserve.worker.simulated_runner import SimulatedRunner

    runner = SimulatedRunner(model_dir, RunnerConfig(), step_ms)
    # Every prompt prefilled in one step, every sequence in every decode step.
    config = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * len(prompts[0])),
                             async_scheduling=pipelined)
    engine = InProcessEngine(runner, config)
    max_tokens = 1 + WARMUP_STEPS + steps + 2  # the prefill's token, the steps, and a margin: none ends while timed
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, sampling)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}

    def step() -> None:
        for out in engine.step():
            got[out.request_id] += out.new_token_ids

    while engine.scheduler.waiting:  # The prefill.
        step()
    for _ in range(WARMUP_STEPS):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    wall = (time.perf_counter() - start) / steps
    while engine.has_unfinished():
        step()
    runner.reset_requests()
    ok = all(got[f"r{i}"] == expected_tokens(p, max_tokens, model["vocab_size"], model["eos"])
             for i, p in enumerate(prompts))
    return {"step_ms": step_ms, "loop": "pipelined" if pipelined else "serial", "batch": batch,
            "wall_ms_per_step": 1000 * wall, "busy": step_ms / 1000 / wall, "tokens_ok": ok}


def run(model_dir: Path, step_ms: float, batches: list[int], prompt_len: int, steps: int, model: dict,
        seed: int) -> list[dict]:
    """Each batch size, the serial loop then the pipelined one."""
    rng = random.Random(seed)
    results = []
    for batch in batches:
        prompts = [[rng.randrange(3, model["vocab_size"]) for _ in range(prompt_len)] for _ in range(batch)]
        results += [measure(model_dir, step_ms, batch, pipelined, prompts, steps, model) for pipelined in (False, True)]
    return results


def format_table(results: list[dict]) -> str:
    lines = ["| step ms |      loop | batch | wall ms/step | busy % | host ms/step (serial) | tokens |",
             "|---------|-----------|-------|--------------|--------|-----------------------|--------|"]
    for r in results:
        host = f"{r['wall_ms_per_step'] - r['step_ms']:.3f}" if r["loop"] == "serial" else "—"
        lines.append(f"| {r['step_ms']:>7g} | {r['loop']:>9} | {r['batch']:>5} | {r['wall_ms_per_step']:>12.3f} | "
                     f"{100 * r['busy']:>6.1f} | {host:>21} | {'ok' if r['tokens_ok'] else 'WRONG':>6} |")
    return "\n".join(lines)
