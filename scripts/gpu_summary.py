"""The GPU self-check's one summary table, judged against the acceptance targets.

    python scripts/gpu_summary.py RESULTS_DIR

Reads what scripts/gpu_check.sh left in RESULTS_DIR: steps.tsv (each step's exit code
and seconds, or why it did not run), gpu-tests.xml and host-cpu.xml (pytest's JUnit reports),
random-model*.json and the bench reports under offline-1b/, decode-floor-1b/, loops/,
offline-8b/, decode-floor-8b/, kv-sizing/, decode/, throughput/ and profile/. Prints the
table, writes it to summary.md (and summary.json), exits 1 when any row FAILs.

Performance targets apply on CUDA; a CPU dry run shows its figures as SKIP, and so does
a step that --only left out or that the time budget did not reach.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

GRAPHS_OVER_EAGER = 1.5  # CUDA graphs decode tok/s over eager, at every batch size.
PIECEWISE_OVER_EAGER = 1.0  # A mixed step (prefill chunk + decodes) faster with piecewise graphs than eager.
ENGINE_OVER_HF = 3.0  # Engine output tok/s over HF static-batch generate, reference workload.
KV_TOLERANCE = 0.05  # KV cache bytes within 5% of what fits after start-up.
# Issue #31's GPU targets.
OFFLINE_SHARE = 0.5  # Offline benchmark: >= 50% of the physical ceiling (bench/ceiling.py).
DECODE_FLOOR_SHARE = 0.6  # Decode at batch 1: >= 60% of the bandwidth floor.
DECODE_FLOOR_BATCH = 1
PIPELINED_OVER_SERIAL = 1.3  # Pipelined loop >= 1.3x the serial one, steady decode at batch 64.
LOOPS_BATCH = 64
REPORT_DIRS = ("offline-1b", "decode-floor-1b", "loops", "offline-8b", "throughput", "decode", "kv-sizing")
NOT_RUN = {"only": "not run: --only left it out", "budget": "not run: the time budget (--budget) ran out first"}


@dataclass(frozen=True)
class Row:
    check: str
    result: str  # PASS, FAIL, SKIP (a target that applies on CUDA only) or INFO
    figure: str


def read_steps(results: Path) -> dict[str, tuple[int | str, float]]:
    """steps.tsv: `name<TAB>exit code<TAB>seconds` per step run; a step not run has a word
    (a key of NOT_RUN) for its exit code."""
    steps: dict[str, tuple[int | str, float]] = {}
    path = results / "steps.tsv"
    for line in path.read_text().splitlines() if path.is_file() else ():
        name, rc, seconds = line.split("\t")
        steps[name] = (int(rc) if rc.lstrip("-").isdigit() else rc, float(seconds))
    return steps


def latest_report(folder: Path) -> dict | None:
    reports = sorted(folder.glob("*.json")) if folder.is_dir() else []
    return json.loads(reports[-1].read_text()) if reports else None


def _count(n: float) -> str:
    """1.236 B, 106.8 k: parameters at a glance."""
    return next(f"{n / scale:,.3g} {unit}" for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k"), (1, ""))
                if n >= scale or scale == 1)


def _bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _rate(flop_per_s: float) -> str:
    return f"{flop_per_s / 1e12:,.0f} TFLOP/s" if flop_per_s >= 1e12 else f"{flop_per_s / 1e9:,.0f} GFLOP/s"


def _judged(passed: bool, on_cuda: bool) -> str:
    if not on_cuda:
        return "SKIP"
    return "PASS" if passed else "FAIL"


def _missing(check: str, step: str, steps: dict) -> Row:
    rc = steps.get(step, (None, 0))[0]
    if rc in NOT_RUN:
        return Row(check, "SKIP", NOT_RUN[rc])
    # 124: `timeout` stopped it; 137: killed after its grace period (or for memory).
    why = {None: "did not run", 124: "timed out", 137: "killed (time or memory)"}.get(rc, f"exited {rc}")
    return Row(check, "FAIL", f"{why}: see logs/{step}.log")


def step_row(check: str, step: str, steps: dict, figure: str = "") -> Row:
    if step not in steps or steps[step][0] != 0:  # Not run (SKIP), or failed.
        return _missing(check, step, steps)
    return Row(check, "PASS", figure or f"{steps[step][1]:.0f} s")


def junit_counts(path: Path) -> dict[str, int] | None:
    """tests, failures, errors, skipped, passed summed over the report's test suites, and
    the first failing test ids."""
    if not path.is_file():
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["failed_ids"] = [f"{case.get('classname')}::{case.get('name')}" for case in root.iter("testcase")
                            if case.find("failure") is not None or case.find("error") is not None][:3]
    return counts


def tests_row(results: Path, steps: dict, on_cuda: bool, step: str = "gpu-tests",
              check: str = "GPU tests (pytest -m gpu)") -> Row:
    """A pytest step's row from its JUnit report, RESULTS/STEP.xml: gpu-tests, or host-cpu
    (the CPU kernels' tests on the GPU host's CPU)."""
    counts = junit_counts(results / f"{step}.xml")
    if counts is None:
        return _missing(check, step, steps)
    figure = f"{counts['passed']} passed, {counts['failures'] + counts['errors']} failed, {counts['skipped']} skipped"
    if counts["failed_ids"]:
        figure += ": " + ", ".join(counts["failed_ids"])
    bad = counts["failures"] + counts["errors"] > 0 or steps.get(step, (0, 0))[0] not in (0, 1, 5)
    # On a GPU, a run where every GPU test skipped proves nothing.
    empty = on_cuda and step == "gpu-tests" and counts["passed"] == 0
    return Row(check, "FAIL" if bad or empty else "PASS", figure + (" (none ran on the GPU)" if empty else ""))


def model_row(results: Path, steps: dict, file: str = "random-model.json", step: str = "make-model") -> Row:
    path = results / file
    if not path.is_file():
        return _missing("random model made on the spot", step, steps)
    made = json.loads(path.read_text())
    shape = made["shape"]
    return Row(f"random {made['preset']} model made on the spot", "PASS",
               f"{_count(made['parameters'])} parameters, {made['dtype']}, {_bytes(made['bytes'])} "
               f"(hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, vocab {shape['vocab_size']})")


def kv_row(results: Path, steps: dict) -> Row:
    report = latest_report(results / "kv-sizing")
    check = f"KV blocks within {100 * KV_TOLERANCE:.0f}% of what fits"
    if report is None:
        return _missing(check, "kv-sizing", steps)
    ratio = report["kv_over_fits"]
    figure = (f"{report['num_kv_blocks']} blocks x {report['block_bytes'] / 1024:.0f} KiB = "
              f"{report['kv_bytes'] / 2**30:.2f} GiB vs {report['fits_bytes'] / 2**30:.2f} GiB that fit "
              f"after start-up ({100 * ratio:.1f}%, {report['device']})")
    return Row(check, "PASS" if abs(1 - ratio) <= KV_TOLERANCE else "FAIL", figure)


def decode_rows(results: Path, steps: dict) -> list[Row]:
    report = latest_report(results / "decode")
    if report is None:
        return [_missing("CUDA graphs vs eager decode", "decode", steps)]
    on_cuda = report["device"].startswith("cuda")
    rows = []
    if on_cuda and not report["uses_graphs"]:
        rows.append(Row("CUDA graphs captured", "FAIL", "the runner ran eagerly on CUDA: see logs/decode.log"))
    for batch, row in report["batches"].items():
        ratio = row["graphs_over_eager"]
        rows.append(Row(f"CUDA graphs >= {GRAPHS_OVER_EAGER}x eager, batch {batch}",
                        _judged(ratio >= GRAPHS_OVER_EAGER and report["uses_graphs"], on_cuda),
                        f"{row['graphs_tok_per_s']:,.0f} vs {row['eager_tok_per_s']:,.0f} decode tok/s = "
                        f"{ratio:.2f}x"))
    return rows + [mixed_row(report, on_cuda)]


def mixed_row(report: dict, on_cuda: bool) -> Row:
    """A step that prefills a chunk beside decodes: piecewise graphs faster than eager."""
    check = "piecewise graphs faster than eager, mixed step"
    mixed = report.get("mixed")
    if mixed is None:
        return Row(check, "FAIL", "not measured: the decode report has no mixed step (bench decode --mixed)")
    ratio = mixed["graphs_over_eager"]
    return Row(check, _judged(ratio > PIECEWISE_OVER_EAGER and mixed["uses_piecewise"], on_cuda),
               f"{mixed['chunk']}-token prefill + {mixed['decodes']} decodes: {mixed['graphs_step_ms']:.2f} vs "
               f"{mixed['eager_step_ms']:.2f} ms a step = {ratio:.2f}x")


def throughput_rows(results: Path, steps: dict) -> list[Row]:
    report = latest_report(results / "throughput")
    if report is None:
        return [_missing(f"engine >= {ENGINE_OVER_HF:g}x HF generate", "throughput", steps)]
    on_cuda = report["device"].startswith("cuda")
    engine, hf = report["results"]["engine"], report["results"].get("hf", {})
    check = f"engine >= {ENGINE_OVER_HF:g}x HF generate ({report['workload']['name']} workload)"
    if "output_tokens_per_s" not in hf:
        return [Row(check, "FAIL", f"HF baseline failed: {hf.get('error', 'not run')}")]
    ratio = hf.get("engine_over_this_median", hf["engine_over_this"])
    rows = [Row(check, _judged(ratio >= ENGINE_OVER_HF, on_cuda),
                f"{engine['output_tokens_per_s']:,.0f} vs {hf['output_tokens_per_s']:,.0f} output tok/s = "
                f"{ratio:.2f}x (HF static batch {hf['batch_size']}, {report['dtype']}, "
                f"{report['rounds']} round(s))")]
    rows.append(Row("MFU and roofline (measured in the run)", "INFO",
                    f"MFU {100 * engine['mfu']:.1f}% of a {_rate(report['matmul_peak_gflop_per_s'] * 1e9)} "
                    f"{report['dtype']} matmul; memory {report['memory_bandwidth_gb_per_s']:,.0f} GB/s; roofline "
                    f"floor {engine['roofline_floor_seconds']:.2f} s = {100 * engine['roofline_fraction']:.0f}% "
                    f"of the engine's {engine['seconds']:.2f} s"))
    return rows


def profile_rows(results: Path, steps: dict) -> list[Row]:
    """INFO: where a decode step's time goes, per profiled batch size (and a prompt-carrying
    step's, where profiled): the kernels' time against the unprofiled step's (well under
    it: the step waits on the host), and the three costliest kernel families' shares."""
    report = latest_report(results / "profile")
    if report is None:
        return [_missing("decode step profile", "profile", steps)]
    rows = []
    for r in report["reports"]:
        busy = sum(r["families_s"].values()) or 1.0
        top = sorted(r["families_s"].items(), key=lambda kv: -kv[1])[:3]
        if "prompt_len" in r:  # Prompt-carrying steps (bench profile --prefill-len).
            check, shape = f"prefill step profile, {r['prompts']} x {r['prompt_len']} tokens", "whole prompts"
        else:
            check, shape = f"decode step profile, batch {r['batch']}", f"context {r['context']}"
        rows.append(Row(check, "INFO",
                        f"{1000 * r['step_s']:.2f} ms a step ({'CUDA graphs' if r['uses_graphs'] else 'eager'}, "
                        f"{shape}); kernel time {1000 * busy:.2f} ms: "
                        + ", ".join(f"{name} {100 * t / busy:.0f}%" for name, t in top)))
    return rows


