#!/usr/bin/env bash
# Streams a chat completion from a router with `buf curl`, which learns the API from the
# router's reflection service (no .proto needed on the client side).
#
#   bash examples/buf_curl.sh "What is the capital of France?"
#
# buf: `pip install buf-bin` or https://buf.build/docs/installation. The variables are the
# ones `llmserve up` prints and the Python and Node clients read: LLMSERVE_TARGET
# (default localhost:50051), LLMSERVE_TLS_CA, LLMSERVE_API_KEY, LLMSERVE_INSECURE=1
# for a plaintext router. REFLECT_PROTOCOL=grpc-v1alpha for servers that lack v1.
#
# The same call with grpcurl (https://github.com/fullstorydev/grpcurl):
#   grpcurl -cacert "$LLMSERVE_TLS_CA" -H "authorization: Bearer $LLMSERVE_API_KEY" \
#     -d '{"messages": {"messages": [{"role": "user", "content": "Hi"}]}, "params": {"max_tokens": 32}}' \
#     localhost:50051 llmserve.v1.Generation/Generate
#   grpcurl -cacert "$LLMSERVE_TLS_CA" -H "authorization: Bearer $LLMSERVE_API_KEY" \
#     localhost:50051 describe llmserve.v1.SamplingParams     # the .proto's comments
set -euo pipefail
prompt=${1:-What is the capital of France?}
target=${LLMSERVE_TARGET:-localhost:50051}
args=(--protocol grpc --reflect-protocol "${REFLECT_PROTOCOL:-grpc-v1}")
case "${LLMSERVE_INSECURE:-}" in
  1|true|yes|on) scheme=http; args+=(--http2-prior-knowledge) ;;
  *) scheme=https; [ -n "${LLMSERVE_TLS_CA:-}" ] && args+=(--cacert "$LLMSERVE_TLS_CA") ;;
esac
# The key goes on the call and on the reflection requests (buf sends -H on the call only).
if [ -n "${LLMSERVE_API_KEY:-}" ]; then
  args+=(-H "authorization: Bearer $LLMSERVE_API_KEY" --reflect-header "authorization: Bearer $LLMSERVE_API_KEY")
fi
# JSON in the proto3 mapping: field names as in the .proto, enums by name.
body=$(python3 -c 'import json, sys; print(json.dumps({
    "messages": {"messages": [{"role": "user", "content": sys.argv[1]}]},
    "params": {"max_tokens": int(sys.argv[2]), "temperature": 0}}))' "$prompt" "${MAX_TOKENS:-32}")
exec buf curl "${args[@]}" --data "$body" "$scheme://$target/llmserve.v1.Generation/Generate"
