// bfloat16 linear for CPUs with AVX-512 BF16: y = x @ W.T, x [M, K] and W [N, K] bfloat16,
// products exact in float32 and summed there (VDPBF16PS: 16 lanes x 2 bf16 pairs per
// instruction), y rounded to bfloat16.
//
// Why ours beside oneDNN's bfloat16 GEMM: at decode sizes oneDNN spends ~20 us per call
// before its first product, and a decode step makes 4 per layer; this kernel starts at
// once and keeps its 8 x 48 output tile in registers (gemm_tiles.h). Measured on a 2-core
// AMD EPYC (family 26, Zen 5; `bench gemm`, SmolLM2-135M's shapes, weights from memory):
// 1.1-1.9x oneDNN's speed at 1-4 rows, 1.1-1.5x at 64; with the weights in L2, 1.02x
// at 512 rows. The worker still times both once per machine and build and takes the
// faster (packed_weight.py).
//
// Packed weight layout, so that each 64-byte load is 16 output channels x 2 k:
//   packed [N/16, K/2, 16, 2] bfloat16,  packed[b, k2, j, t] = W[16b + j, 2k2 + t]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "amx.h"
#include "gemm_tiles.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define LLMSERVE_BF16_TILES 1
#else
#define LLMSERVE_BF16_TILES 0
#endif

namespace {

constexpr int64_t kBlockN = 16;  // output channels per packed block (gemm_tiles.h)

bool bf16_tiles_supported() { return LLMSERVE_BF16_TILES == 1; }

bool amx_supported() { return llmserve_amx::usable(); }

// Which engine multiplies (bf16_linear's `engine` argument): AMX where it can, else the
// AVX-512 BF16 register tiles; or one of them by name, for benchmarks and tests.
// NOTE: AMX at every row count, although at 1-2 rows the register tiles are as fast: the
// two engines round differently (~0.1% of outputs differ by a bfloat16 ulp), and one
// engine per weight keeps a sequence's logits independent of how many rows share its
// step (bf16_product sums each row alone).
enum Engine : int64_t { kAuto = 0, kAvx512 = 1, kAmx = 2 };

void check_shapes(int64_t N, int64_t K) {
  TORCH_CHECK(N % kBlockN == 0, "bf16 tiles: output features (", N, ") must be a multiple of ", kBlockN);
  TORCH_CHECK(K % 2 == 0, "bf16 tiles: input features (", K, ") must be even");
}

at::Tensor bf16_pack_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "bf16 tiles: weight must be 2-D bfloat16");
  const int64_t N = w.size(0), K = w.size(1);
  check_shapes(N, K);
  const at::Tensor src = w.contiguous();
  at::Tensor packed = at::empty({N / kBlockN, K / 2, kBlockN, 2}, w.options());
  // 16-bit words: the layout moves whole values, no arithmetic.
  const uint16_t* in = reinterpret_cast<const uint16_t*>(src.data_ptr<at::BFloat16>());
  uint16_t* out = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, N / kBlockN, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t k2 = 0; k2 < K / 2; ++k2)
        for (int64_t j = 0; j < kBlockN; ++j)
          for (int64_t t = 0; t < 2; ++t)
            out[((b * (K / 2) + k2) * kBlockN + j) * 2 + t] = in[(b * kBlockN + j) * K + 2 * k2 + t];
  });
  return packed;
}

#if LLMSERVE_BF16_TILES
// One tile: y[m0:m0+MT, 16*b0 : 16*(b0+NB)].
struct Bf16Tile {
  const uint16_t* x;
  const uint16_t* w;
  c10::BFloat16* y;
  int64_t N, K;

  const char* block(int64_t b) const { return reinterpret_cast<const char*>(w + b * K * kBlockN); }
  int64_t block_bytes() const { return K * kBlockN * 2; }

  // 8 rows a tile, not 4: 3 weight loads and 8 broadcasts feed 24 products a step instead
  // of 3 and 4 feeding 12 (64-row products from L2 ~885 -> ~975 GFLOP/s, 2 threads).
  static constexpr int kRowTile = 8;
  static constexpr int kLonePrefetchRows = 2;