def _on_cuda(report: dict) -> bool:
    return str(report.get("device", "")).startswith("cuda")


def _step_split(r: dict) -> str:
    """", LOOP loop: prefill steps N in S s, decode steps N in S s": where the time went (reports
    older than the split: nothing)."""
    split = r.get("steps_by_kind")
    if not split:
        return ""
    kinds = [f"{kind} steps {k['steps']} in {k['seconds']:.2f} s" for kind, k in split.items() if k["steps"]]
    return f", {r['loop']} loop: {', '.join(kinds)}"


def offline_rows(results: Path, steps: dict, step: str) -> list[Row]:
    """Per sampling mode: req/s, tok/s and the share of the physical ceiling (judged); then
    the ceiling itself and its formula (INFO)."""
    report = latest_report(results / step)
    check = f"{step}: >= {100 * OFFLINE_SHARE:.0f}% of the physical ceiling"
    if report is None or not report["results"]:
        return [_missing(check, step, steps)]
    w, c = report["workload"], report["ceiling"]
    shape = f"{report['model']}, {w['num_prompts']} x {w['input_len']}/{w['output_len']}"
    rows = [Row(f"offline {shape}, {mode} >= {100 * OFFLINE_SHARE:.0f}% of the ceiling",
                _judged(r["share_of_ceiling"] >= OFFLINE_SHARE, _on_cuda(report)),
                f"{r['requests_per_s']:,.2f} req/s, {r['output_tokens_per_s']:,.0f} output / "
                f"{r['total_tokens_per_s']:,.0f} total tok/s = {100 * r['share_of_ceiling']:.1f}% "
                f"({r['seconds']:.1f} s, {r['num_steps']} steps, {r['num_preemptions']} preemptions"
                f"{_step_split(r)})")
            for mode, r in report["results"].items()]
    if steps.get(step, (0, 0))[0] != 0:  # Cut short: the modes it finished stand, the step failed.
        rows.append(_missing(check, step, steps))
    rows.append(Row(f"offline {report['model']}: the physical ceiling", "INFO",
                    f"{c['output_tokens_per_s']:,.0f} output tok/s ({c['seconds']:.2f} s, {c['bound']}-bound: "
                    f"compute {c['compute_s']:.2f} s at {_rate(report['matmul_peak_gflop_per_s'] * 1e9)}, memory "
                    f"{c['memory_s']:.2f} s at {report['memory_bandwidth_gb_per_s']:,.0f} GB/s); {c['formula']}"))
    return rows


