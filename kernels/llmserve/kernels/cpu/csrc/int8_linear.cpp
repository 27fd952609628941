// W8A8 int8 linear for CPUs with AVX-512 VNNI: y = x @ W.T with both operands in int8.
//
//   W [N, K]  int8 per output channel: W ~= q * w_scale[:, None] (quantized at load)
//   x [M, K]  float32 or bfloat16, quantized here per row and per group of kGroup columns:
//             x[m, g*64:(g+1)*64] ~= xq * x_scale[m, g], symmetric, round to nearest even
//   y[m, n] = w_scale[n] * sum_g x_scale[m, g] * sum_{k in g} xq[m, k] * q[n, k]
//
// Why groups: one scale per whole row (per-token) lets a few outlier channels of the
// activations take the int8 range from every other channel: +3.6% perplexity on
// SmolLM2-135M, against +1.0% with groups of 64 (docs/benchmarks.md).
//
// Why VNNI: VPDPBUSD multiplies 64 uint8 x int8 pairs into 16 int32 sums per
// instruction, twice VDPBF16PS's 32 bfloat16 pairs, and int8 weights are half the bytes
// of bfloat16 ones; decode-sized GEMMs are bound by one or the other.
//
// VPDPBUSD wants one unsigned operand. The weights are stored as u = q + 128 (in
// [1, 255]) and the activations stay signed (broadcast 4 at a time), so each group sum
// is sum xq*u = sum xq*q + 128 * sum xq: the second term is subtracted per (row, group).
//
// Packed weight layout, so that each 64-byte load is 16 output channels x 4 k:
//   packed [N/16, K/4, 16, 4] uint8,  packed[b, k4, j, t] = q[16b + j, 4k4 + t] + 128
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "amx.h"
#include "gemm_tiles.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define LLMSERVE_W8A8 1
#else
#define LLMSERVE_W8A8 0
#endif

namespace {

constexpr int64_t kGroup = 64;   // activation columns per scale
constexpr int64_t kBlockN = 16;  // output channels per packed block (gemm_tiles.h)

bool w8a8_supported() { return LLMSERVE_W8A8 == 1; }

void check_shapes(int64_t N, int64_t K) {
  TORCH_CHECK(N % kBlockN == 0, "int8 W8A8: output features (", N, ") must be a multiple of ", kBlockN);
  TORCH_CHECK(K % kGroup == 0, "int8 W8A8: input features (", K, ") must be a multiple of ", kGroup);
}

at::Tensor w8a8_pack_weight(const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "int8 W8A8: weight must be 2-D int8");
  const int64_t N = q.size(0), K = q.size(1);
  check_shapes(N, K);
  const at::Tensor src = q.contiguous();
  at::Tensor packed = at::empty({N / kBlockN, K / 4, kBlockN, 4}, q.options().dtype(at::kByte));
  const int8_t* in = src.data_ptr<int8_t>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  at::parallel_for(0, N / kBlockN, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t k4 = 0; k4 < K / 4; ++k4)
        for (int64_t j = 0; j < kBlockN; ++j)
          for (int64_t t = 0; t < 4; ++t)
            out[((b * (K / 4) + k4) * kBlockN + j) * 4 + t] =
                static_cast<uint8_t>(static_cast<int>(in[(b * kBlockN + j) * K + 4 * k4 + t]) + 128);
  });
  return packed;
}

#if LLMSERVE_W8A8

// 16 columns of x as float32 (a bfloat16 widens exactly: its bits are a float's high half).
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const at::BFloat16* x) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// One group of kGroup columns: xq = round-half-even(x * 127 / amax) in [-127, 127],
// x_scale = amax / 127, comp = 128 * sum of xq. In vectors, not a scalar loop: a 16-row,
// 576-column call ~0.6 us shorter (1.3 us at 1,536 columns), results bit-identical.
template <typename T>
void quantize_group(const T* src, int8_t* dst, float* x_scale, int32_t* comp) {
  constexpr int kVecs = kGroup / 16;
  __m512 v[kVecs];
  __m512 vmax = _mm512_setzero_ps();
  for (int i = 0; i < kVecs; ++i) {
    v[i] = load16(src + 16 * i);
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v[i]));
  }
  const float amax = _mm512_reduce_max_ps(vmax);
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  __m512i sum = _mm512_setzero_si512();
  for (int i = 0; i < kVecs; ++i) {
    // cvtps rounds to nearest even (the default MXCSR mode), as std::nearbyint does
    const __m512i r = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v[i], inv)), lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16 * i), _mm512_cvtepi32_epi8(r));
    sum = _mm512_add_epi32(sum, r);
  }
  *x_scale = amax / 127.f;
  *comp = 128 * _mm512_reduce_add_epi32(sum);
}

