// bfloat16 products on AMX tiles (amx.h says what, why and how the tiles are used):
// TDPBF16PS, 16 x 16 x 32 products a tile step.
#include "amx.h"

#include <vector>

#include "shared_pieces.h"

#if LLMSERVE_AMX
#include "gemm_tiles.h"
#include "vec_math.h"
#endif

namespace llmserve_amx {

#if LLMSERVE_AMX
namespace {

constexpr int64_t kDepth = 32;  // bfloat16 values of k per tile row (64 bytes)

struct Product {
  const uint16_t* x;  // [Mp, K] at stride ldx, Mp = M rounded up to 16
  int64_t ldx;
  const uint16_t* w;  // [N/16, K/2, 16, 2]
  c10::BFloat16* y;   // [M, N], or [M, N/2] with silu_mul
  int64_t M, N, K;
  // The blocks pair gate and up channels (block 2j: gate j, 2j + 1: up j) and y takes
  // silu(gate) * up, each pair's two C tiles combined as they leave the tiles.
  bool silu_mul = false;

  const uint16_t* a(int64_t m0, int64_t k0) const { return x + m0 * ldx + k0; }
  const uint16_t* b(int64_t block, int64_t k0) const { return w + block * K * kBlockN + k0 * kBlockN; }

  // y[m0 : m0 + 16 MT, 16 b0 : 16 (b0 + NB)]; tile numbers must be constants, hence the
  // template and `if constexpr`.
  template <int MT, int NB>
  void tile(int64_t m0, int64_t b0, float* sums, llmserve_tiles::NextTile next) const {
    _tile_zero(0);
    if constexpr (NB > 1) _tile_zero(1);
    if constexpr (MT > 1) _tile_zero(2);
    if constexpr (MT > 1 && NB > 1) _tile_zero(3);
    const int64_t a_stride = ldx * 2, b_stride = kBlockN * 4;
    for (int64_t k0 = 0; k0 < K; k0 += kDepth) {
      next.issue();
      _tile_loadd(6, b(b0, k0), b_stride);
      if constexpr (NB > 1) _tile_loadd(7, b(b0 + 1, k0), b_stride);
      _tile_loadd(4, a(m0, k0), a_stride);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (NB > 1) _tile_dpbf16ps(1, 4, 7);
      if constexpr (MT > 1) {
        _tile_loadd(5, a(m0 + kRows, k0), a_stride);
        _tile_dpbf16ps(2, 5, 6);
        if constexpr (NB > 1) _tile_dpbf16ps(3, 5, 7);
      }
    }
    // (_tile_stored names its tile in the instruction's text: a literal, not a parameter.)
    if constexpr (NB > 1) {
      if (silu_mul) {
        _tile_stored(0, sums, kBlockN * 4);
        _tile_stored(1, sums + kRows * kBlockN, kBlockN * 4);
        store_silu_mul(m0, b0 / 2, sums);
        if constexpr (MT > 1) {
          _tile_stored(2, sums, kBlockN * 4);
          _tile_stored(3, sums + kRows * kBlockN, kBlockN * 4);
          store_silu_mul(m0 + kRows, b0 / 2, sums);
        }
        return;
      }
    }
    _tile_stored(0, sums, kBlockN * 4);
    store(m0, b0, sums);
    if constexpr (NB > 1) {
      _tile_stored(1, sums, kBlockN * 4);
      store(m0, b0 + 1, sums);
    }
    if constexpr (MT > 1) {
      _tile_stored(2, sums, kBlockN * 4);
      store(m0 + kRows, b0, sums);
    }
    if constexpr (MT > 1 && NB > 1) {
      _tile_stored(3, sums, kBlockN * 4);
      store(m0 + kRows, b0 + 1, sums);
    }
  }

  // A C tile's sums (stored to `sums` [16, 16]), rows that exist in y only, rounded to bfloat16.
  void store(int64_t m0, int64_t block, const float* sums) const {
    const int64_t rows = std::min<int64_t>(kRows, M - m0);
    for (int64_t r = 0; r < rows; ++r)
      llmserve_tiles::store_row(y + (m0 + r) * N + block * kBlockN, _mm512_load_ps(sums + r * kBlockN));
  }

