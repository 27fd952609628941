"""`llmserve bench overhead`: the host path of a step, measured without a GPU.

A local cluster as deployed (router, scheduler and worker processes, mutual TLS) whose
worker simulates the device (`--simulated-step-ms X`: each step does the real input
preparation, then sleeps X ms, then returns deterministic tokens; worker/simulated_runner.py).
For each X and each engine loop (serial; pipelined with the scheduler's async_scheduling
where it exists) it drives decode batches (N requests at once, short prompts, eos
ignored) and a mixed scenario (decodes running while long prompts arrive, so steps carry
prefill chunks beside decodes), and reports per scenario: steps, wall time, the device-busy
fraction (X x steps / wall) and host ms per step by phase (bench/overhead_phases.py says
what each covers). Every output token is checked against the simulated worker's function.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from llmserve.bench import cpu_usage
from llmserve.bench.overhead_phases import format_table, phase_figures
from llmserve.contract.arith import cdiv
from llmserve.telemetry import step_phases

SETTLE_LIMIT_S = 5.0


async def settled_snapshot(phases_dir: Path) -> tuple[dict, dict]:
    """(scheduler, worker) totals once two reads a write interval and a half apart agree,
    and the worker has written as many plans as the scheduler sent (between scenarios
    every plan sent has been run): both services have written what they did. Agreeing
    reads alone are not enough: a writer that falls behind by more than the interval
    (2 busy cores) leaves a file unchanged that is not up to date."""
    read = lambda: (step_phases.read(phases_dir, "scheduler"), step_phases.read(phases_dir, "worker"))  # noqa: E731
    last, deadline = read(), time.monotonic() + SETTLE_LIMIT_S
    while time.monotonic() < deadline:
        await asyncio.sleep(1.5 * step_phases.WRITE_INTERVAL_S)
        now = read()
        if now == last and all(now) and now[0].get("plans") == now[1].get("plans"):
            return now
        last = now
    return last


@dataclass(frozen=True)
class Scenario:
    name: str
    decoders: int  # Requests decoding from the start: short prompts, `max_tokens` each.
    prompt_len: int
    max_tokens: int
    prefills: int = 0  # Long-prompt requests arriving while they decode (the mixed scenario).
    prefill_len: int = 0
    prefill_concurrency: int = 1


def scenarios(batches: list[int], prompt_len: int, max_tokens: int, mixed: bool = True) -> list[Scenario]:
    out = [Scenario(f"decode-{b}", b, prompt_len, max_tokens) for b in batches]
    if mixed:
        # 64 decodes (fewer when the largest batch is smaller) and 512-token prompts two at
        # a time: most steps carry a prefill chunk beside the decode rows.
        decoders = min(64, max(batches))
        out.append(Scenario(f"mixed-{decoders}+prefill", decoders, prompt_len, max_tokens,
                            prefills=max(4, max_tokens // 8), prefill_len=512, prefill_concurrency=2))
    return out


LOOPS = [False, True]  # async_scheduling: the serial loop, then the pipelined one.


def cluster_spec(model_dir: Path, step_ms: float, pipelined: bool, todo: list[Scenario], phases_dir: Path,
                 log_dir: Path | None, stream_interval: int = 1):
    from llmserve.launcher.cluster import ClusterSpec, free_port
    from llmserve.scheduler.config import SchedulerConfig, SchedulerServiceConfig
    from llmserve.worker.config import RunnerConfig, WorkerConfig

    max_seqs = max(s.decoders + s.prefill_concurrency * bool(s.prefills) for s in todo)
    # Block ids for every request of the largest scenario at its longest, twice over: no preemption.
    blocks = max(cdiv(max(s.prompt_len, s.prefill_len) + s.max_tokens, 16) * (s.decoders + s.prefill_concurrency)
                 for s in todo)
    scheduling = replace(SchedulerConfig(), max_num_seqs=max(256, max_seqs),
                         max_num_batched_tokens=max(2048, max_seqs + 512))
    scheduling = replace(scheduling, async_scheduling=pipelined)
    worker = WorkerConfig(simulated_step_ms=step_ms, runner=RunnerConfig(num_kv_blocks=2 * blocks + 64, swap_space=0))
    env = {step_phases.ENV: str(phases_dir)}
    return ClusterSpec(model_dir=model_dir, worker=worker,
                       scheduler=SchedulerServiceConfig(scheduling=scheduling, stream_interval=stream_interval),
                       router_port=free_port(), scheduler_port=free_port(), worker_port=free_port(),
                       log_level="WARNING", log_dir=log_dir, service_env={"scheduler": env, "worker": env})


def prompts(scenario: Scenario, vocab_size: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) per request, decoders first; distinct random prompts."""
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(1, vocab_size) for _ in range(n)]  # noqa: E731
    return ([(draw(scenario.prompt_len), scenario.max_tokens) for _ in range(scenario.decoders)]
            + [(draw(scenario.prefill_len), 2) for _ in range(scenario.prefills)])