// acc += the 16 int32 dot products of u's and x's 4-byte groups (VPDPBUSD), in place (for
// the tiles below 4 x 3; the NOTE below says why not _mm512_dpbusd_epi32).
inline void dpbusd_in_place(__m512i& acc, __m512i u, __m512i x) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(x));
}

// The full 4 x 3 tile's products over S steps of the k loop (1 or 4), in assembly:
//   dot[m][b] += sum_{j<S} VPDPBUSD(block b's line j, broadcast of row m's bytes 4j..4j+3)
// w: block b0's line at the first step, the next blocks `block_bytes` apart; x: row m0's
// 4 bytes at the first step, the next rows `row_bytes` apart.
//
// NOTE: in C++ with intrinsics GCC 12 keeps this loop's 12 sums and 3 weight vectors in
// only 16 of the 32 vector registers: it copies each sum around the intrinsic, or spills
// the weights to the stack and reloads them for every row (the GPR pressure of the
// surrounding loop decides which). Either way the tile ran at 53-71% of VPDPBUSD's peak
// with its data in L1 or L2; written out, a step is 12 products, 3 loads and 4
// broadcasts (on a Zen 5 EPYC: 92% of the peak in L1; 64-row products from L2 at 1.5-1.7
// int8 TOP/s on 2 cores, from 1.1).
//
// Scratch: zmm28-30 the step's 3 weight vectors, zmm31 the broadcast row, rax row 3's
// address (named as clobbers, not operands: the 12 sums in and out already take 24 of
// asm's 30 operands; the two "m" operands say which memory it reads, with no "memory"
// clobber, which would make GCC reload the tile's fields after every block).
#define LLMSERVE_W8A8_ROW(X, D0, D1, D2)                                                     \
  "vpbroadcastd " X ", %%zmm31\n\t"                                                           \
  "vpdpbusd %%zmm31, %%zmm28, %[" D0 "]\n\t"                                                  \
  "vpdpbusd %%zmm31, %%zmm29, %[" D1 "]\n\t"                                                  \
  "vpdpbusd %%zmm31, %%zmm30, %[" D2 "]\n\t"
#define LLMSERVE_W8A8_STEP(W, X)                                                             \
  "vmovdqu64 " W "(%[w]), %%zmm28\n\t"                                                        \
  "vmovdqu64 " W "(%[w],%[ws],1), %%zmm29\n\t"                                                \
  "vmovdqu64 " W "(%[w],%[ws],2), %%zmm30\n\t"                                                \
  LLMSERVE_W8A8_ROW(X "(%[x])", "d00", "d01", "d02")                                          \
  LLMSERVE_W8A8_ROW(X "(%[x],%[xs],1)", "d10", "d11", "d12")                                  \
  LLMSERVE_W8A8_ROW(X "(%[x],%[xs],2)", "d20", "d21", "d22")                                  \
  LLMSERVE_W8A8_ROW(X "(%%rax)", "d30", "d31", "d32")
#define LLMSERVE_W8A8_ROW3 "lea (%[x],%[xs],2), %%rax\n\tadd %[xs], %%rax\n\t"  // rax: row 3
#define LLMSERVE_W8A8_OPERANDS                                                                   \
  : [d00] "+v"(dot[0][0]), [d01] "+v"(dot[0][1]), [d02] "+v"(dot[0][2]), [d10] "+v"(dot[1][0]), \
    [d11] "+v"(dot[1][1]), [d12] "+v"(dot[1][2]), [d20] "+v"(dot[2][0]), [d21] "+v"(dot[2][1]), \
    [d22] "+v"(dot[2][2]), [d30] "+v"(dot[3][0]), [d31] "+v"(dot[3][1]), [d32] "+v"(dot[3][2])  \
  : [w] "r"(w), [ws] "r"(block_bytes), [x] "r"(x), [xs] "r"(row_bytes),                             \
    "m"(*reinterpret_cast<const char(*)[]>(w)), "m"(*reinterpret_cast<const char(*)[]>(x))         \
  : "rax", "zmm28", "zmm29", "zmm30", "zmm31"

