// Rotary embedding fused with the paged KV-cache write on CPU: one pass over each
// token's q, k and v heads instead of rotate q, rotate k, then two index_copy_ into the cache.
//
//   rotary_and_write_kv_(qkv [T, (H + 2*KVH) * D], cos, sin [T, (1,) R/2],
//                        kv_cache [2, NB, BS, KVH, D], slot_mapping [T] int64, H, KVH, D)
//
// In place on qkv: the first R dims of every q and k head rotate, NeoX rotate-half style,
//   [x1 | x2 | x_pass] -> [x1 cos - x2 sin | x2 cos + x1 sin | x_pass]   (x1, x2: R/2 dims)
// and the rotated k row and the v row of token t are stored at flat slot slot_mapping[t]
// of kv_cache[0] and kv_cache[1]; slot -1 stores nothing (a padding token: the CUDA-graph
// decode path pads its batch so). R < D is partial rotary (Phi-3/4).
//
// Arithmetic follows the torch reference (apply_rotary, then index_copy_) op by op:
// float32 matches it bit for bit, and bfloat16 rounds each product to bfloat16 as torch
// materialises it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#endif

// NOTE: the kernels build with -ffast-math, which lets GCC fuse x1*cos - x2*sin into an FMA;
// torch rounds each product separately, and exact float32 equality needs the same.
#pragma GCC optimize("fp-contract=off")

namespace {

template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// Tokens per task: a decode batch stays on one thread, where a fork costs more than the work.
inline int64_t token_grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

// Lanes [from, to) of one head's halves x1, x2, rotated in place.
template <typename T>
inline void rotate_lanes(T* x1, T* x2, const T* c, const T* s, int64_t from, int64_t to) {
  for (int64_t i = from; i < to; ++i) {
    const float a = static_cast<float>(x1[i]), b = static_cast<float>(x2[i]);
    const float ci = static_cast<float>(c[i]), si = static_cast<float>(s[i]);
    x1[i] = static_cast<T>(round_to<T>(a * ci) - round_to<T>(b * si));
    x2[i] = static_cast<T>(round_to<T>(b * ci) + round_to<T>(a * si));
  }
}

// The leading lanes of a head rotated 16 at a time; returns how many (0: none, the
// compiler vectorises the float32 lanes loop itself).
template <typename T>
inline int64_t rotate_vectors(T*, T*, const T*, const T*, int64_t) {
  return 0;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
// bfloat16: c10's scalar float -> bfloat16 rounding does not vectorise (~4x slower at a
// decode batch of 16). Widening is exact; VCVTNEPS2BF16 rounds to nearest even as c10
// does (it flushes float32 denormals, < 1.2e-38, to zero: c10 keeps them).
inline __m512 widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
inline __m256i narrow(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
inline __m512 load_bf16(const c10::BFloat16* p) {
  return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void store_bf16(c10::BFloat16* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow(v)); }
inline __m512 rounded(__m512 v) { return widen(narrow(v)); }  // as torch materialises a bfloat16 product

template <>
inline int64_t rotate_vectors<c10::BFloat16>(c10::BFloat16* x1, c10::BFloat16* x2, const c10::BFloat16* c,
                                             const c10::BFloat16* s, int64_t half) {
  const int64_t n = half - half % 16;
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 a = load_bf16(x1 + i), b = load_bf16(x2 + i), ci = load_bf16(c + i), si = load_bf16(s + i);
    store_bf16(x1 + i, _mm512_sub_ps(rounded(_mm512_mul_ps(a, ci)), rounded(_mm512_mul_ps(b, si))));
    store_bf16(x2 + i, _mm512_add_ps(rounded(_mm512_mul_ps(b, ci)), rounded(_mm512_mul_ps(a, si))));
  }
  return n;
}
#endif

// Rotates the first 2*half dims of `heads` consecutive heads of D dims each, in place.
template <typename T>
inline void rotate_heads(T* x, const T* c, const T* s, int64_t heads, int64_t half, int64_t D) {
  for (int64_t h = 0; h < heads; ++h) {
    T* x1 = x + h * D;
    T* x2 = x1 + half;
    rotate_lanes(x1, x2, c, s, rotate_vectors(x1, x2, c, s, half), half);
  }
}

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
