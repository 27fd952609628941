"""`llmserve bench profile`: where the time of one decode step goes.

Builds a batch of decoding requests in the in-process engine. On the CPU it times the
pieces of a step separately: plan building (scheduler), plan/result protobuf round trips
(what crosses gRPC), input building, the model forward by operator family (torch
profiler), LM head, and sampling. On CUDA the forward replays a CUDA graph and kernels
run asynchronously, so pieces timed on the host would mislead: there it times whole
engine steps unprofiled, then sums each kernel family's GPU time over profiled steps.

`--prefill-len L` profiles prompt-carrying steps the same whole-step way (on either
device): steps of `--prefill-step-tokens` tokens, each whole L-token prompts that finish
at their prefill (one token each), as an offline run's first steps are.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from llmserve.contract.arith import cdiv
from llmserve.contract import wire
from llmserve.bench.workloads import random_workload
from llmserve.launcher.engine import InProcessEngine
from llmserve.scheduler.config import SchedulerConfig
from llmserve.internal.v1 import worker_pb2
from llmserve.contract.sampling import SamplingParams

# Operator name fragments -> family, first match wins.
FAMILIES = [
    ("paged_attention_prefill", "attention (prefill)"),
    ("paged_attention", "attention (paged decode)"),
    ("scaled_dot_product", "attention (SDPA)"),
    ("index_copy", "KV cache write"),
    ("aten::index", "KV gather"),
    ("aten::mm", "matmul"),
    ("aten::addmm", "matmul"),
    ("aten::linear", "matmul"),
    ("aten::bmm", "matmul"),
    ("_linear_pointwise", "matmul"),
    ("_mkl_linear", "matmul"),
    ("_weight_int8pack_mm", "matmul"),
    ("w8a8_linear", "matmul"),
    ("bf16_linear", "matmul"),
    ("f32_linear", "matmul"),
    ("decoder_layers", "the C++ layer loop (between its ops)"),
    ("llmserve_cpu::", "fused element-wise (C++)"),
]


# GPU kernel name fragments -> family, first match wins (Triton kernels by our names,
# cuBLAS's by theirs).
CUDA_FAMILIES = [
    ("_decode_kernel", "attention (paged decode)"),
    ("_decode_reduce_kernel", "attention (paged decode)"),
    ("_varlen_kernel", "attention (prefill)"),
    ("_reshape_and_cache", "KV cache write"),
    ("nvjet", "matmul"),
    ("gemm", "matmul"),
    ("cutlass", "matmul"),
    ("splitKreduce", "matmul"),
    ("_rms_norm", "norms, rotary, activation"),
    ("_rotary", "norms, rotary, activation"),
    ("elementwise", "element-wise (torch)"),
    ("reduce_kernel", "reductions (sampling)"),
    ("sort", "reductions (sampling)"),
    ("Memcpy", "copies"),
    ("Memset", "copies"),
]


def _family(name: str, families: list[tuple[str, str]] = FAMILIES) -> str:
    for fragment, family in families:
        if fragment in name:
            return family
    return "other ops"


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:8.2f} ms"


def prefilled_engine(runner, batch: int, context: int, max_new_tokens: int, seed: int = 1,
                     max_num_batched_tokens: int | None = None, pipelined: bool | None = None) -> InProcessEngine:
    """An in-process engine on `runner` with `batch` sequences of `context` random prompt
    tokens (ids within the model's vocabulary), all past their prefill: every further
    step is a pure decode step at that batch size, for `max_new_tokens` steps. The prefill
    runs in one step unless `max_num_batched_tokens` caps it (chunks). `pipelined`: the
    engine loop (None: by device, as served). Raises ValueError where a sequence of
    `context` + `max_new_tokens` tokens exceeds the model's length."""
    max_model_len = runner.info.max_model_len
    if context + max_new_tokens > max_model_len:
        # (Else the scheduler refuses every prompt and the bench divides by no sequence.)
        raise ValueError(f"a context of {context} tokens and {max_new_tokens} more to generate exceed the model's "
                         f"{max_model_len}-token length: a smaller --context, or fewer steps")
    budget = max_num_batched_tokens or max(4096, batch * (context + 16))
    engine = InProcessEngine(runner, SchedulerConfig(max_num_batched_tokens=budget, async_scheduling=pipelined))
    vocab = runner.config.vocab_size
    for i, r in enumerate(random_workload(batch, (context, context), (1000, 1000), vocab, seed=seed)):
        engine.add_request(f"r{i}", r.prompt_token_ids, SamplingParams(max_tokens=max_new_tokens, temperature=0.0,
                                                                      ignore_eos=True))
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    return engine


def decode_kv_blocks(batch: int, context: int, max_new_tokens: int, block_size: int = 16) -> int:
    """KV blocks that hold `batch` sequences of context + max_new_tokens tokens (+1 spare)."""
    return batch * cdiv(context + max_new_tokens, block_size) + 1


def decoding_engine(model_dir, dtype: str, batch: int, context: int, model=None,
                    max_new_tokens: int = 1000, quantization: str = "none", device: str = "auto") -> InProcessEngine:
    """An in-process engine with `batch` sequences of `context` prompt tokens, all past
    their prefill (`prefilled_engine`). Its KV cache holds just those tokens, and it seats
    just them (on CUDA no decode graph is captured past `batch`). With `model` (another
    engine's runner's model) the weights are shared, not loaded again."""
    from llmserve.worker.config import RunnerConfig
    from llmserve.worker.model_runner import ModelRunner

    settings = RunnerConfig(device=device, dtype=dtype, num_kv_blocks=decode_kv_blocks(batch, context, max_new_tokens),
                            swap_space=0, quantization=quantization, max_num_seqs=batch)
    return prefilled_engine(ModelRunner(model_dir, settings, model=model), batch, context, max_new_tokens)


def time_decode_steps(model_dir, dtype: str, batches: list[int], context: int, steps: int = 40,
                      chunks: int = 4, quantization: str = "none") -> dict[int, float]:
    """Mean seconds of a whole in-process decode step (schedule, forward, sample, update;
    no profiler) at each batch size, at a mean context of `context` tokens.

    NOTE: a mean over `steps` steps per batch, taken in `chunks` interleaved runs
    (b1, b2, b1, b2, ...). This host's memory bandwidth swings by a third from one
    second to the next, and a small-batch decode step is bandwidth-bound, so a median of
    a few consecutive steps measures the second it ran in; the cluster's figures it is
    compared with are means over whole runs.
    """
    # Each sequence grows by `steps` tokens while timed: start half of that below `context`.
    # NOTE: one copy of the weights for every batch size (the engines differ in KV only).
    start, model, engines = max(1, context - steps // 2), None, {}
    for b in batches:
        engines[b] = decoding_engine(model_dir, dtype, b, start, model=model, max_new_tokens=steps + 8,
                                     quantization=quantization)
        model = engines[b].runner.model
    times: dict[int, list[float]] = {b: [] for b in batches}
    for engine in engines.values():
        engine.step()  # Warm-up.
    for chunk in range(chunks):
        for b, engine in engines.items():
            for _ in range(steps // chunks + (chunk < steps % chunks)):
                start = time.perf_counter()
                engine.step()
                times[b].append(time.perf_counter() - start)
    return {b: sum(t) / len(t) for b, t in times.items()}


def profile_decode_step(model_dir, dtype: str, batch: int, context: int, reps: int = 5,
                        quantization: str = "none") -> dict:
    """A CPU decode step's pieces, timed one by one (module docstring)."""
    engine = decoding_engine(model_dir, dtype, batch, context, max_new_tokens=4 * reps + 16, quantization=quantization,
                             device="cpu")
    runner, sched = engine.runner, engine.scheduler
    times: dict[str, float] = defaultdict(float)
    ops: dict[str, float] = defaultdict(float)
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        plan_bytes = wire.step_plan_to_pb(plan).SerializeToString()
        plan = wire.step_plan_from_pb(worker_pb2.StepPlan.FromString(plan_bytes))
        t2 = time.perf_counter()
        with torch.inference_mode():
            rows = runner.batch.apply_plan(plan)
            inp = runner.batch.build_inputs(rows)
            t3 = time.perf_counter()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                hidden = runner.model(inp.input_ids, inp.positions, runner.kv_caches, inp.meta)
            t4 = time.perf_counter()
            for st, n in rows:
                st.num_computed_tokens += n
            logits = runner.model.compute_logits(hidden[inp.sample_indices])
            t5 = time.perf_counter()
            states = inp.sample_states
            tokens = runner.sampler(logits, inp.sampling).token_ids.tolist()
            t6 = time.perf_counter()
        from llmserve.contract.plan import SampledToken, StepResult

        for st, tok in zip(states, tokens):
            st.token_ids.append(tok)
        result = StepResult(plan.step_id, [SampledToken(s.seq_id, t) for s, t in zip(states, tokens)])
        t7 = time.perf_counter()
        result = wire.step_result_from_pb(worker_pb2.StepResult.FromString(
            wire.step_result_to_pb(result).SerializeToString()))
        t8 = time.perf_counter()
        sched.update_from_output(plan, result)
        t9 = time.perf_counter()
        if rep == 0:
            continue  # Warm-up.
        for key, dt in (("scheduler: schedule()", t1 - t0), ("plan protobuf round trip", t2 - t1),
                        ("worker: plan -> input tensors", t3 - t2), ("model forward (profiled)", t4 - t3),
                        ("LM head (sampled rows only)", t5 - t4), ("sampling", t6 - t5),
                        ("result protobuf round trip", t8 - t7), ("scheduler: update_from_output()", t9 - t8)):
            times[key] += dt / reps
        for evt in prof.key_averages():
            ops[_family(evt.key)] += evt.self_cpu_time_total / 1e6 / reps
    return {"batch": batch, "context": context, "dtype": dtype, "quantization": quantization,
            "plan_bytes": len(plan_bytes), "pieces_s": dict(times), "forward_ops_s": dict(ops)}


def prompts_per_prefill_step(prompt_len: int, step_tokens: int) -> int:
    """Whole prompts of prompt_len tokens a profiled prefill step of step_tokens carries."""
    return max(1, step_tokens // prompt_len)


def prefilling_engine(model_dir, dtype: str, prompt_len: int, step_tokens: int, steps: int,
                      quantization: str = "none", device: str = "auto",
                      pipelined: bool | None = None, model=None) -> InProcessEngine:
    """An in-process engine whose next `steps` steps each prefill step_tokens // prompt_len
    whole prompts of `prompt_len` random tokens (one token generated each, so every
    prompt ends in the step that prefills it). Its KV cache holds three steps' prompts and
    it seats two steps' (the pipelined loop plans a step before the one in flight has
    freed its blocks and seats: with one step's seats, every other plan was empty).
    `pipelined`: the engine loop (None: by device, as served); `model`: as decoding_engine's."""
    from llmserve.worker.config import RunnerConfig
    from llmserve.worker.model_runner import ModelRunner

    per_step = prompts_per_prefill_step(prompt_len, step_tokens)
    settings = RunnerConfig(device=device, dtype=dtype, swap_space=0, quantization=quantization,
                            num_kv_blocks=decode_kv_blocks(3 * per_step, prompt_len, 1), max_num_seqs=2 * per_step)
    runner = ModelRunner(model_dir, settings, model=model)
    engine = InProcessEngine(runner, SchedulerConfig(max_num_batched_tokens=per_step * prompt_len,
                                                     max_num_seqs=2 * per_step, async_scheduling=pipelined))
    for i, r in enumerate(random_workload(per_step * (steps + 2), (prompt_len, prompt_len), (1, 1),
                                          runner.config.vocab_size, seed=2)):
        engine.add_request(f"p{i}", r.prompt_token_ids, SamplingParams(max_tokens=1, temperature=0.0,
                                                                       ignore_eos=True))
    return engine


def _kernel_time(evt, on_cuda: bool) -> float:
    """Seconds of one profiler row: its GPU time on CUDA (kernels, copies), else its CPU
    self time."""
    return (evt.self_device_time_total if on_cuda else evt.self_cpu_time_total) / 1e6


PROFILED_STEPS = 10  # Whole steps timed, then as many profiled (after 3 of warm-up).


def profile_whole_steps(engine: InProcessEngine, steps: int = PROFILED_STEPS) -> dict:
    """Whole decode steps of `engine` (already decoding): the mean unprofiled step, then
    per step over `steps` profiled ones each family's time (GPU time on CUDA, CPU self
    time elsewhere) and the costliest rows."""
    from torch.profiler import ProfilerActivity, profile

    from llmserve.bench.clock import now

    device = engine.runner.device
    on_cuda = device.type == "cuda"
    for _ in range(3):  # Warm-up: kernel choices, the allocator.
        engine.step()
    start = now(device)
    for _ in range(steps):
        engine.step()
    step_s = (now(device) - start) / steps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        now(device)
    families: dict[str, float] = defaultdict(float)
    rows = []
    for evt in prof.key_averages():
        seconds = _kernel_time(evt, on_cuda) / steps
        if seconds <= 0:
            continue
        families[_family(evt.key, CUDA_FAMILIES if on_cuda else FAMILIES)] += seconds
        rows.append((evt.key, seconds, evt.count / steps))
    rows.sort(key=lambda r: -r[1])
    return {"device": str(device), "uses_graphs": engine.runner.graphs is not None, "step_s": step_s,
            "families_s": dict(families), "top_rows": [{"name": n, "seconds": t, "calls": c} for n, t, c in rows[:10]]}


def _print_whole_steps(report: dict) -> None:
    busy = sum(report["families_s"].values())
    what = (f"prefill step, {report['prompts']} x {report['prompt_len']} tokens" if "prompt_len" in report
            else f"decode step, batch {report['batch']}, context ~{report['context']}")
    print(f"{what}, {report['dtype']} on "
          f"{report['device']} ({'CUDA graphs' if report['uses_graphs'] else 'eager'}): {_ms(report['step_s'])} "
          f"unprofiled; {_ms(busy)} of kernel time", flush=True)
    for key, dt in sorted(report["families_s"].items(), key=lambda kv: -kv[1]):
        print(f"    {key:<32}{_ms(dt)}  {100 * dt / busy:5.1f}%")
    print("  costliest rows (per step):")
    for row in report["top_rows"][:6]:
        print(f"    {row['name'][:60]:<62}{_ms(row['seconds'])}  x{row['calls']:g}")


def bench_profile(args) -> int:
    from llmserve.bench.report import machine_info, save_report
    from llmserve.model_store import resolve_model_dir
    from llmserve.worker.device import resolve_device

    model_dir, device = resolve_model_dir(args.model), resolve_device(args.device)
    reports = []
    model = None  # The first engine's weights, shared by the others (loaded once).
    for batch in args.batch:
        if device.type == "cuda":
            engine = decoding_engine(model_dir, args.dtype, batch, args.context, max_new_tokens=64,
                                     quantization=args.quantization, device="cuda", model=model)
            model = engine.runner.model
            report = {"batch": batch, "context": args.context, "dtype": args.dtype,
                      "quantization": args.quantization, **profile_whole_steps(engine)}
            del engine
            _print_whole_steps(report)
        else:
            report = profile_decode_step(model_dir, args.dtype, batch, args.context, quantization=args.quantization)
            # The same keys as a CUDA report's, for readers of the JSON (the GPU self-check's summary).
            report.update(device="cpu", uses_graphs=False, step_s=sum(report["pieces_s"].values()),
                          families_s=report["forward_ops_s"])
            _print_pieces(report)
        reports.append(report)
    if args.prefill_len:
        engine = prefilling_engine(model_dir, args.dtype, args.prefill_len, args.prefill_step_tokens,
                                   3 + 2 * PROFILED_STEPS, quantization=args.quantization, device=device.type,
                                   model=model)
        report = {"prompt_len": args.prefill_len,
                  "prompts": prompts_per_prefill_step(args.prefill_len, args.prefill_step_tokens),
                  "dtype": args.dtype, "quantization": args.quantization,
                  **profile_whole_steps(engine, PROFILED_STEPS)}
        del engine
        _print_whole_steps(report)
        reports.append(report)
    save_report({"kind": "profile", "machine": machine_info(), "command": " ".join(args.argv), "reports": reports},
                args.output_dir, f"profile-{args.dtype}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    return 0


def _print_pieces(report: dict) -> None:
    total = sum(report["pieces_s"].values())
    print(f"decode step, batch {report['batch']}, context ~{report['context']}, {report['dtype']}, quantization "
          f"{report['quantization']}: {_ms(total)}"
          f" (plan on the wire: {report['plan_bytes']} bytes)")
    for key, dt in report["pieces_s"].items():
        print(f"  {key:<34}{_ms(dt)}  {100 * dt / total:5.1f}%")
    fwd = sum(report["forward_ops_s"].values())
    print("  model forward by operator family (profiler self time):")
    for key, dt in sorted(report["forward_ops_s"].items(), key=lambda kv: -kv[1]):
        print(f"    {key:<32}{_ms(dt)}  {100 * dt / fwd:5.1f}%")
