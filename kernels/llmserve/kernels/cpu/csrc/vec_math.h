// Vector math on 16 float32 lanes (AVX-512) shared by our CPU kernels.
#pragma once

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

// float32 -> bfloat16, round to nearest even (as torch's .to(bfloat16)): 16 bfloat16 bits.
inline __m256i to_bf16(__m512 v) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16));
#endif
}

// float32 -> bfloat16 -> float32: round to nearest even, as torch's .to(bfloat16).
inline __m512 round_to_bf16(__m512 v) {
#if defined(__AVX512BF16__)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
#endif
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

}  // namespace llmserve_vec
#endif
