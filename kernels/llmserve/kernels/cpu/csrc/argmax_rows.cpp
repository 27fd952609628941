// Greedy sampling's argmax on CPU: each row's first largest value.
//
//   x   [S, V] float32 or bfloat16, rows contiguous (the step's logits)
//   out [S] int64: the smallest index i with x[r, i] == max(x[r, :])
//
// bfloat16 rows are compared as the float32 values they widen to (exactly, and in the
// same order): the sampler's greedy-only steps skip the [S, V] float32 copy of bfloat16
// logits (64 x 49,152: a 12 MB write, ~0.7 ms on the host below).
//
// Why: torch's max(dim=-1) read 64 x 49,152 float32 logits in ~0.77 ms on a 2-core AMD
// EPYC (family 26), ~3% of a batch-64 bfloat16 decode step of SmolLM2-135M. Here one pass
// per row keeps, per vector lane, the largest value seen and where (a strict > keeps the
// first), then picks among the lanes holding the row's max the smallest index. Rows run
// in parallel (one row of a large vocabulary is several us of work, more than a fork).
// NaN logits (a broken model) give an unspecified index, as under -ffast-math anywhere.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cstdint>

namespace {

#if defined(__AVX512F__)
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }

// 16 bfloat16 -> float32: each value's 16 bits become the high half of its float.
inline __m512 load16(const at::BFloat16* x) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Per-lane running max over the vectors at x + 16 * (lane0 + kChains * j): strict > keeps
// each lane's first index.
template <typename T>
struct LaneMax {
  __m512 value;
  __m512i index;

  void start(const T* x, int64_t at) {
    value = load16(x + at);
    index = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(at)),
                             _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  }
  void take(const T* x, int64_t at) {
    const __m512 v = load16(x + at);
    const __mmask16 greater = _mm512_cmp_ps_mask(v, value, _CMP_GT_OQ);
    value = _mm512_mask_blend_ps(greater, value, v);
    index = _mm512_mask_blend_epi32(greater, index, _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(at)),
                                                                     _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                                                                       10, 11, 12, 13, 14, 15)));
  }
};

// Chains of compare-and-blend in flight at once: one chain waits on its previous blend
// (~5 cycles a vector); four keep the loads streaming (64 x 49,152: 0.20 -> 0.06 ms).
constexpr int64_t kChains = 4;
#endif

template <typename T>
int64_t argmax_row(const T* x, int64_t V) {
  int64_t i = 0, best = 0;
  float best_value = static_cast<float>(x[0]);
#if defined(__AVX512F__)
  if (V >= 16 * kChains) {
    LaneMax<T> chains[kChains];
    for (int64_t c = 0; c < kChains; ++c) chains[c].start(x, 16 * c);
    for (i = 16 * kChains; i + 16 * kChains <= V; i += 16 * kChains)
      for (int64_t c = 0; c < kChains; ++c) chains[c].take(x, i + 16 * c);
    alignas(64) float values[16];
    alignas(64) int32_t indices[16];
    best_value = static_cast<float>(x[0]);
    for (int64_t c = 0; c < kChains; ++c) {
      _mm512_store_ps(values, chains[c].value);
      _mm512_store_si512(indices, chains[c].index);
      for (int lane = 0; lane < 16; ++lane)
        if (values[lane] > best_value || (values[lane] == best_value && indices[lane] < best))
          best_value = values[lane], best = indices[lane];
    }
  }
#endif
  for (; i < V; ++i)  // the tail past the last full round of vectors (all of a row without AVX-512)
    if (static_cast<float>(x[i]) > best_value) best_value = static_cast<float>(x[i]), best = i;
  return best;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.stride(1) == 1 && x.size(1) > 0,
              "argmax_rows: x must be [rows, V > 0] float32 or bfloat16 with contiguous rows");
  TORCH_CHECK(x.size(1) < (int64_t{1} << 31), "argmax_rows: V must fit int32");
  const int64_t S = x.size(0), V = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({S}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  auto rows = [&](const auto* in) {
    at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(in + r * stride, V);
    });
  };
  if (x.scalar_type() == at::kFloat) {
    rows(x.data_ptr<float>());
  } else {
    rows(x.data_ptr<at::BFloat16>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve_cpu, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
}