def decode_floor_rows(results: Path, steps: dict, step: str) -> list[Row]:
    """The mean decode step at DECODE_FLOOR_BATCH against its floor (judged); the other
    batch sizes in one INFO row, with the floor's formula. Where the served loop was
    pipelined, each cell names the serial loop's step beside it."""
    report = latest_report(results / step)
    check = f"{step}: batch {DECODE_FLOOR_BATCH} >= {100 * DECODE_FLOOR_SHARE:.0f}% of the floor"
    if report is None:
        return [_missing(check, step, steps)]
    where = f"{report['model']}, context {report['context']}"

    def cell(r: dict) -> str:
        serial = f" (serial loop {r['serial_step_ms']:.3f} ms)" if "serial_step_ms" in r else ""
        return f"{r['step_ms']:.3f} ms vs {r['floor_ms']:.3f} = {100 * r['share_of_floor']:.1f}%{serial}"

    batches = report["batches"]
    rows = []
    if str(DECODE_FLOOR_BATCH) in batches:
        r = batches[str(DECODE_FLOOR_BATCH)]
        rows.append(Row(f"decode {where}, batch {DECODE_FLOOR_BATCH} >= {100 * DECODE_FLOOR_SHARE:.0f}% of the floor",
                        _judged(r["share_of_floor"] >= DECODE_FLOOR_SHARE, _on_cuda(report)),
                        f"{r['tok_per_s']:,.0f} tok/s: a step {cell(r)} of its {r['bound']}-bound floor "
                        f"({'CUDA graphs' if report['uses_graphs'] else 'eager'}, {report.get('loop', 'serial')} loop, "
                        f"{report['memory_bandwidth_gb_per_s']:,.0f} GB/s)"))
    elif _on_cuda(report):
        rows.append(Row(check, "FAIL", f"batch {DECODE_FLOOR_BATCH} not measured: see logs/{step}.log"))
    others = {b: r for b, r in batches.items() if b != str(DECODE_FLOOR_BATCH)}
    if others:
        rows.append(Row(f"decode {where}, batch {' / '.join(others)}: share of the floor", "INFO",
                        "; ".join([*(f"{b}: {r['tok_per_s']:,.0f} tok/s, {cell(r)}" for b, r in others.items()),
                                   *([report["formula"]] if "formula" in report else [])])))
    return rows


