#!/usr/bin/env bash
# The main job: set up, start the local cluster (router, scheduler, worker) serving the
# embedded SmolLM2-135M-Instruct, and answer a prompt. Extra arguments go to `llmserve up`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if [ $# -eq 0 ]; then
  set -- --prompt "What is the capital of France?"
fi
exec llmserve up "$@"
