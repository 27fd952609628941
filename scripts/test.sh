#!/usr/bin/env bash
# Set up, then run the whole test suite (CPU). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# The Compose specification's JSON schema, for the docker-compose.yml test: it ships in
# the docker-compose package on PyPI (no Docker engine is needed to validate against it).
if [ ! -f .cache/compose-spec/compose_spec.json ]; then
  mkdir -p .cache/compose-spec
  python -m pip download --quiet --no-deps --dest .cache/compose-spec "docker-compose==1.29.2"
  python -c "import zipfile, glob; z = zipfile.ZipFile(glob.glob('.cache/compose-spec/docker_compose-*.whl')[0]); open('.cache/compose-spec/compose_spec.json', 'wb').write(z.read('compose/config/compose_spec.json'))"
fi
export COMPOSE_SPEC_SCHEMA="$PWD/.cache/compose-spec/compose_spec.json"
# Convert the embedded model once, before tests in several processes need it.
python -c "from llmserve.model_store import default_model_dir; print('model:', default_model_dir())"
# Build the CPU kernels once too (~80 s on 2 cores, for this venv's torch and this CPU):
# otherwise the first test that loads them builds them while the others wait on the lock.
python -c "from llmserve.kernels import cpu; print('CPU kernels:', 'built' if cpu.load() else 'unavailable')"
exec python -m pytest -q --durations=15 "$@"