def loops_rows(results: Path, steps: dict) -> list[Row]:
    """Per batch size: pipelined over serial steady decode; batch LOOPS_BATCH judged (and
    missing it on CUDA fails)."""
    report = latest_report(results / "loops")
    check = f"pipelined loop >= {PIPELINED_OVER_SERIAL:g}x serial, batch {LOOPS_BATCH}"
    if report is None:
        return [_missing(check, "loops", steps)]
    loops, rows = report["loops"], []
    for batch, ratio in report["pipelined_over_serial"].items():
        judged = int(batch) == LOOPS_BATCH
        serial, pipelined = loops["serial"][batch], loops["pipelined"][batch]
        rows.append(Row(check if judged else f"pipelined loop over serial, batch {batch}",
                        _judged(ratio >= PIPELINED_OVER_SERIAL, _on_cuda(report)) if judged else "INFO",
                        f"steady decode {pipelined['steady_tokens_per_s']:,.0f} vs "
                        f"{serial['steady_tokens_per_s']:,.0f} tok/s = {ratio:.2f}x ({report['model']}, through gRPC with {report['transport']})"))
    if _on_cuda(report) and str(LOOPS_BATCH) not in report["pipelined_over_serial"]:
        rows.append(Row(check, "FAIL", f"batch {LOOPS_BATCH} not measured (no steady window?): see logs/loops.log"))
    return rows


