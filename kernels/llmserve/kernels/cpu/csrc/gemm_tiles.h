// The register-tiled GEMM driver shared by our CPU linear kernels (int8_linear.cpp,
// bf16_linear.cpp): y [M, N] = x [M, K] @ W.T with W packed in blocks of 16 output
// channels, so that one 64-byte load feeds a whole block.
//
// A tile is Tile::kRowTile rows x kTileBlocks blocks of 16 columns, its sums held in
// registers (int8: 4 x 48, 12 integer sums; bfloat16: 8 x 48, 24 float sums, plus the
// 3 weight vectors and a broadcast row: 28 of AVX-512's 32 registers). Tiles of columns
// run in parallel; inside one, its rows run in row tiles while its weights stay in L1/L2.
// Each kernel supplies the tile's arithmetic: `tile.template run<MT, NB, C>(m0, b0, next)`
// writes rows [m0, m0 + MT) x blocks [b0, b0 + NB), calling `next.issue()` at the steps
// of its k loop that cadence C names; `tile.block(b)`, `tile.block_bytes()`: where packed
// block b starts; `Tile::kRowTile`: the rows of a full tile (its row loop's unit);
// `Tile::kLonePrefetchRows`: from how many rows one row tile alone prefetches.
//
// Why the prefetch: with more than one row tile, only the first streams the tile's
// weights from memory; the later ones read them from L2 while memory idles (at 16 rows
// a bfloat16 product ran at ~60% of the memory bandwidth, although bandwidth and
// arithmetic each needed about the same time). Each row tile therefore prefetches its
// share of the next column tile's weights into L2, spread over its k loop.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "shared_pieces.h"