template <int S>
inline void w8a8_tile_4x3_steps(__m512i (&dot)[4][3], const uint8_t* w, int64_t block_bytes, const int8_t* x,
                                int64_t row_bytes) {
  static_assert(S == 1 || S == 4);
  if constexpr (S == 1) {
    __asm__(LLMSERVE_W8A8_ROW3 LLMSERVE_W8A8_STEP("0", "0") LLMSERVE_W8A8_OPERANDS);
  } else {
    __asm__(LLMSERVE_W8A8_ROW3 LLMSERVE_W8A8_STEP("0", "0") LLMSERVE_W8A8_STEP("64", "4")
                LLMSERVE_W8A8_STEP("128", "8") LLMSERVE_W8A8_STEP("192", "12") LLMSERVE_W8A8_OPERANDS);
  }
}
#undef LLMSERVE_W8A8_ROW
#undef LLMSERVE_W8A8_STEP
#undef LLMSERVE_W8A8_ROW3
#undef LLMSERVE_W8A8_OPERANDS

// x [M, K] -> xq [M, K] int8, x_scale [M, G], comp [M, G] = 128 * sum of the group's xq.
template <typename T>
void quantize_activations(const T* x, int64_t M, int64_t K, int8_t* xq, float* x_scale, int32_t* comp) {
  const int64_t G = K / kGroup;
  at::parallel_for(0, M * G, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m = i / G, g = i % G;
      quantize_group(x + m * K + g * kGroup, xq + m * K + g * kGroup, x_scale + i, comp + i);
    }
  });
}

// One tile: y[m0:m0+MT, 16*b0 : 16*(b0+NB)].
template <typename T>
struct W8A8Tile {
  const int8_t* xq;
  const float* x_scale;
  const int32_t* comp;
  const uint8_t* w;
  const float* w_scale;
  T* y;
  int64_t N, K;

  const char* block(int64_t b) const { return reinterpret_cast<const char*>(w + b * K * kBlockN); }
  int64_t block_bytes() const { return K * kBlockN; }

  static constexpr int kRowTile = 4;  // 12 integer sums in registers, 12 float sums in L1 (run())
  static constexpr int kLonePrefetchRows = 1;

  template <int MT, int NB, int C>
  void run(int64_t m0, int64_t b0, llmserve_tiles::NextTile next) const {
    const int64_t G = K / kGroup, K4 = K / 4;
    // The float sums live in L1, not registers: touched once per group, they would hold 12
    // of the 32 vector registers beside the group's 12 integer sums (4-row products from
    // L2 ran 1.2x faster so; 16-256 rows the same).
    alignas(64) float acc[MT][NB][kBlockN] = {};
    for (int64_t g = 0; g < G; ++g) {
      __m512i dot[MT][NB];
      for (int m = 0; m < MT; ++m)
        for (int b = 0; b < NB; ++b) dot[m][b] = _mm512_setzero_si512();
      if constexpr (MT == 4 && NB == 3) {
        constexpr int S = C == llmserve_tiles::kEveryStep ? 1 : 4;  // kGroup / 4 steps: a multiple of 4
        for (int64_t k4 = g * (kGroup / 4); k4 < (g + 1) * (kGroup / 4); k4 += S) {
          if constexpr (C != llmserve_tiles::kNever) next.issue();
          w8a8_tile_4x3_steps<S>(dot, w + (b0 * K4 + k4) * 64, K4 * 64, xq + m0 * K + 4 * k4, K);
        }
      } else {
        for (int64_t k4 = g * (kGroup / 4); k4 < (g + 1) * (kGroup / 4); ++k4) {
          if (llmserve_tiles::issues_at<C>(k4)) next.issue();
          __m512i wv[NB];
          for (int b = 0; b < NB; ++b) wv[b] = _mm512_loadu_si512(w + ((b0 + b) * K4 + k4) * 64);
          for (int m = 0; m < MT; ++m) {
            int32_t four;
            std::memcpy(&four, xq + (m0 + m) * K + 4 * k4, 4);
            const __m512i xv = _mm512_set1_epi32(four);
            for (int b = 0; b < NB; ++b) dpbusd_in_place(dot[m][b], wv[b], xv);
          }
        }
      }
      for (int m = 0; m < MT; ++m) {
        const __m512i c = _mm512_set1_epi32(comp[(m0 + m) * G + g]);
        const __m512 s = _mm512_set1_ps(x_scale[(m0 + m) * G + g]);
        for (int b = 0; b < NB; ++b)
          _mm512_store_ps(acc[m][b], _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[m][b], c)), s,
                                                     _mm512_load_ps(acc[m][b])));
      }
    }
    for (int b = 0; b < NB; ++b) {
      const __m512 ws = _mm512_loadu_ps(w_scale + (b0 + b) * kBlockN);
      for (int m = 0; m < MT; ++m)
        llmserve_tiles::store_row(y + (m0 + m) * N + (b0 + b) * kBlockN, _mm512_mul_ps(_mm512_load_ps(acc[m][b]), ws));
    }
  }
};

