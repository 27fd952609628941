#!/usr/bin/env bash
# GPU self-check: on a bare CUDA machine without a package registry, install llmserve
# from the checkout and a wheelhouse (scripts/make_wheelhouse.sh, made beforehand where a
# registry is reachable), then prove the GPU path in one run, within a time budget
# (--budget, 540 s: one device call of at most 10 minutes), the most important figures
# first:
#   - a random-weight ~1B Llama (Llama 3.2 1B's shape) made on the spot, in bf16,
#   - offline-1b: vLLM's offline benchmark (1,000 random prompts, 1,024 in / 128 out,
#     greedy and temperature 1.0, in-process): req/s, tok/s and the share of the physical
#     ceiling from the measured matmul peak and bandwidth (target: >= 50%),
#   - decode-floor-1b: decode at batch 1 / 8 / 64 / 256, context 1,024, against the
#     bandwidth floor (target at batch 1: >= 60%),
#   - loops: the serial vs the pipelined engine loop through a local cluster, batch 64
#     (target: pipelined >= 1.3x),
#   - where a 1B decode step's GPU time goes at batch 1 and 64, context 1,024, and a
#     prompt-carrying step's, 16 prompts of 1,024 (bench profile, by kernel family, beside
#     the unprofiled step),
#   - the GPU tests (pytest -m gpu),
#   - a random Llama-3.1-8B-shaped model (16 GB in bf16), offline-8b (target: >= 50%) and
#     decode-floor-8b (both met on an H200, 2026-11-28: after the 1B's open targets),
#   - host-cpu: the CPU kernels' tests on the GPU host's own CPU, in a process of their own,
#   - the KV cache the worker sizes vs what fits after start-up (target: within 5%),
#   - decode tok/s with CUDA graphs vs --enforce-eager at batch 1, 2, 4, 8 (target: >= 1.5x),
#     and a mixed step, a 256-token prefill + 63 decodes, piecewise graphs vs eager (target:
#     piecewise faster),
#   - the engine vs HF static-batch generate on the reference workload (target: >= 3x),
#     with MFU against a bf16 matmul peak and the roofline floor, both measured in the run,
# then print one summary table. Exits non-zero when any check fails. A step that the
# budget leaves less than a minute is skipped (SKIP in the table, with why); each step
# also has its own hard timeout.
#
#   bash scripts/gpu_check.sh [--wheelhouse DIR] [--quick] [--device cuda|cpu] [--budget S]
#                             [--only STEP,...] [--install auto|venv|target|none] [--python PY]
#                             [--pack]
#
# --quick: fewer decode steps, one throughput round, 256 prompts for the 8B model.
# --budget S: seconds for the whole run (540); the summary always comes last.
# --only STEP,...: those steps alone (a random model they need is made when missing), e.g.
# --only offline-1b,loops; steps: verify make-model offline-1b decode-floor-1b loops profile
# gpu-tests make-model-8b offline-8b decode-floor-8b host-cpu kv-sizing decode throughput.
# --pack: at the end, every log and report in one RESULTS/gpu-check.tar.gz beside
# summary.md and summary.json, and nothing else left in RESULTS (a device call brings
# back at most 8 files: on 2026-11-28 the logs of a failed step stayed behind).
# --device cpu (or LLMSERVE_GPU_CHECK_DEVICE=cpu): a dry run of the same flow on the CPU
# with tiny models and few prompts (performance targets are then SKIP). Without CUDA and
# without --device cpu it stops at once with "no CUDA device: ...".
# --install: venv = into the interpreter's venv (pip --no-deps, the project editable);
# target = into .gpu-check/site on PYTHONPATH (the venv is left untouched); auto = venv
# when the interpreter runs in a writable venv, else target; none = already installed.
# Interpreter: --python, else $PYTHON, else /opt/torch/.venv/bin/python3, else python3.
# Logs and reports go to $OUT if set, else gpu-check-results/; random models to
# $LLMSERVE_GPU_CHECK_SCRATCH if set, else .gpu-check/ (a complete one is kept for reruns).
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELHOUSE=.wheelhouse
QUICK=0
DEVICE=${LLMSERVE_GPU_CHECK_DEVICE:-cuda}
INSTALL=auto
PY=${PYTHON:-}
BUDGET=540
ONLY=
PACK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --wheelhouse) WHEELHOUSE=$2; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --device) DEVICE=$2; shift 2 ;;
    --install) INSTALL=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --budget) BUDGET=$2; shift 2 ;;
    --only) ONLY=$2; shift 2 ;;
    --pack) PACK=1; shift ;;
    -h|--help) sed -n '2,52p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$DEVICE" in cuda|cpu) ;; *) echo "gpu_check: --device is cuda or cpu, not $DEVICE" >&2; exit 2 ;; esac