namespace llmserve_tiles {

constexpr int64_t kBlockN = 16;     // output channels per 512-bit accumulator
constexpr int64_t kTileBlocks = 3;  // blocks per full tile

inline void store_row(float* y, __m512 v) { _mm512_storeu_ps(y, v); }

inline void store_row(c10::BFloat16* y, __m512 v) {
  // float32 -> bfloat16, round to nearest even (what torch's .to(bfloat16) does)
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

// How often a row tile issues its prefetches: every k step, every 4th (k = 0, 4, ...), or
// never (nothing to prefetch: the loop keeps none of it).
//
// NOTE: every step when one row tile streams the tile alone: it runs at memory speed, and
// its 3 lines a step issued as 12 every 4th step made 4-row int8 products from memory
// 1.1-1.3x slower (`llmserve bench gemm`, SmolLM2-135M's shapes). Every 4th step when
// row tiles share the lines: they are compute-bound, and bookkeeping in every step of the
// innermost loop made GCC 12 spill the products' registers (the 4 x 3 int8 tile in L1:
// 41% of VPDPBUSD's peak with a counter in every step, 87% without).
enum Cadence { kNever = 0, kEveryStep = 1, kEvery4thStep = 4 };

// Whether a loop at cadence C issues at step k.
template <int C>
inline bool issues_at(int64_t k) {
  return C == kEveryStep || (C == kEvery4thStep && k % 4 == 0);
}

// A row tile's share of the next column tile's weights, prefetched into L2 as it runs:
// `lines` 64-byte lines from `base`, in address order, spread over `issues` calls of
// `issue()`.
//
// NOTE: in address order, because order matters as much as count: the same lines taken
// as 4 lines of each block in turn ran 1-16 row products 1.2-1.6x slower from memory (the
// hardware prefetchers follow one ascending stream, not three).
class NextTile {
 public:
  NextTile() = default;
  NextTile(const char* base, int64_t lines, int64_t issues)
      : next_(base), left_(lines), per_issue_((lines + issues - 1) / std::max<int64_t>(issues, 1)) {}

  inline void issue() {
    const int64_t n = std::min(per_issue_, left_);
    for (int64_t i = 0; i < n; ++i) _mm_prefetch(next_ + 64 * i, _MM_HINT_T1);
    next_ += 64 * n;
    left_ -= n;
  }

 private:
  const char* next_ = nullptr;
  int64_t left_ = 0, per_issue_ = 0;
};

// Row tiles of column tile [b0, b0 + NB); row tile r prefetches `ahead(r)` at cadence C.
template <int MT, int NB, int C, class Tile>
inline void run_last_rows(const Tile& tile, int64_t rows, int64_t m0, int64_t b0, const NextTile& next) {
  if constexpr (MT > 0) {
    if (rows == MT) {
      tile.template run<MT, NB, C>(m0, b0, next);
    } else {
      run_last_rows<MT - 1, NB, C>(tile, rows, m0, b0, next);
    }
  }
}

template <int NB, int C, class Tile, class Ahead>
inline void run_rows(const Tile& tile, int64_t M, int64_t b0, const Ahead& ahead) {
  constexpr int RT = Tile::kRowTile;
  int64_t m0 = 0, r = 0;
  for (; m0 + RT <= M; m0 += RT, ++r) tile.template run<RT, NB, C>(m0, b0, ahead(r));
  if (M > m0) run_last_rows<RT - 1, NB, C>(tile, M - m0, m0, b0, ahead(r));
}

// Rows [0, M) of column tile [b0, b0 + NB) of a product with `blocks` blocks in all;
// next_b0: the first block of the column tile this thread runs next (`blocks`: none).
template <int NB, class Tile>
inline void run_columns(const Tile& tile, int64_t M, int64_t b0, int64_t next_b0, int64_t blocks) {
  const int64_t row_tiles = (M + Tile::kRowTile - 1) / Tile::kRowTile;
  // The next column tile's lines (up to NB blocks), split into one part per row tile.
  // NOTE: one row tile prefetches too, from Tile::kLonePrefetchRows rows: with the
  // hardware prefetchers alone memory idled while it computed (from memory, bfloat16
  // products at 4-8 rows and int8 at 1-4 ran 1.1-1.6x slower without; bfloat16 at 1 row
  // ran up to 1.16x faster without).
  const bool prefetch = row_tiles > 1 || M >= Tile::kLonePrefetchRows;
  const int64_t next_blocks = prefetch ? std::clamp<int64_t>(blocks - next_b0, 0, NB) : 0;
  const int64_t lines = next_blocks * tile.block_bytes() / 64;
  const int64_t part = (lines + row_tiles - 1) / row_tiles;
  const char* next = next_blocks ? tile.block(next_b0) : nullptr;
  const int64_t steps = tile.block_bytes() / 64;  // a k step reads one line of each block
  auto ahead = [&](int64_t r, int64_t every) {
    const int64_t first = std::min(r * part, lines);
    return NextTile(next + 64 * first, std::min(part, lines - first), (steps + every - 1) / every);
  };
  if (lines == 0) {
    run_rows<NB, kNever>(tile, M, b0, [](int64_t) { return NextTile{}; });
  } else if (row_tiles == 1) {
    run_rows<NB, kEveryStep>(tile, M, b0, [&](int64_t r) { return ahead(r, 1); });
  } else {
    run_rows<NB, kEvery4thStep>(tile, M, b0, [&](int64_t r) { return ahead(r, 4); });
  }
}

// Every tile of y [M, N] (N % kBlockN == 0) for products of depth K.
template <class Tile>
void for_each_tile(const Tile& tile, int64_t M, int64_t N, int64_t K) {
  const int64_t blocks = N / kBlockN;
  const int64_t tiles = (blocks + kTileBlocks - 1) / kTileBlocks;
  // Small products stay on one thread: a fork costs ~10 us, as much as 2^18 int8 MACs.
  const int64_t macs_per_tile = M * K * kBlockN * kTileBlocks;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(macs_per_tile, 1));
  llmserve_pieces::parallel_pieces(tiles, grain, [&](llmserve_pieces::Pieces& pieces) {
    llmserve_pieces::Walk walk(pieces);
    for (int64_t t, ahead; walk.next(t, ahead);) {
      const int64_t b0 = t * kTileBlocks;
      if (b0 + kTileBlocks <= blocks) {
        run_columns<kTileBlocks>(tile, M, b0, ahead < 0 ? blocks : ahead * kTileBlocks, blocks);
      } else {  // (the last tile: nothing runs after it)
        for (int64_t b = b0; b < blocks; ++b) run_columns<1>(tile, M, b, b + 1, blocks);
      }
    }
  });
}

}  // namespace llmserve_tiles
#endif  // __AVX512F__