template <typename T>
void w8a8_gemm(const T* x, const uint8_t* w, const float* w_scale, T* y, int64_t M, int64_t N, int64_t K, bool amx) {
  const int64_t G = K / kGroup;
  // AMX reads whole 16-row tiles beyond 16 rows: there xq has zero rows up to a multiple of 16.
  std::vector<int8_t> xq((amx ? llmserve_amx::tiled_rows(M) : M) * K);
  std::vector<float> x_scale(M * G);
  std::vector<int32_t> comp(M * G);
  quantize_activations(x, M, K, xq.data(), x_scale.data(), comp.data());
  if (amx) {
    llmserve_amx::w8a8_product(xq.data(), x_scale.data(), comp.data(), w, w_scale, y, M, N, K);
  } else {
    llmserve_tiles::for_each_tile(W8A8Tile<T>{xq.data(), x_scale.data(), comp.data(), w, w_scale, y, N, K}, M, N,
                                  K);
  }
}

#endif  // LLMSERVE_W8A8

// Which engine multiplies (w8a8_linear's `engine` argument): AMX where the CPU has it,
// else AVX-512 VNNI registers; or one of them by name, for benchmarks and tests. Both give
// the same bits (amx_int8.cpp), so the choice changes speed only.
enum Engine : int64_t { kAuto = 0, kVnni = 1, kAmx = 2 };

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& w_scale, int64_t engine) {
  TORCH_CHECK(w8a8_supported(), "int8 W8A8: this build has no AVX-512 VNNI");
  TORCH_CHECK(x.dim() == 2, "int8 W8A8: x must be [rows, in]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "int8 W8A8: x must be float32 or bfloat16");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.size(2) == kBlockN &&
                  packed.size(3) == 4 && packed.is_contiguous(),
              "int8 W8A8: weight must come from w8a8_pack_weight");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * kBlockN;
  TORCH_CHECK(packed.size(1) * 4 == K, "int8 W8A8: x has ", K, " features, the weight ", packed.size(1) * 4);
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.numel() == N && w_scale.is_contiguous(),
              "int8 W8A8: w_scale must be float32 [", N, "]");
  check_shapes(N, K);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  TORCH_CHECK(engine != kAmx || llmserve_amx::usable(), "int8 W8A8: AMX is not usable here");
  const bool amx = engine == kAmx || (engine == kAuto && llmserve_amx::usable());
#if LLMSERVE_W8A8
  if (x.scalar_type() == at::kFloat) {
    w8a8_gemm(xc.data_ptr<float>(), packed.data_ptr<uint8_t>(), w_scale.data_ptr<float>(), y.data_ptr<float>(), M, N,
              K, amx);
  } else {
    w8a8_gemm(xc.data_ptr<at::BFloat16>(), packed.data_ptr<uint8_t>(), w_scale.data_ptr<float>(),
              y.data_ptr<at::BFloat16>(), M, N, K, amx);
  }
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.def("w8a8_supported() -> bool", &w8a8_supported);  // no tensor to dispatch on
  m.def("w8a8_pack_weight(Tensor q) -> Tensor");
  m.def("w8a8_linear(Tensor x, Tensor packed, Tensor w_scale, int engine=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve_cpu, CPU, m) {
  m.impl("w8a8_pack_weight", &w8a8_pack_weight);
  m.impl("w8a8_linear", &w8a8_linear);
}