def expected_tokens(prompt: list[int], count: int, vocab_size: int, eos: frozenset[int]) -> list[int]:
    """What the simulated worker samples after `prompt`, `count` tokens."""
    from llmserve.worker.simulated_runner import simulated_token

    out, previous = [], prompt[-1]
    for position in range(len(prompt), len(prompt) + count):
        previous = simulated_token(position, previous, vocab_size, eos)
        out.append(previous)
    return out


async def drive(client, scenario: Scenario, requests: list[tuple[list[int], int]]) -> tuple[float, list, list]:
    """Sends the scenario's requests (decoders at once, prefills `prefill_concurrency` at
    a time); the wall time, each request's tokens (or its error), and each decoder's
    token arrivals (perf_counter time, tokens) for the steady-state window."""
    limit = asyncio.Semaphore(scenario.prefill_concurrency)
    arrivals: list[list[tuple[float, int]]] = [[] for _ in range(scenario.decoders)]

    async def one(index: int, prompt: list[int], max_tokens: int):
        ids = []
        try:
            if index < scenario.decoders:
                async for delta in client.generate(token_ids=prompt, max_tokens=max_tokens, temperature=0.0,
                                                   ignore_eos=True):
                    ids += delta.token_ids
                    arrivals[index].append((time.perf_counter(), len(delta.token_ids)))
                return ids
            async with limit:
                async for delta in client.generate(token_ids=prompt, max_tokens=max_tokens, temperature=0.0,
                                                   ignore_eos=True):
                    ids += delta.token_ids
            return ids
        except Exception as err:  # Counted as a bad request, not fatal to the run.
            return err

    start = time.perf_counter()
    outputs = await asyncio.gather(*(one(i, p, m) for i, (p, m) in enumerate(requests)))
    return time.perf_counter() - start, outputs, arrivals


def steady_state(arrivals: list[list[tuple[float, int]]], step_ms: float) -> dict:
    """Device-busy over the window when every decoder runs: from the moment the last one
    got its first token to the moment the first one got its last. Each decode step gives
    every running decoder one token, so tokens per decoder in the window count the steps
    the device ran in it (the whole run's busy % also counts the arrival, when the first
    steps run partial batches, and the tail)."""
    if not arrivals or any(not a for a in arrivals):
        return {"steady_window_s": 0.0, "steady_steps": 0.0, "steady_busy": float("nan")}
    begin = max(a[0][0] for a in arrivals)
    end = min(a[-1][0] for a in arrivals)
    if end <= begin:
        return {"steady_window_s": 0.0, "steady_steps": 0.0, "steady_busy": float("nan")}
    steps = sum(n for a in arrivals for t, n in a if begin < t <= end) / len(arrivals)
    return {"steady_window_s": end - begin, "steady_steps": steps,
            "steady_busy": step_ms / 1000.0 * steps / (end - begin)}


async def run_scenarios(cluster, phases_dir: Path, step_ms: float, todo: list[Scenario], model: dict,
                        seed: int) -> list[dict]:
    """Every scenario on one cluster, each between two snapshots of the phase totals (and
    of each process's CPU time: the services' and this client's)."""
    pids = {name: proc.pid for name, proc in cluster.processes.items()}
    results = []
    async with cluster.client() as client:
        async for _ in client.generate(token_ids=[1, 2, 3], max_tokens=4, ignore_eos=True):
            pass  # Warm-up: connections open, first-step costs paid.
        for i, scenario in enumerate(todo):
            requests = prompts(scenario, model["vocab_size"], seed + i)
            before = await settled_snapshot(phases_dir)
            cpu_before = cpu_usage.snapshot(pids)
            wall, outputs, arrivals = await drive(client, scenario, requests)
            cpu_after = cpu_usage.snapshot(pids)
            after = await settled_snapshot(phases_dir)
            bad = sum(out != expected_tokens(p, m, model["vocab_size"], model["eos"])
                      for (p, m), out in zip(requests, outputs))
            figures = phase_figures((before[0], after[0]), (before[1], after[1]), step_ms, wall)
            figures.update(steady_state(arrivals, step_ms))
            figures["cpu_ms_per_step"] = cpu_usage.cpu_per_step(cpu_before, cpu_after, figures["steps"])["ms_per_step"]
            results.append({"scenario": scenario.name, "scenario_settings": dataclasses.asdict(scenario),
                            "figures": figures, "tokens_ok": bad == 0, "bad_requests": bad,
                            "output_tokens": sum(len(o) for o in outputs if isinstance(o, list))})
    return results


