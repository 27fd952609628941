// Vector math on 16 float32 lanes (AVX-512) for our CPU kernels, and the one scalar
// rounding their tails and fallbacks share.
#pragma once

namespace llmserve_vec {

// v rounded to T and back, as torch materialises an intermediate of dtype T (identity for float).
template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

}  // namespace llmserve_vec

#if defined(__AVX512F__)
#include <immintrin.h>

namespace llmserve_vec {

// exp(x), relative error ~2e-7 (as std::exp within a few ulps): 2^n * e^f, n = round(x /
// ln 2), f in [-ln2/2, ln2/2] by a degree-6 polynomial. x is clamped to [-87, 88]: below,
// ~0 (and -inf gives 0); above, float's largest powers of 2.
inline __m512 exp(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), f);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// silu(g) = g / (1 + e^-g) (exp's clamp: silu(-100) is -6e-37 where torch gives -0, and
// silu(-inf) is -inf where torch gives NaN).
inline __m512 silu(__m512 g) {
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}

// Float lanes rounded to bfloat16 (nearest even, as c10::BFloat16 converts; a NaN stays a
// NaN). With AVX-512 BF16, VCVTNEPS2BF16 does it in one instruction, but flushes float32
// denormals (< 1.2e-38) to zero where c10 keeps them; without, integer arithmetic on
// the bits (~7 instructions a vector: what made a bfloat16 RMSNorm compute-bound at ~1
// element a cycle).
inline __m256i narrow_bf16(__m512 x) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(x);
#else
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  // A NaN keeps its top bits, made quiet (rounding up could carry it into infinity).
  const __m512i nan = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), rounded, nan));
#endif
}

// 16 bfloat16 values widened to float (exact).
inline __m512 widen_bf16(__m256i half) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16)); }

// x rounded to bfloat16 and back: what `static_cast<float>(static_cast<c10::BFloat16>(x))` gives.
inline __m512 round_bf16(__m512 x) { return widen_bf16(narrow_bf16(x)); }

inline __m512 load_bf16(const void* p) { return widen_bf16(_mm256_loadu_si256(static_cast<const __m256i*>(p))); }
inline void store_bf16(void* p, __m512 x) { _mm256_storeu_si256(static_cast<__m256i*>(p), narrow_bf16(x)); }

}  // namespace llmserve_vec
#endif
