// float32 linear for CPUs with AVX-512 F: y = x @ W.T, x [M, K] and W [N, K] float32,
// each output a sum over k in order (one FMA per k: VFMADD231PS, 16 output channels a
// lane each), so a row's result does not depend on how many rows share the call.
//
// Why ours beside MKL's and oneDNN's packed float32 GEMMs: at decode row counts their
// products read the weights at 51-79% (MKL) and 43-89% (oneDNN) of the memory bandwidth
// at 4-16 rows on the 2-core Intel Xeon (AMX host), and both keep opaque layouts that
// cannot move to huge pages; this kernel uses the register tiles and next-tile prefetches
// of the bfloat16 one (gemm_tiles.h) and a layout of our own. The worker times it
// against both once per machine and build and takes the fastest (packed_weight.py).
//
// Packed weight layout, so that each 64-byte load is 16 output channels at one k:
//   packed [N/16, K, 16] float32,  packed[b, k, j] = W[16b + j, k]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "gemm_tiles.h"

namespace {

constexpr int64_t kBlockN = 16;  // output channels per packed block (gemm_tiles.h)

bool f32_tiles_supported() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

at::Tensor f32_pack_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "f32 tiles: weight must be 2-D float32");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % kBlockN == 0, "f32 tiles: output features (", N, ") must be a multiple of ", kBlockN);
  // [N/16, 16, K] -> [N/16, K, 16]: a transpose of each block of 16 rows.
  return w.contiguous().view({N / kBlockN, kBlockN, K}).transpose(1, 2).contiguous();
}

#if defined(__AVX512F__)
// One tile: y[m0:m0+MT, 16*b0 : 16*(b0+NB)] over depths [k0, k0 + Kc) of the K (a slice of
// the product's depth; `accumulate`: added to what y holds from the slices before).
struct F32Tile {
  const float* x;
  const float* w;
  float* y;
  int64_t N, K, k0, Kc;
  bool accumulate;

  const char* block(int64_t b) const { return reinterpret_cast<const char*>(w + (b * K + k0) * kBlockN); }
  int64_t block_bytes() const { return Kc * kBlockN * 4; }

  // 8 rows x 3 blocks: 24 sums, 3 weight vectors and a broadcast row in 28 of the 32
  // registers (the bfloat16 tile's shape: gemm_tiles.h).
  static constexpr int kRowTile = 8;
  static constexpr int kLonePrefetchRows = 2;

  template <int MT, int NB, int C>
  void run(int64_t m0, int64_t b0, llmserve_tiles::NextTile next) const {
    __m512 acc[MT][NB];
    for (int m = 0; m < MT; ++m)
      for (int b = 0; b < NB; ++b)
        acc[m][b] = accumulate ? _mm512_loadu_ps(y + (m0 + m) * N + (b0 + b) * kBlockN) : _mm512_setzero_ps();
    // NOTE: a base pointer per row and per block, stepped once per 4 depths, so that each
    // load is a base plus a constant: indexed from x and w afresh, each depth took ~25
    // address instructions (some reloading spilled indices) beside its 11 loads and 24
    // FMAs, and 16-512-row products ran 1.04-1.16x slower (the two taking turns in one
    // process, SmolLM2-135M's shapes, the 2-core Intel Xeon (AMX host)).
    const float* xr[MT];
    for (int m = 0; m < MT; ++m) xr[m] = x + (m0 + m) * K + k0;
    const float* wb[NB];
    for (int b = 0; b < NB; ++b) wb[b] = w + ((b0 + b) * K + k0) * kBlockN;
    auto depth = [&](int i) __attribute__((always_inline)) {
      __m512 wv[NB];
      for (int b = 0; b < NB; ++b) wv[b] = _mm512_loadu_ps(wb[b] + i * kBlockN);
      for (int m = 0; m < MT; ++m) {
        const __m512 xv = _mm512_set1_ps(xr[m][i]);
        for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_fmadd_ps(wv[b], xv, acc[m][b]);
      }
    };
    int64_t k = 0;
    for (; k + 4 <= Kc; k += 4) {
      // (cadence: every 4th depth is the first of each group of 4; spelled out, as a loop over
      // i with issues_at<C>(i) the products ran 0.86-0.95x, same bits)
      if constexpr (C == llmserve_tiles::kEveryStep) {
        next.issue(); depth(0); next.issue(); depth(1); next.issue(); depth(2); next.issue(); depth(3);
      } else {
        if constexpr (C == llmserve_tiles::kEvery4thStep) next.issue();
        depth(0); depth(1); depth(2); depth(3);
      }
      for (int m = 0; m < MT; ++m) xr[m] += 4;
      for (int b = 0; b < NB; ++b) wb[b] += 4 * kBlockN;
    }
    for (; k < Kc; ++k) {
      if (llmserve_tiles::issues_at<C>(k)) next.issue();
      depth(0);
      for (int m = 0; m < MT; ++m) xr[m] += 1;
      for (int b = 0; b < NB; ++b) wb[b] += kBlockN;
    }
    for (int b = 0; b < NB; ++b)
      for (int m = 0; m < MT; ++m) llmserve_tiles::store_row(y + (m0 + m) * N + (b0 + b) * kBlockN, acc[m][b]);
  }
};

// Depth per slice when several row tiles share a column tile: its weights, 48 channels x
// 1,024 x 4 bytes = 192 KiB, stay in L2 for the row tiles after the first. Unsliced, a
// column tile of depth 8,192 (1.5 MiB) spilled, and Llama-1B's down projection (2048 x
// 8192) at 16-64 rows ran 1.4x slower than MKL's on the 2-core Intel Xeon (AMX host).
// NOTE: a row's sums run over k in the same order either way (y holds the float32 sum
// between slices): the same bits at every row count.
constexpr int64_t kDepthSlice = 1024;
#endif

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(f32_tiles_supported(), "f32 tiles: this build has no AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "f32 tiles: x must be [rows, in] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.size(2) == kBlockN &&
                  packed.is_contiguous(),
              "f32 tiles: weight must come from f32_pack_weight");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * kBlockN;
  TORCH_CHECK(packed.size(1) == K, "f32 tiles: x has ", K, " features, the weight ", packed.size(1));
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
#if defined(__AVX512F__)
  const int64_t slice = M > F32Tile::kRowTile ? kDepthSlice : K;
  for (int64_t k0 = 0; k0 < K; k0 += slice) {
    const int64_t Kc = std::min(slice, K - k0);
    llmserve_tiles::for_each_tile(
        F32Tile{xc.data_ptr<float>(), packed.data_ptr<float>(), y.data_ptr<float>(), N, K, k0, Kc, k0 > 0}, M, N, Kc);
  }
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.def("f32_tiles_supported() -> bool", &f32_tiles_supported);  // no tensor to dispatch on
  m.def("f32_pack_weight(Tensor w) -> Tensor");
  m.def("f32_linear(Tensor x, Tensor packed) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve_cpu, CPU, m) {
  m.impl("f32_pack_weight", &f32_pack_weight);
  m.impl("f32_linear", &f32_linear);
}
