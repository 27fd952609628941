#!/usr/bin/env bash
# Set up, then run the whole test suite (CPU). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# Convert the embedded model once, before tests in several processes need it.
python -c "from llmserve.model_store import default_model_dir; print('model:', default_model_dir())"
exec python -m pytest -q --durations=15 "$@"
