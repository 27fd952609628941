// W8A8 int8 products on AMX tiles (amx.h says what, why and how the tiles are used):
// TDPBSUD, 16 x 16 x 64 products of signed activations and unsigned (q + 128) weights a
// tile step, which is exactly one activation group of int8_linear.cpp's 64 columns.
//
// A group's integer sums leave the tiles after every group, because each group has its
// own scale per row: y[m, n] = w_scale[n] * sum_g x_scale[m, g] * (dot_g[m, n] - comp[m, g]),
// the float sums kept in L1 and updated as int8_linear.cpp's W8A8Tile updates them (the
// same operations in the same order, so both engines give the same bits).
#include "amx.h"
#include "shared_pieces.h"

#if LLMSERVE_AMX
#include "gemm_tiles.h"
#endif

namespace llmserve_amx {

#if LLMSERVE_AMX
namespace {

constexpr int64_t kGroup = 64;  // activation columns per scale: one A tile row

template <typename T>
struct W8A8Product {
  const int8_t* xq;  // [Mp, K]
  const float* x_scale;
  const int32_t* comp;
  const uint8_t* w;  // [N/16, K/4, 16, 4]
  const float* w_scale;
  T* y;  // [M, N]
  int64_t M, N, K;

  // Block b's group g: 16 rows of 4 k x 16 channels, 1 KiB.
  const uint8_t* b(int64_t block, int64_t g) const { return w + block * K * kBlockN + g * kGroup * kBlockN; }
  const int8_t* a(int64_t m0, int64_t g) const { return xq + m0 * K + g * kGroup; }

  // y[m0 : m0 + 16 MT, 16 b0 : 16 (b0 + NB)]. dots: 4 x 16 x 16 int32, acc: MT x NB x 16 x 16
  // float scratch; `next_blocks` blocks from block `next_b0` prefetched into L2 as it goes.
  template <int MT, int NB>
  void tile(int64_t m0, int64_t b0, int32_t* dots, float* acc, int64_t next_b0, int64_t next_blocks) const {
    const int64_t G = K / kGroup;
    std::fill(acc, acc + MT * NB * kRows * kBlockN, 0.f);
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t nb = 0; nb < next_blocks; ++nb)
        for (int64_t line = 0; line < 16; ++line)
          _mm_prefetch(reinterpret_cast<const char*>(b(next_b0 + nb, g)) + 64 * line, _MM_HINT_T1);
      _tile_zero(0);
      if constexpr (NB > 1) _tile_zero(1);
      if constexpr (MT > 1) _tile_zero(2);
      if constexpr (MT > 1 && NB > 1) _tile_zero(3);
      _tile_loadd(6, b(b0, g), 64);
      if constexpr (NB > 1) _tile_loadd(7, b(b0 + 1, g), 64);
      _tile_loadd(4, a(m0, g), K);
      _tile_dpbsud(0, 4, 6);
      if constexpr (NB > 1) _tile_dpbsud(1, 4, 7);
      if constexpr (MT > 1) {
        _tile_loadd(5, a(m0 + kRows, g), K);
        _tile_dpbsud(2, 5, 6);
        if constexpr (NB > 1) _tile_dpbsud(3, 5, 7);
      }
      // (_tile_stored names its tile in the instruction's text: a literal, not a parameter.)
      constexpr int64_t kTile = kRows * kBlockN;
      _tile_stored(0, dots, 64);
      if constexpr (NB > 1) _tile_stored(1, dots + kTile, 64);
      if constexpr (MT > 1) _tile_stored(2, dots + 2 * kTile, 64);
      if constexpr (MT > 1 && NB > 1) _tile_stored(3, dots + 3 * kTile, 64);
      for (int m = 0; m < MT; ++m) {
        const int64_t rows = std::min<int64_t>(kRows, M - m0 - m * kRows);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t row = m0 + m * kRows + r;
          const __m512i c = _mm512_set1_epi32(comp[row * G + g]);
          const __m512 s = _mm512_set1_ps(x_scale[row * G + g]);
          for (int n = 0; n < NB; ++n) {
            float* sum = acc + ((m * NB + n) * kRows + r) * kBlockN;
            const __m512i dot = _mm512_load_si512(dots + (2 * m + n) * kTile + r * kBlockN);
            _mm512_store_ps(sum, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot, c)), s, _mm512_load_ps(sum)));
          }
        }
      }
    }
    for (int n = 0; n < NB; ++n) {
      const __m512 ws = _mm512_loadu_ps(w_scale + (b0 + n) * kBlockN);
      for (int m = 0; m < MT; ++m) {
        const int64_t rows = std::min<int64_t>(kRows, M - m0 - m * kRows);
        for (int64_t r = 0; r < rows; ++r)
          llmserve_tiles::store_row(y + (m0 + m * kRows + r) * N + (b0 + n) * kBlockN,
                                    _mm512_mul_ps(_mm512_load_ps(acc + ((m * NB + n) * kRows + r) * kBlockN), ws));
      }
    }
  }

  // Blocks [2 p, 2 p + 2) of every row tile; the first row tiles prefetch pair `ahead`'s
  // (this thread's next; -1: none).
  void column_pair(int64_t p, int64_t ahead, int32_t* dots, float* acc) const {
    const int64_t b0 = 2 * p, blocks = N / kBlockN;
    const int64_t next_blocks = ahead < 0 ? 0 : std::min<int64_t>(blocks - 2 * ahead, 2);
    const auto run = [&]<int MT, int NB>(int64_t m0) {
      this->template tile<MT, NB>(m0, b0, dots, acc, 2 * ahead, m0 == 0 ? next_blocks : 0);
    };
    for_each_row_tile(run, M, b0 + 1 < blocks);
  }
};

}  // namespace

template <typename T>
void w8a8_product(const int8_t* xq, const float* x_scale, const int32_t* comp, const uint8_t* w,
                  const float* w_scale, T* y, int64_t M, int64_t N, int64_t K) {
  const W8A8Product<T> product{xq, x_scale, comp, w, w_scale, y, M, N, K};
  const int64_t pairs = (N / kBlockN + 1) / 2;
  // A fork costs ~10 us: small products stay on one thread (as gemm_tiles.h's driver does).
  const int64_t macs_per_pair = std::max<int64_t>(M, kRows) * K * 2 * kBlockN;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 20) / macs_per_pair);
  llmserve_pieces::parallel_pieces(pairs, grain, [&](llmserve_pieces::Pieces& pieces) {
    const TileConfig config(std::min(M, kRows));
    alignas(64) int32_t dots[4 * kRows * kBlockN];
    alignas(64) float acc[4 * kRows * kBlockN];
    _tile_loadconfig(&config);
    llmserve_pieces::Walk walk(pieces);
    for (int64_t p, ahead; walk.next(p, ahead);) product.column_pair(p, ahead, dots, acc);
    _tile_release();  // (so the OS need not save 8 KiB of tile state at every switch)
  });
}

#else

template <typename T>
void w8a8_product(const int8_t*, const float*, const int32_t*, const uint8_t*, const float*, T*, int64_t, int64_t,
                  int64_t) {}

#endif

template void w8a8_product<float>(const int8_t*, const float*, const int32_t*, const uint8_t*, const float*, float*,
                                  int64_t, int64_t, int64_t);
template void w8a8_product<c10::BFloat16>(const int8_t*, const float*, const int32_t*, const uint8_t*, const float*,
                                          c10::BFloat16*, int64_t, int64_t, int64_t);

}  // namespace llmserve_amx