  template <int MT, int NB, int C>
  void run(int64_t m0, int64_t b0, llmserve_tiles::NextTile next) const {
    const int64_t K2 = K / 2;
    __m512 acc[MT][NB];
    for (int m = 0; m < MT; ++m)
      for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
    for (int64_t k2 = 0; k2 < K2; ++k2) {
      if (llmserve_tiles::issues_at<C>(k2)) next.issue();
      __m512i wv[NB];
      for (int b = 0; b < NB; ++b) wv[b] = _mm512_loadu_si512(w + ((b0 + b) * K2 + k2) * 2 * kBlockN);
      for (int m = 0; m < MT; ++m) {
        int32_t pair;  // x[m, 2k2 : 2k2 + 2], broadcast to every lane
        std::memcpy(&pair, x + (m0 + m) * K + 2 * k2, 4);
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
        for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], (__m512bh)wv[b], xv);
      }
    }
    for (int b = 0; b < NB; ++b)
      for (int m = 0; m < MT; ++m) llmserve_tiles::store_row(y + (m0 + m) * N + (b0 + b) * kBlockN, acc[m][b]);
  }
};
#endif

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t engine) {
  TORCH_CHECK(bf16_tiles_supported(), "bf16 tiles: this build has no AVX-512 BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "bf16 tiles: x must be [rows, in] bfloat16");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.size(2) == kBlockN &&
                  packed.size(3) == 2 && packed.is_contiguous(),
              "bf16 tiles: weight must come from bf16_pack_weight");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * kBlockN;
  TORCH_CHECK(packed.size(1) * 2 == K, "bf16 tiles: x has ", K, " features, the weight ", packed.size(1) * 2);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const bool amx_fits = llmserve_amx::usable() && K % 32 == 0;
  TORCH_CHECK(engine != kAmx || amx_fits, "bf16 tiles: AMX is not usable here, or ", K,
              " features are not a multiple of 32");
  if (engine == kAmx || (engine == kAuto && amx_fits)) {
    llmserve_amx::bf16_product(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), K,
                               reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()),
                               y.data_ptr<at::BFloat16>(), M, N, K);
    return y;
  }
#if LLMSERVE_BF16_TILES
  llmserve_tiles::for_each_tile(
      Bf16Tile{reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()),
               reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), y.data_ptr<at::BFloat16>(), N, K},
      M, N, K);
#endif
  return y;
}

// A gated MLP's first half on AMX: y [M, d] = silu(x @ G.T) * (x @ U.T), with the
// merged [G; U] weight [2d, K] packed by bf16_pack_weight and its blocks then interleaved
// (block 2j: G's block j, 2j + 1: U's; kernels/cpu's interleave_gate_up_blocks), so that
// each column pair's two C tiles are one gate block and its up block. Bit for bit
// silu_and_mul(bf16_linear(x, the plain packing)): the same sums, the same roundings,
// without the [M, 2d] intermediate and the pass over it.
at::Tensor bf16_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "bf16 silu_mul: x must be [rows, in] bfloat16");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.size(0) % 2 == 0 &&
                  packed.size(2) == kBlockN && packed.size(3) == 2 && packed.is_contiguous(),
              "bf16 silu_mul: weight must be a bf16_pack_weight layout of an even number of blocks");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * kBlockN;
  TORCH_CHECK(packed.size(1) * 2 == K, "bf16 silu_mul: x has ", K, " features, the weight ", packed.size(1) * 2);
  TORCH_CHECK(llmserve_amx::usable() && K % 32 == 0, "bf16 silu_mul: AMX is not usable here, or ", K,
              " features are not a multiple of 32");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N / 2}, x.options());
  if (M == 0) return y;
  llmserve_amx::bf16_product(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), K,
                             reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()),
                             y.data_ptr<at::BFloat16>(), M, N, K, /*silu_mul=*/true);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.def("bf16_tiles_supported() -> bool", &bf16_tiles_supported);  // no tensor to dispatch on
  m.def("bf16_pack_weight(Tensor w) -> Tensor");
  m.def("amx_supported() -> bool", &amx_supported);  // (both engines' AMX: this file and int8_linear.cpp)
  m.def("bf16_linear(Tensor x, Tensor packed, int engine=0) -> Tensor");
  m.def("bf16_linear_silu_mul(Tensor x, Tensor packed) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve_cpu, CPU, m) {
  m.impl("bf16_pack_weight", &bf16_pack_weight);
  m.impl("bf16_linear", &bf16_linear);
  m.impl("bf16_linear_silu_mul", &bf16_linear_silu_mul);
}