def model_facts(model_dir: Path) -> dict:
    from llmserve.worker.config import RunnerConfig
    from llmserve.worker.simulated_runner import SimulatedRunner

    runner = SimulatedRunner(model_dir, RunnerConfig(num_kv_blocks=1), 1.0)  # Reads config.json only.
    return {"vocab_size": runner.vocab_size, "eos": runner.eos_ids}


def run_configuration(model_dir: Path, step_ms: float, pipelined: bool, todo: list[Scenario], model: dict,
                      seed: int, log_dir: Path | None, stream_interval: int = 1) -> list[dict]:
    from llmserve.launcher.cluster import LocalCluster

    with tempfile.TemporaryDirectory(prefix="llmserve-phases-") as phases_dir:
        spec = cluster_spec(model_dir, step_ms, pipelined, todo, Path(phases_dir), log_dir, stream_interval)
        with LocalCluster(spec) as cluster:
            results = asyncio.run(run_scenarios(cluster, Path(phases_dir), step_ms, todo, model, seed))
    loop = "pipelined" if pipelined else "serial"
    return [{"step_ms": step_ms, "loop": loop, **r} for r in results]


def bench_overhead(args) -> int:
    from llmserve.bench.report import machine_info, save_report
    from llmserve.model_store import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    todo = scenarios(args.batches, args.prompt_len, args.max_tokens, mixed=not args.no_mixed)
    loops = [False] if args.serial_only else LOOPS
    model = model_facts(model_dir)
    log_dir = Path(args.log_dir) if args.log_dir else None
    results = []
    for step_ms in args.simulated_step_ms:
        for pipelined in loops:
            results += run_configuration(model_dir, step_ms, pipelined, todo, model, args.seed, log_dir,
                                         args.stream_interval)
    in_process = []
    if args.in_process_steps:
        from llmserve.bench import in_process_overhead

        for step_ms in args.simulated_step_ms:
            in_process += in_process_overhead.run(model_dir, step_ms, args.batches, args.prompt_len,
                                                  args.in_process_steps, model, args.seed)
    print(format_table(results))
    if in_process:
        print(f"\nin process (launcher/engine.py, as `bench offline` runs it), {args.in_process_steps} decode steps:")
        print(in_process_overhead.format_table(in_process))
    print("phases: host ms per device step (bench/llmserve/bench/overhead_phases.py says what each covers); "
          "busy % = simulated device time / wall time; steady % = the same while every decoder runs "
          "(after the last first token, before the first finish); CPU: each process's own user + system ms per "
          f"device step, on {os.cpu_count()} cores")
    report = {"bench": "overhead", "machine": machine_info(), "model": str(model_dir),
              "settings": {"simulated_step_ms": args.simulated_step_ms, "batches": args.batches,
                           "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                           "loops": ["pipelined" if p else "serial" for p in loops], "transport": "mutual TLS",
                           "stream_interval": args.stream_interval},
              "results": results, "in_process": in_process}
    save_report(report, args.output_dir, f"overhead-{time.strftime('%Y%m%d-%H%M%S')}.json")
    return 0 if all(r["tokens_ok"] for r in results + in_process) else 1


def add_overhead_flags(p) -> None:
    from llmserve.bench.report import add_output_dir_flag

    p.add_argument("--model", default="default",
                   help="model directory whose config.json and tokenizer the cluster uses (no weights are loaded)")
    p.add_argument("--simulated-step-ms", type=float, nargs="+", default=[1.0, 3.0],
                   help="simulated device time per step, ms; one cluster per value and loop")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256, 1024], help="decode batch sizes")
    p.add_argument("--prompt-len", type=int, default=8, help="prompt tokens of each decoding request")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens each decoding request generates")
    p.add_argument("--no-mixed", action="store_true", help="skip the mixed prefill + decode scenario")
    p.add_argument("--serial-only", action="store_true", help="the serial loop only")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="the scheduler's --stream-interval: tokens sent to the router every N steps; above 1 it "
                        "separates the engine's host path from per-token streaming on a small host")
    p.add_argument("--in-process-steps", type=int, default=200,
                   help="decode steps timed per batch size and loop in the in-process engine over the same "
                        "simulated device (0: skip that table)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None, help="the cluster's logs go here")
    add_output_dir_flag(p)
