// Rotary embedding fused with the paged KV-cache write on CPU: one pass over each
// token's q, k and v heads instead of rotate q, rotate k, then two index_copy_ into the cache.
//
//   rotary_and_write_kv_(qkv [T, (H + 2*KVH) * D], cos, sin [T, (1,) R/2],
//                        kv_cache [2, NB, BS, KVH, D], slot_mapping [T] int64, H, KVH, D)
//
// In place on qkv: the first R dims of every q and k head rotate (rotary_math.h), and
// the rotated k row and the v row of token t are stored at flat slot slot_mapping[t]
// of kv_cache[0] and kv_cache[1]; slot -1 stores nothing (a padding token: the CUDA-graph
// decode path pads its batch so). R < D is partial rotary (Phi-3/4).
// The copies into the cache are exact: the result is the torch reference's (apply_rotary,
// then index_copy_).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "rotary_math.h"

namespace {

// Tokens per task: a decode batch stays on one thread, where a fork costs more than the work.
inline int64_t token_grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

using llmserve_rotary::rotate_heads;

void check_args(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_cache,
                const at::Tensor& slot_mapping, int64_t H, int64_t KVH, int64_t D) {
  TORCH_CHECK(H > 0 && KVH > 0 && D > 0, "rotary_and_write_kv: heads and head_dim must be > 0");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (H + 2 * KVH) * D,
              "rotary_and_write_kv: qkv [T, (H + 2*KVH) * D] with contiguous rows");
  const int64_t T = qkv.size(0);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.dim() >= 2 &&
                  cos.size(0) == T && cos.numel() == T * cos.size(-1),
              "rotary_and_write_kv: cos/sin [T, R/2] (or [T, 1, R/2]) contiguous");
  const int64_t half = cos.size(-1);
  TORCH_CHECK(half > 0 && 2 * half <= D, "rotary_and_write_kv: rotary dim 2 * cos.size(-1) must be in (0, D]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous() && kv_cache.size(0) == 2 && kv_cache.size(3) == KVH &&
                  kv_cache.size(4) == D,
              "rotary_and_write_kv: kv_cache [2, NB, BS, KVH, D] contiguous");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type() &&
                  kv_cache.scalar_type() == qkv.scalar_type(),
              "rotary_and_write_kv: cos, sin and kv_cache dtypes must match qkv");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == T && slot_mapping.scalar_type() == at::kLong &&
                  slot_mapping.is_contiguous(),
              "rotary_and_write_kv: slot_mapping [T] int64");
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slots[t] >= -1 && slots[t] < num_slots, "rotary_and_write_kv: slot ", slots[t], " of token ", t,
                " outside the cache's ", num_slots, " slots");
  }
}

void rotary_and_write_kv_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kv_cache,
                          const at::Tensor& slot_mapping, int64_t H, int64_t KVH, int64_t D) {
  check_args(qkv, cos, sin, kv_cache, slot_mapping, H, KVH, D);
  const int64_t T = qkv.size(0), stride = qkv.stride(0);
  if (T == 0) return;
  const int64_t half = cos.size(-1), row = KVH * D;  // row: one token's k (or v) heads
  const int64_t cache_half = kv_cache.numel() / 2;   // offset of the V cache
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary_and_write_kv", [&] {
    scalar_t* base = qkv.data_ptr<scalar_t>();
    scalar_t* k_cache = kv_cache.data_ptr<scalar_t>();
    scalar_t* v_cache = k_cache + cache_half;
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    at::parallel_for(0, T, token_grain((H + 2 * KVH) * D), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        scalar_t* q = base + t * stride;
        scalar_t* k = q + H * D;
        scalar_t* v = k + row;
        // q and k heads are adjacent in qkv: one rotation loop over H + KVH heads.
        rotate_heads(q, cp + t * half, sp + t * half, H + KVH, half, D);
        if (slots[t] < 0) continue;  // padding
        // The rotated k row is still in L1: store it, and v, in the token's slot.
        std::memcpy(k_cache + slots[t] * row, k, row * sizeof(scalar_t));
        std::memcpy(v_cache + slots[t] * row, v, row * sizeof(scalar_t));
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.def(
      "rotary_and_write_kv_(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) kv_cache, Tensor slot_mapping, "
      "int num_heads, int num_kv_heads, int head_dim) -> ()");
}

TORCH_LIBRARY_IMPL(llmserve_cpu, CPU, m) { m.impl("rotary_and_write_kv_", &rotary_and_write_kv_); }
