// Products on AMX (Intel's tile matrix unit), the second engine behind our bfloat16 and
// W8A8 int8 linears (bf16_linear.cpp, int8_linear.cpp), on the same packed weights as
// their AVX-512 engines: those layouts, [N/16, K/2, 16, 2] bfloat16 and [N/16, K/4, 16, 4]
// uint8, are already AMX's B tiles (16 rows of k-pairs or k-quads x 16 output channels,
// 1 KiB of one block, contiguous).
//
// Eight tile registers, each 16 rows x 64 bytes: C[m][b] (tmm0-3) hold 16 x 16 sums for
// row tile m and block b, A[m] (tmm4-5) 16 rows of x, B[b] (tmm6-7) one block's k step.
// Each k step loads 2 A and 2 B tiles and issues 4 products, so each tile loaded feeds
// two. Products of fewer than 16 rows configure A and C tiles of that many rows; longer
// ones pad their last row tile with zero rows.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AVX512F__)
#define LLMSERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define LLMSERVE_AMX 0
#endif

namespace llmserve_amx {

// True when this build has AMX code and the kernel let this process use the tile registers
// (Linux asks each process to request them: arch_prctl ARCH_REQ_XCOMP_PERM).
// LLMSERVE_CPU_AMX=0 keeps the AVX-512 engines (to compare the two, or to rule AMX out).
inline bool usable() {
#if LLMSERVE_AMX
  static const bool granted = [] {
    const char* setting = std::getenv("LLMSERVE_CPU_AMX");
    if (setting != nullptr && std::string(setting) == "0") return false;
    constexpr long kReqXcompPerm = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kXtileData = 18;         // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return granted;
#else
  return false;
#endif
}

constexpr int64_t kRows = 16;    // rows of a full tile
constexpr int64_t kBlockN = 16;  // output channels per packed block

// Rows of the row tiles a product of M rows runs: M itself under 16, else M rounded up to 16.
inline int64_t tiled_rows(int64_t M) { return M < kRows ? M : (M + kRows - 1) / kRows * kRows; }

// bfloat16: y [M, N] = x [M, K] @ W.T, W packed [N/16, K/2, 16, 2]; x rows at stride ldx
// elements, K % 32 == 0, float32 sums rounded to bfloat16 (nearest even). Only when usable().
// silu_mul: W's blocks alternate a gated MLP's gate and up channels (N % 32 == 0), and y
// [M, N/2] takes silu(gate) * up (bf16_linear.cpp's bf16_linear_silu_mul).
void bf16_product(const uint16_t* x, int64_t ldx, const uint16_t* w, c10::BFloat16* y, int64_t M, int64_t N,
                  int64_t K, bool silu_mul = false);

// W8A8 int8: int8_linear.cpp's product from its quantized activations: xq [Mp, K] int8
// (Mp = M, or M rounded up to 16 with zero rows, when M > 16), x_scale and comp [M, K/64],
// W packed [N/16, K/4, 16, 4] (q + 128), w_scale [N]; K % 64 == 0. The same integer sums as
// VPDPBUSD's and the same float operations in the same order: bit for bit the AVX-512
// VNNI engine's result. Only when usable().
template <typename T>
void w8a8_product(const int8_t* xq, const float* x_scale, const int32_t* comp, const uint8_t* w,
                  const float* w_scale, T* y, int64_t M, int64_t N, int64_t K);

#if LLMSERVE_AMX
// The row tiles of one column pair (2 blocks, or the last lone one) of a product of M
// rows: `run.template operator()<MT, NB>(m0)` for each pair of row tiles from m0 (MT = 2),
// then a lone last one (MT = 1), NB = the pair's blocks (a lambda template).
template <class Run>
inline void for_each_row_tile(const Run& run, int64_t M, bool two_blocks) {
  const int64_t padded = tiled_rows(M);
  int64_t m0 = 0;
  for (; m0 + 2 * kRows <= padded; m0 += 2 * kRows)
    two_blocks ? run.template operator()<2, 2>(m0) : run.template operator()<2, 1>(m0);
  if (m0 < padded) two_blocks ? run.template operator()<1, 2>(m0) : run.template operator()<1, 1>(m0);
}

// The LDTILECFG operand: palette 1, every tile 64 bytes wide; B tiles 16 rows, A and C
// tiles `rows` rows (16, or M when a product has fewer).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  explicit TileConfig(int64_t a_rows) {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = 64;
      rows[t] = static_cast<uint8_t>(t >= 6 ? kRows : a_rows);
    }
  }
};

#endif

}  // namespace llmserve_amx