if [ -z "$PY" ]; then
  if [ -x /opt/torch/.venv/bin/python3 ]; then PY=/opt/torch/.venv/bin/python3; else PY=python3; fi
fi

RESULTS=${OUT:-gpu-check-results}
SCRATCH=${LLMSERVE_GPU_CHECK_SCRATCH:-$PWD/.gpu-check}  # Random models (kept between runs) and the install.
case "$SCRATCH" in /*) ;; *) SCRATCH=$PWD/$SCRATCH ;; esac
TARGET=$SCRATCH/site
WHEEL_LIST=scripts/gpu-wheels.txt
BUILD_LIST=scripts/gpu-build-wheels.txt
BUILD_BACKEND=$SCRATCH/build-backend
T0=$(date +%s)

# --- Preflight: fail fast, before installing anything. ---------------------------------
if [ "$DEVICE" = cuda ]; then
  if ! why=$("$PY" - 2>&1 <<'PREFLIGHT'
import os, sys
try:
    import torch
except Exception as err:
    sys.exit(f"torch does not import with {sys.executable}: {err}")
if not torch.cuda.is_available():
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    sys.exit(f"torch {torch.__version__} (CUDA build {torch.version.cuda}) sees no GPU "
             f"(CUDA_VISIBLE_DEVICES={visible!r}); --device cpu runs a CPU dry run")
print(torch.cuda.get_device_name(0))
PREFLIGHT
  ); then
    echo "no CUDA device: $(echo "$why" | tail -n 1)" >&2
    exit 2
  fi
  echo "gpu_check: $why, $("$PY" --version 2>&1)"
else
  echo "gpu_check: CPU dry run, $("$PY" --version 2>&1)"
fi
if [ "$INSTALL" != none ]; then
  want=$(cat "$WHEELHOUSE/PYTHON_VERSION" 2>/dev/null | cut -d' ' -f2)
  have=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  if [ -z "$want" ]; then
    echo "gpu_check: no wheelhouse at $WHEELHOUSE: run scripts/make_wheelhouse.sh where a registry is reachable" >&2
    exit 2
  elif [ "$want" != "$have" ]; then
    echo "gpu_check: $WHEELHOUSE holds wheels for Python $want, $PY is $have" \
      "(scripts/make_wheelhouse.sh --python-version $have)" >&2
    exit 2
  fi
fi

# Our own outputs only: a previous run's reports would be read as this run's.
mkdir -p "$RESULTS/logs" "$SCRATCH"
rm -rf "$RESULTS"/{kv-sizing,decode,throughput,profile,offline-1b,offline-8b,decode-floor-1b,decode-floor-8b,loops}
rm -rf "$RESULTS"/logs/*.log
rm -f "$RESULTS"/{steps.tsv,gpu-tests.xml,host-cpu.xml,random-model.json,random-model-8b.json}
rm -f "$RESULTS"/{summary.md,summary.json,gpu-check.tar.gz}
rm -f "$RESULTS"/environment.txt

# The steps --only names, with the random models they need: `,a,b,` for a lookup.
if [ -n "$ONLY" ]; then
  case ",$ONLY," in *,offline-1b,*|*,decode-floor-1b,*|*,loops,*|*,kv-sizing,*|*,decode,*|*,throughput,*|*,profile,*)
    ONLY="$ONLY,make-model" ;; esac
  case ",$ONLY," in *,offline-8b,*|*,decode-floor-8b,*) ONLY="$ONLY,make-model-8b" ;; esac
fi
# NOTE: a step may overrun its timeout by the 30 s grace `timeout` gives before SIGKILL;
# what is left past the deadline is the summary's.
DEADLINE=$(( T0 + BUDGET - 15 ))
MIN_STEP_S=60  # A step left less than this is skipped, not started.

# skip_step NAME WHY: a step not run, in steps.tsv as WHY (only, budget), and why here.
skip_step() {
  printf '%s\t%s\t0\n' "$1" "$2" >> "$RESULTS/steps.tsv"
  [ "$2" = budget ] && echo "gpu_check: $1 skipped: $(( DEADLINE - $(date +%s) )) s left of the ${BUDGET} s budget"
  return 0
}

# run_step NAME SECONDS CMD...: CMD's output to logs/NAME.log, its exit code and time to
# steps.tsv, one status line here (and the log's tail when it fails). Its timeout is
# SECONDS or what is left of the budget, whichever is less; a step --only leaves out, or
# that the budget leaves under MIN_STEP_S, is skipped.
run_step() {
  local name=$1 limit=$2 start rc secs left
  shift 2
  if [ -n "$ONLY" ] && [ "$name" != install ] && [[ ",$ONLY," != *",$name,"* ]]; then
    skip_step "$name" only
    return 0
  fi
  start=$(date +%s)
  left=$(( DEADLINE - start ))
  if [ "$left" -lt "$MIN_STEP_S" ]; then
    skip_step "$name" budget
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "gpu_check: $name ..."
  if declare -F "$1" > /dev/null; then  # A function of this script: timeout cannot run it.
    "$@" > "$RESULTS/logs/$name.log" 2>&1
  else
    timeout --kill-after=30 "$limit" "$@" > "$RESULTS/logs/$name.log" 2>&1
  fi
  rc=$?
  secs=$(( $(date +%s) - start ))
  printf '%s\t%s\t%s\n' "$name" "$rc" "$secs" >> "$RESULTS/steps.tsv"
  if [ "$rc" -eq 0 ]; then
    echo "gpu_check: $name ok (${secs} s)"
  else
    echo "gpu_check: $name exited $rc after ${secs} s; the end of logs/$name.log:"
    tail -n 15 "$RESULTS/logs/$name.log" | sed 's/^/    /'
  fi
  return "$rc"
}

# --- Install: the wheelhouse with --no-deps, then the project without build isolation
# (no registry to fetch a build backend from: the wheelhouse brings one). -------------
# PIP_CONFIG_FILE=/dev/null and --isolated: no pip.conf or PIP_* variable may add an
# index, links or constraints: exactly the listed wheels, from the wheelhouse.
PROJECTS=(./protos . ./kernels ./services/scheduler ./services/router ./services/worker ./launcher ./bench)
PIP=(env PIP_CONFIG_FILE=/dev/null "$PY" -m pip install --isolated --no-index --no-deps --disable-pip-version-check
     --no-input)

# The build backend goes to its own folder, on PYTHONPATH for the builds only: the
# image's setuptools stays as it is.
install_build_backend() {
  rm -rf "$BUILD_BACKEND"
  "${PIP[@]}" --target "$BUILD_BACKEND" --find-links "$WHEELHOUSE" -r "$BUILD_LIST"
}

install_into_venv() {
  local editable=() p
  for p in "${PROJECTS[@]}"; do editable+=(-e "$p"); done
  install_build_backend &&
    "${PIP[@]}" --find-links "$WHEELHOUSE" -r "$WHEEL_LIST" &&
    env PYTHONPATH="$BUILD_BACKEND" "${PIP[@]}" --no-build-isolation "${editable[@]}"
}

install_into_target() {
  # One pip call: the namespace package `llmserve` spans seven distributions, and pip
  # --target skips a top-level directory that an earlier call already made.
  rm -rf "$TARGET"
  install_build_backend &&
    env PYTHONPATH="$BUILD_BACKEND" "${PIP[@]}" --no-build-isolation --target "$TARGET" \
      --find-links "$WHEELHOUSE" -r "$WHEEL_LIST" "${PROJECTS[@]}"
}

# auto: the venv when the interpreter runs in one it may write to; the target folder
# otherwise, or when that fails (a pip too old for editable pyproject installs, say).
# NOTE: run_step calls it in this shell, so INSTALL names the mode that was used.
install_auto() {
  if "$PY" -c 'import os, sys, sysconfig
sys.exit(not (sys.prefix != sys.base_prefix and os.access(sysconfig.get_paths()["purelib"], os.W_OK)))'; then
    INSTALL=venv
    install_into_venv && return 0
    echo "gpu_check: installing into the venv failed; into $TARGET instead"
  fi
  INSTALL=target
  install_into_target
}

case "$INSTALL" in
  auto) run_step install 600 install_auto ;;
  venv) run_step install 600 install_into_venv ;;
  target) run_step install 600 install_into_target ;;
  none) printf 'install\t0\t0\n' >> "$RESULTS/steps.tsv" ;;
  *) echo "gpu_check: --install is auto, venv, target or none, not $INSTALL" >&2; exit 2 ;;
esac
INSTALLED=$?
if [ "$INSTALL" = target ]; then
  export PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$TARGET/bin:$PATH"
fi
echo "install mode: $INSTALL" > "$RESULTS/environment.txt"

# --- The checks. -----------------------------------------------------------------------
q() { [ "$QUICK" = 1 ] && echo "$1" || echo "$2"; }  # q QUICK FULL: the --quick value or the full one.
if [ "$DEVICE" = cuda ]; then
  PRESET=llama-1b PRESET_8B=llama-8b DTYPE=bfloat16 SHARDS=()
  # vLLM's offline benchmark: 1,000 random prompts, 1,024 in / 128 out (the 8B model
  # takes ~7x the 1B's time: --quick gives it 256 prompts).
  OFFLINE_1B=(--num-prompts 1000 --input-len 1024 --output-len 128 --warmup-prompts 64)
  OFFLINE_8B=(--num-prompts "$(q 256 1000)" --input-len 1024 --output-len 128 --warmup-prompts 32)
  FLOOR=(--batch 1 8 64 256 --context 1024 --steps "$(q 16 32)")
  LOOPS=(--batch 64 --prompt-len 128 --max-tokens "$(q 128 256)")
  # --mixed: a step of a 256-token prefill beside 63 decodes, piecewise graphs vs eager.
  DECODE=(--batch 1 2 4 8 --context 256 --steps "$(q 32 96)" --mixed 256 63)
  # The reference workload; the engine's KV cache at half the GPU (its peak need is
  # under 1 GiB) leaves HF's generate the other half in the same process.
  TPUT=(--workload reference --gpu-memory-utilization 0.5 --repeat "$(q 1 3)")
  KV=()
  # Decode at batch 1 and 64, and prompt-carrying steps as offline-1b's first ones (16 x 1,024).
  PROFILE=(--batch 1 64 --context 1024 --prefill-len 1024)
else
  # tiny-untied stands in for the 8B model: its untied head, llama3 rope and shards.
  PRESET=tiny PRESET_8B=tiny-untied DTYPE=float32 SHARDS=(--shard-bytes 65536)
  OFFLINE_1B=(--num-prompts 6 --input-len 24 --output-len 4 --warmup-prompts 2 --kv-cache-memory 64MiB
              --calibrate-s 0.1)
  OFFLINE_8B=("${OFFLINE_1B[@]}")
  FLOOR=(--batch 1 4 --context 24 --steps 4 --calibrate-s 0.1)
  LOOPS=(--batch 4 --prompt-len 8 --max-tokens 8)
  DECODE=(--batch 1 2 --context 32 --steps 8 --mixed 16 3)
  TPUT=(--workload random --num-requests 8 --input-len 8 40 --output-len 4 16 --hf-batch-size 4)
  KV=(--kv-cache-memory 64MiB)
  PROFILE=(--batch 2 --context 32 --prefill-len 16 --prefill-step-tokens 64)
fi
MODEL=$SCRATCH/model-$PRESET
MODEL_8B=$SCRATCH/model-$PRESET_8B
BENCH=("$PY" -m llmserve.cli --log-level INFO bench)

# make_model STEP DIR PRESET SECONDS REPORT: a random model, unless DIR holds a complete
# one from an earlier run (random-model.json is written last; older runs wrote no
# tokenizer); what it is goes to $RESULTS/REPORT for the summary.
make_model() {
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$1,"* ]]; then
    skip_step "$1" only
    return 0
  fi
  if [ ! -f "$2/random-model.json" ] || [ ! -f "$2/tokenizer.json" ]; then
    rm -rf "$2"
    run_step "$1" "$4" "${BENCH[@]}" make-model --out "$2" --preset "$3" --device "$DEVICE" \
      ${SHARDS[@]+"${SHARDS[@]}"}
  else
    printf '%s\t0\t0\n' "$1" >> "$RESULTS/steps.tsv"
  fi
  cp "$2/random-model.json" "$RESULTS/$5" 2>/dev/null
  return 0
}

if [ "$INSTALLED" -eq 0 ]; then
  {
    "$PY" -c 'import torch, triton, transformers, sys
print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda)
print("triton", triton.__version__); print("transformers", transformers.__version__)' 2>&1
    # The kernel (a sandbox such as gVisor reports its own, e.g. 4.4.0), the C library and
    # the compiler that builds the CPU kernels: what a fault of the host's CPU path depends on.
    echo "kernel $(uname -srm)"
    echo "libc $(ldd --version 2>&1 | head -n 1)"
    echo "c++ $(c++ --version 2>&1 | head -n 1)"
    command -v nvidia-smi > /dev/null && nvidia-smi 2>&1
  } >> "$RESULTS/environment.txt"
  run_step verify 120 "$PY" scripts/wheelhouse.py verify "$WHEEL_LIST"
  make_model make-model "$MODEL" "$PRESET" 300 random-model.json
  COMMON=(--model "$MODEL" --device "$DEVICE" --dtype "$DTYPE")
  COMMON_8B=(--model "$MODEL_8B" --device "$DEVICE" --dtype "$DTYPE")
  # Issue #31's figures first, most important first: what the budget cuts is the tail.
  run_step offline-1b "$(q 180 240)" "${BENCH[@]}" offline "${COMMON[@]}" "${OFFLINE_1B[@]}" \
    --output-dir "$RESULTS/offline-1b"
  run_step decode-floor-1b "$(q 120 150)" "${BENCH[@]}" decode-floor "${COMMON[@]}" "${FLOOR[@]}" \
    --output-dir "$RESULTS/decode-floor-1b"
  run_step loops "$(q 180 240)" "${BENCH[@]}" loops "${COMMON[@]}" "${LOOPS[@]}" --log-dir "$RESULTS/logs/loops" \
    --output-dir "$RESULTS/loops"
  # Where the 1B's decode step goes: the kernels' GPU time beside the whole step's.
  run_step profile 180 "${BENCH[@]}" profile --model "$MODEL" --device "$DEVICE" --dtype "$DTYPE" \
    "${PROFILE[@]}" --output-dir "$RESULTS/profile"
  # Bounded, so that the whole check stays within its budget. tests/ops checks the
  # Kubernetes manifests (kubernetes-validate, not in the wheelhouse) and has no GPU test.
  run_step gpu-tests "$(q 210 300)" \
    "$PY" -m pytest -m gpu -q -rfE --durations=15 -p no:cacheprovider --ignore=tests/ops tests/ --junitxml "$RESULTS/gpu-tests.xml"
  # The 8B figures met their targets on an H200 (2026-11-28): after the 1B's open ones.
  make_model make-model-8b "$MODEL_8B" "$PRESET_8B" 240 random-model-8b.json
  run_step offline-8b "$(q 200 360)" "${BENCH[@]}" offline "${COMMON_8B[@]}" "${OFFLINE_8B[@]}" \
    --output-dir "$RESULTS/offline-8b"
  run_step decode-floor-8b "$(q 120 150)" "${BENCH[@]}" decode-floor "${COMMON_8B[@]}" "${FLOOR[@]}" \
    --output-dir "$RESULTS/decode-floor-8b"
  # The CPU kernels' tests on this host's CPU (CPU tests, not marked gpu), faulthandler on:
  # a crash names its test in the log, and ends this step alone.
  run_step host-cpu 150 "$PY" -X faulthandler -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_cpu_amx.py \
    tests/kernels/test_cpu_f32_tiles.py tests/kernels/test_cpu_paged_attention_prefill.py \
    --junitxml "$RESULTS/host-cpu.xml"
  # ${KV[@]+...}: an empty array under `set -u` on bash before 4.4.
  run_step kv-sizing 300 "${BENCH[@]}" kv-sizing "${COMMON[@]}" ${KV[@]+"${KV[@]}"} --output-dir "$RESULTS/kv-sizing"
  run_step decode 300 "${BENCH[@]}" decode "${COMMON[@]}" "${DECODE[@]}" --output-dir "$RESULTS/decode"
  run_step throughput 420 "${BENCH[@]}" throughput "${COMMON[@]}" "${TPUT[@]}" --baseline hf \
    --output-dir "$RESULTS/throughput"
fi

echo "gpu_check: done in $(( $(date +%s) - T0 )) s of a ${BUDGET} s budget; logs and reports in $RESULTS"
printf 'total\t0\t%s\n' "$(( $(date +%s) - T0 ))" >> "$RESULTS/steps.tsv"
echo
"$PY" scripts/gpu_summary.py "$RESULTS"
status=$?
if [ "$PACK" = 1 ]; then
  # Everything but the summary into one archive, then only the three files left.
  (cd "$RESULTS" && tar czf "$SCRATCH/gpu-check.tar.gz" --exclude=summary.md --exclude=summary.json . &&
     find . -mindepth 1 -maxdepth 1 ! -name summary.md ! -name summary.json -exec rm -rf {} + &&
     mv "$SCRATCH/gpu-check.tar.gz" .) && echo "gpu_check: logs and reports packed in $RESULTS/gpu-check.tar.gz"
fi
exit $status
