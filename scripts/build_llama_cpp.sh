#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` and `llama-quantize` once, from the llama.cpp that the
# llama-cpp-python source distribution on PyPI vendors (no git, no other network), and
# converts a model to GGUF at F32, BF16, Q8_0 and Q4_K_M: the baseline of
# `llmserve bench throughput --baseline llama-cpp`, and of `llmserve bench serve --backend
# openai` (llama-server speaks OpenAI's API). Not run in CI (~6 min to build on 2 cores).
#
#   bash scripts/build_llama_cpp.sh [--model DIR] [--out DIR]
#   llmserve bench throughput --workload reference --baseline llama-cpp --llama-cpp-quant F32 BF16 Q8_0 Q4_K_M
#   .cache/llama.cpp/bin/llama-server -m .cache/llama.cpp/models/<name>-f32.gguf \
#       --port 8080 -np 64 -c 65536 -t 2 &           # 64 slots, continuous batching
#   llmserve bench serve --backend openai --target http://127.0.0.1:8080/v1 --workload reference
#
# --model: an HF directory (default: the embedded SmolLM2-135M-Instruct, converted from
# its GGUF by llmserve). Build: Release, GGML_NATIVE (the host's own instruction sets),
# no CURL/OpenSSL (nothing is downloaded at run time).
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA_CPP_PYTHON=0.3.36  # Vendors llama.cpp and convert_hf_to_gguf.py.
SENTENCEPIECE=0.2.3      # convert_hf_to_gguf.py imports it for Llama vocabularies (only there: not ours).
OUT=.cache/llama.cpp
MODEL=
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build_llama_cpp: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
mkdir -p "$OUT/src" "$OUT/bin" "$OUT/models"
OUT=$(cd "$OUT" && pwd)

src="$OUT/src/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp"
if [ ! -f "$src/CMakeLists.txt" ]; then
  "$PY" -m pip download --quiet --no-deps --no-binary :all: --dest "$OUT/src" \
    "llama-cpp-python==$LLAMA_CPP_PYTHON" 2> >(grep -v "^WARNING: Location" >&2)
  tar -xzf "$OUT/src/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$OUT/src"
fi
if [ ! -x "$OUT/bin/llama-server" ]; then
  cmake -S "$src" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TOOLS=ON > "$OUT/cmake.log"
  cmake --build "$src/build" --target llama-server llama-quantize -j "$(nproc)" > "$OUT/build.log"
  cp "$src/build/bin/llama-server" "$src/build/bin/llama-quantize" "$OUT/bin/"
  cp "$src"/build/bin/*.so* "$OUT/bin/" 2>/dev/null || true
fi

if [ -z "$MODEL" ]; then
  MODEL=$("$PY" -c "from llmserve.model_store import default_model_dir; print(default_model_dir())")
fi
name=$(basename "$MODEL")
[ -d "$OUT/pydeps/sentencepiece" ] || "$PY" -m pip install --quiet --target "$OUT/pydeps" \
  "sentencepiece==$SENTENCEPIECE" 2> >(grep -v "^WARNING: Location" >&2)
for outtype in f32 bf16; do
  gguf="$OUT/models/$name-$outtype.gguf"
  [ -f "$gguf" ] || PYTHONPATH="$src/gguf-py:$OUT/pydeps${PYTHONPATH:+:$PYTHONPATH}" "$PY" "$src/convert_hf_to_gguf.py" \
    "$MODEL" --outtype "$outtype" --outfile "$gguf" > "$OUT/convert-$outtype.log" 2>&1
done
for quant in Q8_0 Q4_K_M; do
  gguf="$OUT/models/$name-$(echo "$quant" | tr 'A-Z' 'a-z').gguf"
  [ -f "$gguf" ] || LD_LIBRARY_PATH="$OUT/bin" "$OUT/bin/llama-quantize" "$OUT/models/$name-f32.gguf" "$gguf" "$quant" \
    > "$OUT/quantize-$quant.log" 2>&1
done
ls -l "$OUT/bin/llama-server" "$OUT"/models/*.gguf
