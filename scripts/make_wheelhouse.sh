#!/usr/bin/env bash
# Downloads the wheels a GPU machine without a package registry lacks
# (scripts/gpu-wheels.txt: one version each, at our pins; scripts/gpu-build-wheels.txt:
# the build backend that builds the project there) into a wheelhouse that
# scripts/gpu_check.sh installs there. Run it here, where pip reaches a registry; carry
# the wheelhouse (git-ignored) to the GPU machine with the checkout.
#
#   bash scripts/make_wheelhouse.sh [--python-version 3.12] [--dest .wheelhouse]
#
# Binary wheels only, for CPython X.Y on manylinux x86_64 (pure-python ones are
# py3-none-any), without dependencies: the list is the whole closure already.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON_VERSION=3.12
DEST=.wheelhouse
LISTS=(scripts/gpu-wheels.txt scripts/gpu-build-wheels.txt)
MAX_MIB=50  # With the checkout it must travel in 60 MiB.

while [ $# -gt 0 ]; do
  case "$1" in
    --python-version) PYTHON_VERSION=$2; shift 2 ;;
    --dest) DEST=$2; shift 2 ;;
    -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "make_wheelhouse: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
# name==version lines of the list, comments dropped.
mapfile -t PINS < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "${LISTS[@]}" | grep -v '^$')

mkdir -p "$DEST"
rm -f "$DEST"/*.whl  # A stale wheel of another version would be installed beside the right one.
"$PY" -m pip download --quiet --no-deps --only-binary=:all: \
  --python-version "$PYTHON_VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --dest "$DEST" "${PINS[@]}" 2> >(grep -v "^WARNING: Location" >&2)
cp "${LISTS[@]}" "$DEST/"
echo "python $PYTHON_VERSION" > "$DEST/PYTHON_VERSION"

# One wheel per pin, and nothing else.
count=$(ls "$DEST"/*.whl | wc -l)
if [ "$count" -ne "${#PINS[@]}" ]; then
  echo "make_wheelhouse: $count wheels for ${#PINS[@]} pins in $DEST" >&2
  exit 1
fi
# Every wheel's own Requires-Dist, for that Python, is met by another wheel here or by the image.
"$PY" scripts/wheelhouse.py check-wheels "$DEST" \
  --python-version "$PYTHON_VERSION" --image scripts/gpu-image.txt
ls -l "$DEST"/*.whl | awk '{printf "%9.1f KiB  %s\n", $5 / 1024, $NF}'
bytes=$(cat "$DEST"/*.whl | wc -c)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "wheelhouse: $count wheels for CPython $PYTHON_VERSION, $mib MiB in $DEST"
if [ "$bytes" -gt $((MAX_MIB * 1048576)) ]; then
  echo "make_wheelhouse: over $MAX_MIB MiB" >&2
  exit 1
fi
