"""`llmserve bench overhead`'s arithmetic: per-step host milliseconds by phase, from two
snapshots of the scheduler's and the worker's phase totals (llmserve.telemetry.step_phases),
and the table.

What each phase covers (every figure is host time summed over the run ÷ device steps):

    schedule   scheduler: Scheduler.expire + Scheduler.schedule (admission, block
               allocation, the plan's rows)
    encode     protobuf conversion, both ends: the scheduler's plan -> message and
               message -> result, the worker's message -> plan and result -> message
    transport  the scheduler's round trip per plan (from the start of its send to its
               decoded result) less both ends' encode, the worker's execute and the time
               the plan sat queued behind an earlier one: serialization to bytes, TLS,
               HTTP/2, both event loops, the worker's hop to the compute thread and back
               (in the pipelined loop also a reply's wait for the scheduler to read it)
    prepare    worker: InputBatch.apply_plan (validate, add / extend / drop rows) and
               build_inputs (token ids, positions, slot mapping, block tables,
               attention metadata, sampling rows)
    sync       worker: the host's wait for the simulated device's sampled ids at a step's
               finish (the device runs launched steps on a thread of its own), and
               filling their placeholders
    update     scheduler: Scheduler.update_from_output (tokens appended, stops,
               finished requests, freed blocks)
    dispatch   scheduler: RouterHub.dispatch (outputs onto their routers' streams) and
               the session writers' protobuf conversion of them (off the step's path)

In the serial loop every phase is on the critical path; in the pipelined loop the
scheduler's phases overlap the worker's step, and device-busy shows what is left.

    critical   pipelined loop only: the scheduler's mean wall time from a step's decoded
               result to the next plan built (update, expire + schedule; the plan's encode
               and write follow): with them, the host path the device waits for whenever
               it exceeds the step in flight. Not a phase (it overlaps them), so not in
               the host total.
"""

from __future__ import annotations

import math

PHASES = ("schedule", "encode", "transport", "prepare", "sync", "update", "dispatch")


def _delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def phase_figures(scheduler: tuple[dict, dict], worker: tuple[dict, dict], step_ms: float, wall_s: float) -> dict:
    """The figures of one scenario from (before, after) snapshots of each service."""
    s = lambda key: _delta(*scheduler, key)  # noqa: E731 (two one-line readers)
    w = lambda key: _delta(*worker, key)  # noqa: E731
    steps = int(round(w("steps")))
    totals = {
        "schedule": s("schedule"),
        "encode": s("encode") + w("encode"),
        "transport": s("round_trip") - s("encode") - w("encode") - w("execute") - w("queued"),
        "prepare": w("prepare"),
        "sync": w("sync"),
        "update": s("update"),
        "dispatch": s("dispatch"),
    }
    per_step = {k: 1000.0 * v / steps if steps else float("nan") for k, v in totals.items()}
    return {
        "steps": steps,
        "plans": int(round(w("plans"))),
        "mixed_steps": int(round(w("mixed_steps"))),
        "wall_s": wall_s,
        "device_s": w("device"),
        "device_busy": step_ms * steps / 1000.0 / wall_s if wall_s > 0 else float("nan"),
        "host_ms_per_step": per_step,
        "host_ms_per_step_total": sum(per_step.values()),
        "wall_ms_per_step": 1000.0 * wall_s / steps if steps else float("nan"),
        "critical_ms": 1000.0 * s("critical") / critical_steps if (critical_steps := s("critical_steps")) else math.nan,
    }


HEADER = ("step ms", "loop", "scenario", "steps", "wall s", "busy %", "steady %", *PHASES, "host", "critical",
          "wall/step", "tokens")


def table_rows(results: list[dict]) -> list[tuple[str, ...]]:
    rows = []
    for r in results:
        f = r["figures"]
        rows.append((f"{r['step_ms']:g}", r["loop"], r["scenario"], str(f["steps"]), f"{f['wall_s']:.2f}",
                     _percent(f["device_busy"]), _percent(f.get("steady_busy", math.nan)),
                     *(f"{f['host_ms_per_step'][p]:.3f}" for p in PHASES), f"{f['host_ms_per_step_total']:.3f}",
                     _ms(f.get("critical_ms", math.nan)), f"{f['wall_ms_per_step']:.3f}",
                     "ok" if r["tokens_ok"] else f"BAD ({r['bad_requests']})"))
    return rows


def _ms(value: float) -> str:
    return "—" if math.isnan(value) else f"{value:.3f}"


def _percent(fraction: float) -> str:
    return "—" if math.isnan(fraction) else f"{100 * fraction:.1f}"


CPU_PROCESSES = ("router", "scheduler", "worker", "client")
CPU_HEADER = ("step ms", "loop", "scenario", *(f"{p} CPU" for p in CPU_PROCESSES), "all CPU", "wall/step")


def cpu_rows(results: list[dict]) -> list[tuple[str, ...]]:
    """Each process's own CPU milliseconds (user + system, all its threads) per device step:
    on a host with few cores the streaming control plane (router, client) and the engine's
    host path share them."""
    rows = []
    for r in results:
        f, cpu = r["figures"], r["figures"].get("cpu_ms_per_step", {})
        rows.append((f"{r['step_ms']:g}", r["loop"], r["scenario"],
                     *(_ms(cpu.get(p, math.nan)) for p in CPU_PROCESSES),
                     _ms(sum(cpu.values()) if cpu else math.nan), f"{f['wall_ms_per_step']:.3f}"))
    return rows


def format_table(results: list[dict]) -> str:
    """Markdown tables: one row per (step ms, loop, scenario); phases in host ms per step,
    then each process's CPU ms per step."""
    return _markdown([HEADER, *table_rows(results)]) + "\n\n" + _markdown([CPU_HEADER, *cpu_rows(results)])


def _markdown(rows: list[tuple[str, ...]]) -> str:
    header = rows[0]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["| " + " | ".join(cell.rjust(width) for cell, width in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (width + 2) for width in widths) + "|")
    return "\n".join(lines)