  // silu(gate) * up of a row tile's output block j from the pair's sums (`sums` [2, 16,
  // 16]: gate's, then up's), with the unfused path's roundings: each product rounded to
  // bfloat16 as bf16_linear stores it, silu's result rounded as silu_and_mul rounds it.
  void store_silu_mul(int64_t m0, int64_t j, const float* sums) const {
    using namespace llmserve_vec;
    const int64_t rows = std::min<int64_t>(kRows, M - m0), d = N / 2;
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 gate = round_bf16(_mm512_load_ps(sums + r * kBlockN));
      const __m512 up = round_bf16(_mm512_load_ps(sums + (kRows + r) * kBlockN));
      store_bf16(y + (m0 + r) * d + j * kBlockN, _mm512_mul_ps(round_bf16(silu(gate)), up));
    }
  }

  // Blocks [2 p, 2 p + 2) of every row tile. The row tiles prefetch the blocks of pair
  // `ahead` (this thread's next; -1: none) into L2 as they go (K x 32 bytes a block,
  // contiguous), each pass over a pair of row tiles its share, spread over its k steps.
  // NOTE: without, tile loads waited on memory: products from memory at 1-16 rows ran
  // 1.1-1.3x slower (SmolLM2-135M's and a 1B's shapes). And shared by the passes, not
  // all in the first: 32 lines a k step there and none in the second pass, 64-row
  // products from memory streamed ~17-19 GB/s where 1-16 rows stream ~26-31 (2-core
  // Xeon, AMX host; SmolLM2-135M's shapes); shared, ~19.5-21.5 GB/s.
  void column_pair(int64_t p, int64_t ahead, float* sums) const {
    const int64_t b0 = 2 * p, blocks = N / kBlockN;
    const char* next = ahead < 0 ? nullptr : reinterpret_cast<const char*>(b(2 * ahead, 0));
    const int64_t lines = ahead < 0 ? 0 : std::min<int64_t>(blocks - 2 * ahead, 2) * K / 2;
    const int64_t passes = (tiled_rows(M) + 2 * kRows - 1) / (2 * kRows);
    const int64_t share = (lines + passes - 1) / passes;
    const auto run = [&]<int MT, int NB>(int64_t m0) {
      const int64_t first = std::min(m0 / (2 * kRows) * share, lines);
      tile<MT, NB>(m0, b0, sums, llmserve_tiles::NextTile(next + 64 * first, std::min(share, lines - first), K / kDepth));
    };
    for_each_row_tile(run, M, b0 + 1 < blocks);
  }
};

}  // namespace

void bf16_product(const uint16_t* x, int64_t ldx, const uint16_t* w, c10::BFloat16* y, int64_t M, int64_t N,
                  int64_t K, bool silu_mul) {
  // Under 16 rows the A and C tiles have M rows; above, a row count that is not a multiple
  // of 16 reads a zero-padded copy. NOTE: not M-row tiles for the remainder, and not a
  // padded copy under 16: either way a row's sums come out the same (TDPBF16PS sums each
  // row alone, in one order), so a sequence's logits do not depend on its batch, and
  // short products skip the copy.
  std::vector<uint16_t> padded;
  if (M > kRows && M % kRows != 0) {
    padded.assign(static_cast<size_t>((M + kRows - 1) / kRows * kRows * K), 0);
    for (int64_t m = 0; m < M; ++m) std::copy(x + m * ldx, x + m * ldx + K, padded.data() + m * K);
    x = padded.data();
    ldx = K;
  }
  const Product product{x, ldx, w, y, M, N, K, silu_mul};
  const int64_t pairs = (N / kBlockN + 1) / 2;
  // A fork costs ~10 us: small products stay on one thread (as gemm_tiles.h's driver does).
  const int64_t macs_per_pair = std::max<int64_t>(M, kRows) * K * 2 * kBlockN;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 19) / macs_per_pair);
  llmserve_pieces::parallel_pieces(pairs, grain, [&](llmserve_pieces::Pieces& pieces) {
    // Tile configuration is per thread; release it after, so the OS need not save 8 KiB of
    // tile state at every switch away from this thread.
    const TileConfig config(std::min(M, kRows));
    alignas(64) float sums[2 * kRows * kBlockN];  // one C tile's, or a gate/up pair's
    _tile_loadconfig(&config);
    llmserve_pieces::Walk walk(pieces);
    for (int64_t p, ahead; walk.next(p, ahead);) product.column_pair(p, ahead, sums);
    _tile_release();
  });
}

#else

void bf16_product(const uint16_t*, int64_t, const uint16_t*, c10::BFloat16*, int64_t, int64_t, int64_t, bool) {}

#endif

}  // namespace llmserve_amx
