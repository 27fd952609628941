// NeoX rotate-half rotary on one token's heads, in place, shared by rotary_and_write_kv_
// (rotary_kv_write.cpp) and rotary_neox_ (elementwise.cpp):
//   [x1 | x2 | x_pass] -> [x1 cos - x2 sin | x2 cos + x1 sin | x_pass]   (x1, x2: `half` dims)
// Arithmetic follows the torch reference (apply_rotary) op by op: float32 matches it bit
// for bit, and bfloat16 rounds each product to bfloat16 as torch materialises it.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#include "vec_math.h"

// NOTE: the kernels build with -ffast-math, which lets GCC fuse x1*cos - x2*sin into an FMA;
// torch rounds each product separately, and exact float32 equality needs the same.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace llmserve_rotary {

using llmserve_vec::round_to;

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

#if defined(__AVX512F__)
// bfloat16: c10's scalar float -> bfloat16 rounding does not vectorise (~4x slower at a
// decode batch of 16, ~15x at a 512-token chunk); vec_math.h's rounds 16 lanes at once
// (its note: denormals).
template <>
inline int64_t rotate_vectors<c10::BFloat16>(c10::BFloat16* x1, c10::BFloat16* x2, const c10::BFloat16* c,
                                             const c10::BFloat16* s, int64_t half) {
  using namespace llmserve_vec;
  const int64_t n = half - half % 16;
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 a = load_bf16(x1 + i), b = load_bf16(x2 + i), ci = load_bf16(c + i), si = load_bf16(s + i);
    // (each product rounded as torch materialises it; the stores round the sums)
    store_bf16(x1 + i, _mm512_sub_ps(round_bf16(_mm512_mul_ps(a, ci)), round_bf16(_mm512_mul_ps(b, si))));
    store_bf16(x2 + i, _mm512_add_ps(round_bf16(_mm512_mul_ps(b, ci)), round_bf16(_mm512_mul_ps(a, si))));
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

}  // namespace llmserve_rotary

#pragma GCC pop_options