def time_row(steps: dict) -> Row:
    """INFO: the run's seconds, and each step's that took any."""
    total = steps.get("total", (0, 0.0))[1]
    spent = ", ".join(f"{name} {secs:.0f}" for name, (rc, secs) in steps.items() if secs and name != "total")
    return Row("time (seconds)", "INFO", f"{total:.0f} in all" + (f"; {spent}" if spent else ""))


def summarize(results: Path) -> list[Row]:
    steps = read_steps(results)
    device = next((r["device"] for r in (latest_report(results / d) for d in REPORT_DIRS) if r), "cpu")
    return [
        step_row("install (wheelhouse + project, no registry)", "install", steps),
        step_row("installed versions and their requirements", "verify", steps),
        model_row(results, steps),
        *offline_rows(results, steps, "offline-1b"),
        *decode_floor_rows(results, steps, "decode-floor-1b"),
        *loops_rows(results, steps),
        *profile_rows(results, steps),
        tests_row(results, steps, device.startswith("cuda")),
        model_row(results, steps, "random-model-8b.json", "make-model-8b"),
        *offline_rows(results, steps, "offline-8b"),
        *decode_floor_rows(results, steps, "decode-floor-8b"),
        tests_row(results, steps, device.startswith("cuda"), "host-cpu", "CPU kernel tests on the host's CPU"),
        kv_row(results, steps),
        *decode_rows(results, steps),
        *throughput_rows(results, steps),
        time_row(steps),
    ]


def render(rows: list[Row], title: str) -> str:
    width = max(len(r.check) for r in rows)
    lines = [title, f"{'check':<{width}} | result | figure", f"{'-' * width}-+--------+-------"]
    lines += [f"{r.check:<{width}} | {r.result:<6} | {r.figure}" for r in rows]
    failed = sum(r.result == "FAIL" for r in rows)
    lines.append(f"{'FAILED' if failed else 'PASSED'}: {failed} of {len(rows)} rows failed")
    return "\n".join(lines)


def title(results: Path) -> str:
    report = next((r for r in (latest_report(results / d) for d in REPORT_DIRS) if r), None)
    if report is None:
        return "GPU self-check"
    m = report["machine"]
    return (f"GPU self-check on {m.get('cuda') or 'CPU (dry run)'}: torch {m['torch']}, CUDA {m.get('cuda_version')}, "
            f"Python {m['python']}, git {m['git_revision'] or '?'}, {m['date']}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__)
        return 2
    results = Path(argv[0])
    rows = summarize(results)
    text = render(rows, title(results))
    print(text, flush=True)
    (results / "summary.md").write_text(text + "\n")
    (results / "summary.json").write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 1 if any(r.result == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
