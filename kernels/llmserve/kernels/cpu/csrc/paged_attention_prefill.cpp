// Paged attention for prefill and chunk rows on CPU (flash attention): each sequence's
// queries against its keys and values read in place from the paged KV cache through its
// block table (no gather copy), causal with the chunk's context offset, optional sliding
// window and soft-cap, online softmax in float32.
//
//   q        [T, H, D]                     the prefill rows' queries, sequence after sequence
//   kv_cache [2, num_blocks, block_size, KVH, D]   this step's keys already stored
//   tables   [N, max_blocks] int64         physical block of each logical block
//   qsl      [N + 1] int64                 sequence n owns rows qsl[n] .. qsl[n+1]-1 of q
//   seq_lens [N] int64                     tokens of context incl. the chunk's
//   window   W > 0: a query at position p sees keys (p - W, p] only (0 = all)
//   softcap  c > 0: scores -> c * tanh(scores / c) before the mask and softmax (0 = off)
//   out      [T, H, D]
//
// A work item is (sequence, KV head, query tile): the g = H / KVH query heads of one KV
// head for up to kRows / g consecutive queries, i.e. kRows "rows" r = i * g + j (query i,
// head j of the group), so every key row read serves all of them. Inside an item the
// rows are the 16 lanes of 3 vectors, keys go by tiles of kKeyTile:
//
//   S^T [keys][rows]  = K_tile . Q^T    lanes = rows: the softmax's running max and sum
//   O^T [D][rows]    += V_tile^T . P^T  are per lane, with no horizontal reduction
//
// K rows are read in place (one broadcast pair of a key row per product), V rows of a
// tile are interleaved in pairs once for all rows. An item reads keys from the first one
// its first query's window reaches up to its last query; blocks wholly before that are
// never touched (the scheduler may have freed them), nor cache rows past a sequence's end.
// Items run longest first off a shared counter: a causal chunk's last query tile costs
// many times its first.
//
// Where the CPU has AMX, both products run on its tiles (AmxBf16Math); elsewhere bfloat16
// takes AVX-512 BF16 dot products (Bf16Math) or float32 loops (FloatMath).
//
// Why not torch's SDPA (the fallback, in torch_paged.py): its fused CPU kernel runs
// bfloat16 at a few % of the bfloat16 GEMM rate, and needs each chunk's cached context
// gathered into a contiguous copy first (figures: docs/benchmarks.md).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "shared_pieces.h"
#include "vec_math.h"

namespace {

constexpr int64_t kRows = 48;     // rows (query x head) per item: 3 vectors of 16 lanes
constexpr int64_t kKeyTile = 32;  // keys per tile of S^T
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Item {
  int64_t seq, kv_head, q0, q1;  // rows q0..q1-1 of the sequence's chunk
  int64_t k0, k1;                // keys read: positions k0..k1-1
};

// One item's softmax state and per-thread buffers.
struct Tile {
  int64_t rows;                  // (q1 - q0) * g <= kRows; the others are padding
  int32_t qpos[kRows];           // position of each row's query (-1: padding, sees nothing)
  float m[kRows], l[kRows], alpha[kRows];
  std::vector<float> s;          // [kKeyTile][kRows]: scores, then probabilities
  std::vector<float> o;          // [D][kRows]: O^T
};

// The softmax step of one key tile, per row: mask, running max and sum, s -> p (zero where
// masked, and for the padding keys nk..kKeyTile-1), alpha = the factor O^T is rescaled by.
void softmax_tile(Tile& t, int64_t k0, int64_t nk, int64_t window, float softcap) {
  for (int64_t r = 0; r < kRows; ++r) {
    const int64_t p_hi = t.qpos[r], p_lo = window > 0 ? t.qpos[r] - window + 1 : 0;  // visible: [p_lo, p_hi]
    float mt = kNegInf;
    for (int64_t k = 0; k < nk; ++k) {
      float& s = t.s[k * kRows + r];
      if (softcap > 0.f) s = softcap * std::tanh(s / softcap);
      if (k0 + k > p_hi || k0 + k < p_lo) s = kNegInf;
      mt = std::max(mt, s);
    }
    const float m_new = std::max(t.m[r], mt);
    const float m_use = m_new == kNegInf ? 0.f : m_new;  // no visible key yet: p = 0, alpha = 1
    t.alpha[r] = m_new == kNegInf ? 1.f : std::exp(t.m[r] - m_use);
    float sum = 0.f;
    for (int64_t k = 0; k < nk; ++k) {
      float& s = t.s[k * kRows + r];
      s = s == kNegInf ? 0.f : std::exp(s - m_use);
      sum += s;
    }
    for (int64_t k = nk; k < kKeyTile; ++k) t.s[k * kRows + r] = 0.f;
    t.l[r] = t.l[r] * t.alpha[r] + sum;
    t.m[r] = m_new;
  }
}

#if defined(__AVX512F__)
// softmax_tile with 16 rows a vector (no soft-cap: that rare case takes the loop above).
void softmax_tile_avx512(Tile& t, int64_t k0, int64_t nk, int64_t window) {
  for (int64_t r = 0; r < kRows; r += 16) {
    const __m512i p_hi = _mm512_loadu_si512(t.qpos + r);
    const __m512i p_lo = window > 0 ? _mm512_sub_epi32(p_hi, _mm512_set1_epi32(window - 1)) : _mm512_setzero_si512();
    __mmask16 visible[kKeyTile];
    __m512 mt = _mm512_set1_ps(kNegInf);
    for (int64_t k = 0; k < nk; ++k) {
      const __m512i pos = _mm512_set1_epi32(static_cast<int32_t>(k0 + k));
      visible[k] = _mm512_cmp_epi32_mask(pos, p_hi, _MM_CMPINT_LE) & _mm512_cmp_epi32_mask(pos, p_lo, _MM_CMPINT_NLT);
      mt = _mm512_mask_max_ps(mt, visible[k], mt, _mm512_loadu_ps(&t.s[k * kRows + r]));
    }
    const __m512 m_old = _mm512_loadu_ps(t.m + r);
    const __m512 m_new = _mm512_max_ps(m_old, mt);
    const __mmask16 seen = _mm512_cmp_ps_mask(m_new, _mm512_set1_ps(kNegInf), _CMP_NEQ_OQ);
    const __m512 m_use = _mm512_maskz_mov_ps(seen, m_new);
    const __m512 alpha =
        _mm512_mask_blend_ps(seen, _mm512_set1_ps(1.f), llmserve_vec::exp(_mm512_sub_ps(m_old, m_use)));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t k = 0; k < nk; ++k) {
      float* s = &t.s[k * kRows + r];
      const __m512 p = _mm512_maskz_mov_ps(visible[k], llmserve_vec::exp(_mm512_sub_ps(_mm512_loadu_ps(s), m_use)));
      _mm512_storeu_ps(s, p);
      sum = _mm512_add_ps(sum, p);
    }
    for (int64_t k = nk; k < kKeyTile; ++k) _mm512_storeu_ps(&t.s[k * kRows + r], _mm512_setzero_ps());
    _mm512_storeu_ps(t.alpha + r, alpha);
    _mm512_storeu_ps(t.l + r, _mm512_fmadd_ps(_mm512_loadu_ps(t.l + r), alpha, sum));
    _mm512_storeu_ps(t.m + r, m_new);
  }
}
#endif

// Portable float32 math (float32 caches; bfloat16 where the CPU has no AVX-512 BF16):
// plain loops over the rows, which the compiler vectorizes.
template <typename T>
struct FloatMath {
  std::vector<float> q;  // [D][kRows]: Q^T in float

  void load_queries(const T* const* rows, int64_t n, int64_t D) {
    q.assign(D * kRows, 0.f);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t d = 0; d < D; ++d) q[d * kRows + r] = static_cast<float>(rows[r][d]);
  }

  // s[k][r] = scale * q_r . k_k for the nk keys k, 4 keys at a time (12 vectors of sums).
  void scores(const T* const* keys, int64_t nk, int64_t D, float scale, float* s) const {
    for (int64_t k0 = 0; k0 < nk; k0 += 4) {
      const T* key[4];  // keys past nk repeat a valid row; their scores are never read
      for (int j = 0; j < 4; ++j) key[j] = keys[std::min<int64_t>(k0 + j, nk - 1)];
      float acc[4][kRows] = {};
      for (int64_t d = 0; d < D; ++d)
        for (int j = 0; j < 4; ++j) {
          const float kd = static_cast<float>(key[j][d]);
          for (int64_t r = 0; r < kRows; ++r) acc[j][r] += kd * q[d * kRows + r];
        }
      for (int j = 0; j < 4 && k0 + j < nk; ++j)
        for (int64_t r = 0; r < kRows; ++r) s[(k0 + j) * kRows + r] = scale * acc[j][r];
    }
  }

  // o[d][r] = alpha[r] * o[d][r] + sum_k p[k][r] * v_k[d], 4 values of d at a time (p is
  // zero for k >= nk: those rows are not read), p rounded to T: bfloat16 products P . V,
  // as Bf16Math's and torch's SDPA's.
  void accumulate(const T* const* values, int64_t nk, int64_t D, const float* p, const float* alpha,
                  float* o) const {
    for (int64_t d0 = 0; d0 < D; d0 += 4) {
      const int64_t nd = std::min<int64_t>(4, D - d0);
      float acc[4][kRows];
      for (int64_t j = 0; j < 4; ++j)
        for (int64_t r = 0; r < kRows; ++r) acc[j][r] = j < nd ? alpha[r] * o[(d0 + j) * kRows + r] : 0.f;
      for (int64_t k = 0; k < nk; ++k)
        for (int64_t j = 0; j < 4; ++j) {
          const float vd = j < nd ? static_cast<float>(values[k][d0 + j]) : 0.f;
          for (int64_t r = 0; r < kRows; ++r) acc[j][r] += vd * llmserve_vec::round_to<T>(p[k * kRows + r]);
        }
      for (int64_t j = 0; j < nd; ++j)
        for (int64_t r = 0; r < kRows; ++r) o[(d0 + j) * kRows + r] = acc[j][r];
    }
  }
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define LLMSERVE_PREFILL_BF16 1
// bfloat16 with AVX-512 BF16: QK^T and PV as VDPBF16PS (pairs of bf16 products, exact in
// float32, summed in float32); D a multiple of 32.
//   scores:     S^T[k] (16 rows) += bcast(k_k[2i : 2i+2]) . Qp[i]      Qp: Q^T in bf16 pairs
//   accumulate: O^T[d] (16 rows) += bcast(Vp[k/2][d]) . Pp[k/2]        Vp: v_k, v_k+1 interleaved
// Register tiles: 8 keys x 3 row vectors of scores; 8 values of d x 3 row vectors of O^T.
struct Bf16Math {
  std::vector<uint32_t> qp;  // [D/2][kRows]: pair i of each row's query
  std::vector<uint32_t> vp;  // [kKeyTile/2][D]: (v_2j[d], v_2j+1[d])
  std::vector<__m512i> pp;   // [kKeyTile/2][3]: (p[2j][r], p[2j+1][r]) in bf16 for 16 rows

  void load_queries(const c10::BFloat16* const* rows, int64_t n, int64_t D) {
    qp.assign(D / 2 * kRows, 0);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t i = 0; i < D / 2; ++i) std::memcpy(&qp[i * kRows + r], rows[r] + 2 * i, 4);
  }

  void scores(const c10::BFloat16* const* keys, int64_t nk, int64_t D, float scale, float* s) const {
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t k0 = 0; k0 < nk; k0 += 8) {
      const c10::BFloat16* key[8];  // keys past nk repeat a valid row; their scores are never read
      for (int j = 0; j < 8; ++j) key[j] = keys[std::min(k0 + j, nk - 1)];
      __m512 acc[8][3];
      for (int j = 0; j < 8; ++j)
        for (int v = 0; v < 3; ++v) acc[j][v] = _mm512_setzero_ps();
      for (int64_t i = 0; i < D / 2; ++i) {
        const __m512bh q0 = (__m512bh)_mm512_loadu_si512(&qp[i * kRows]);
        const __m512bh q1 = (__m512bh)_mm512_loadu_si512(&qp[i * kRows + 16]);
        const __m512bh q2 = (__m512bh)_mm512_loadu_si512(&qp[i * kRows + 32]);
        for (int j = 0; j < 8; ++j) {
          int32_t pair;
          std::memcpy(&pair, key[j] + 2 * i, 4);
          const __m512bh kv = (__m512bh)_mm512_set1_epi32(pair);
          acc[j][0] = _mm512_dpbf16_ps(acc[j][0], kv, q0);
          acc[j][1] = _mm512_dpbf16_ps(acc[j][1], kv, q1);
          acc[j][2] = _mm512_dpbf16_ps(acc[j][2], kv, q2);
        }
      }
      for (int j = 0; j < 8 && k0 + j < nk; ++j)
        for (int v = 0; v < 3; ++v) _mm512_storeu_ps(s + (k0 + j) * kRows + 16 * v, _mm512_mul_ps(acc[j][v], vscale));
    }
  }

  // 16 bfloat16 values, each zero-extended to the low half of a 32-bit lane.
  static __m512i widen(const c10::BFloat16* x) {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  }

  // vp and pp for the first (nk + 1) / 2 pairs of keys (accumulate's operands).
  void pack_pairs(const c10::BFloat16* const* values, int64_t nk, int64_t D, const float* p) {
    const int64_t pairs = (nk + 1) / 2;
    vp.resize(kKeyTile / 2 * D);
    pp.resize(kKeyTile / 2 * 3);
    // Interleave each pair of value rows (the odd one zero past nk: cache rows there are
    // not this sequence's, and 0 * NaN would poison the sum).
    for (int64_t j = 0; j < pairs; ++j) {
      const c10::BFloat16* a = values[2 * j];
      const c10::BFloat16* b = 2 * j + 1 < nk ? values[2 * j + 1] : nullptr;
      for (int64_t d = 0; d < D; d += 16) {
        const __m512i lo = widen(a + d);
        const __m512i hi = b ? _mm512_slli_epi32(widen(b + d), 16) : _mm512_setzero_si512();
        _mm512_storeu_si512(&vp[j * D + d], _mm512_or_si512(lo, hi));
      }
      // p[2j], p[2j+1] (16 rows each) -> 16 bf16 pairs: cvtne2ps gives [p_2j | p_2j+1], the
      // permutation interleaves them.
      const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                  22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
      for (int v = 0; v < 3; ++v) {
        const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + (2 * j + 1) * kRows + 16 * v),
                                                  _mm512_loadu_ps(p + 2 * j * kRows + 16 * v));
        pp[j * 3 + v] = _mm512_permutexvar_epi16(interleave, (__m512i)both);
      }
    }
  }

  void accumulate(const c10::BFloat16* const* values, int64_t nk, int64_t D, const float* p, const float* alpha,
                  float* o) {
    pack_pairs(values, nk, D, p);
    const int64_t pairs = (nk + 1) / 2;
    __m512 a[3];
    for (int v = 0; v < 3; ++v) a[v] = _mm512_loadu_ps(alpha + 16 * v);
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
      __m512 acc[8][3];
      for (int j = 0; j < 8; ++j)
        for (int v = 0; v < 3; ++v) acc[j][v] = _mm512_mul_ps(a[v], _mm512_loadu_ps(o + (d0 + j) * kRows + 16 * v));
      for (int64_t i = 0; i < pairs; ++i) {
        const __m512bh p0 = (__m512bh)pp[i * 3], p1 = (__m512bh)pp[i * 3 + 1], p2 = (__m512bh)pp[i * 3 + 2];
        for (int j = 0; j < 8; ++j) {
          const __m512bh vv = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(vp[i * D + d0 + j]));
          acc[j][0] = _mm512_dpbf16_ps(acc[j][0], vv, p0);
          acc[j][1] = _mm512_dpbf16_ps(acc[j][1], vv, p1);
          acc[j][2] = _mm512_dpbf16_ps(acc[j][2], vv, p2);
        }
      }
      for (int j = 0; j < 8; ++j)
        for (int v = 0; v < 3; ++v) _mm512_storeu_ps(o + (d0 + j) * kRows + 16 * v, acc[j][v]);
    }
  }
};
#else
#define LLMSERVE_PREFILL_BF16 0
#endif

#if LLMSERVE_PREFILL_BF16 && LLMSERVE_AMX
// 16 x 16 32-bit values transposed in registers (r[i] holds row i; after, column i).
inline void transpose16x16(__m512i (&r)[16]) {
  __m512i t[16], u[16], v[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      v[h + i] = _mm512_shuffle_i32x4(u[h + i], u[h + i + 4], 0x88);
      v[h + i + 4] = _mm512_shuffle_i32x4(u[h + i], u[h + i + 4], 0xDD);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(v[i], v[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(v[i], v[i + 8], 0xDD);
  }
}

// Bf16Math's two products on AMX tiles (where the CPU has them), each C tile 16 x 16:
//   S^T = K . Q^T: A = the key tile's rows copied into one buffer (16 keys x 32 d), B =
//        Bf16Math's query pairs as they are (16 d-pairs x 16 rows); the six C tiles (2 x 16
//        keys, 3 x 16 rows) are stored straight into S^T.
//   O^T = V^T . P^T: A = V^T in key pairs (Bf16Math's value pairs vp, transposed 16 x 16 at
//        a time: 16 d x 16 key pairs), B = its probability pairs pp (16 key pairs x 16
//        rows); O^T's tiles are loaded, accumulated into and stored back in place.
// One instance per thread, which holds the tile configuration.
struct AmxBf16Math : Bf16Math {
  static constexpr int64_t kMaxD = 128;
  alignas(64) uint16_t keys_copy[kKeyTile * kMaxD];  // [kKeyTile][D]: the tile's key rows, zeros past nk
  alignas(64) uint32_t values_t[kMaxD * kKeyTile / 2];  // [D][16]: (v_2j[d], v_2j+1[d]) for the 16 pairs j

  AmxBf16Math() {
    const llmserve_amx::TileConfig config(llmserve_amx::kRows);
    _tile_loadconfig(&config);
  }
  ~AmxBf16Math() { _tile_release(); }
  AmxBf16Math(const AmxBf16Math&) = delete;
  AmxBf16Math& operator=(const AmxBf16Math&) = delete;

  void scores(const c10::BFloat16* const* keys, int64_t nk, int64_t D, float scale, float* s) {
    for (int64_t k = 0; k < kKeyTile; ++k) {
      if (k < nk) {
        std::memcpy(keys_copy + k * D, keys[k], D * 2);
      } else {
        std::memset(keys_copy + k * D, 0, D * 2);
      }
    }
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    const int64_t a_stride = D * 2, b_stride = kRows * 4;
    const uint32_t* q = qp.data();
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      const uint32_t* b = q + d0 / 2 * kRows;  // 16 d-pairs from d0, each 16 rows a group
      _tile_loadd(6, keys_copy + d0, a_stride);  // keys 0-15
      _tile_loadd(7, b, b_stride);
      _tile_dpbf16ps(0, 6, 7);
      _tile_loadd(7, b + 16, b_stride);
      _tile_dpbf16ps(1, 6, 7);
      _tile_loadd(7, b + 32, b_stride);
      _tile_dpbf16ps(2, 6, 7);
      _tile_loadd(6, keys_copy + 16 * D + d0, a_stride);  // keys 16-31
      _tile_loadd(7, b, b_stride);
      _tile_dpbf16ps(3, 6, 7);
      _tile_loadd(7, b + 16, b_stride);
      _tile_dpbf16ps(4, 6, 7);
      _tile_loadd(7, b + 32, b_stride);
      _tile_dpbf16ps(5, 6, 7);
    }
    // S^T[k][r] at s + k * kRows + r: C tile (key half h, row group v) at s + 16 h kRows + 16 v.
    _tile_stored(0, s, b_stride);
    _tile_stored(1, s + 16, b_stride);
    _tile_stored(2, s + 32, b_stride);
    _tile_stored(3, s + 16 * kRows, b_stride);
    _tile_stored(4, s + 16 * kRows + 16, b_stride);
    _tile_stored(5, s + 16 * kRows + 32, b_stride);
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < nk * kRows; i += 16) _mm512_storeu_ps(s + i, _mm512_mul_ps(_mm512_loadu_ps(s + i), vscale));
  }

  void accumulate(const c10::BFloat16* const* values, int64_t nk, int64_t D, const float* p, const float* alpha,
                  float* o) {
    pack_pairs(values, nk, D, p);
    // The tile reads all 16 pairs: the ones past nk are zero (stale rows of an earlier tile
    // times a zero probability would still turn a NaN there into NaN sums).
    for (int64_t j = (nk + 1) / 2; j < kKeyTile / 2; ++j) {
      std::memset(&vp[j * D], 0, D * 4);
      for (int v = 0; v < 3; ++v) pp[j * 3 + v] = _mm512_setzero_si512();
    }
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      __m512i rows[16];
      for (int j = 0; j < 16; ++j) rows[j] = _mm512_loadu_si512(&vp[j * D + d0]);
      transpose16x16(rows);
      for (int i = 0; i < 16; ++i) _mm512_store_si512(values_t + (d0 + i) * 16, rows[i]);
    }
    for (int64_t d = 0; d < D; ++d)
      for (int v = 0; v < 3; ++v) {
        float* od = o + d * kRows + 16 * v;
        _mm512_storeu_ps(od, _mm512_mul_ps(_mm512_loadu_ps(alpha + 16 * v), _mm512_loadu_ps(od)));
      }
    const int64_t stride = kRows * 4;  // bytes between rows of O^T, and between pp's pairs
    _tile_loadd(3, &pp[0], stride);
    _tile_loadd(4, &pp[1], stride);
    _tile_loadd(5, &pp[2], stride);
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      float* od = o + d0 * kRows;
      _tile_loadd(6, values_t + d0 * 16, 64);
      _tile_loadd(0, od, stride);
      _tile_loadd(1, od + 16, stride);
      _tile_loadd(2, od + 32, stride);
      _tile_dpbf16ps(0, 6, 3);
      _tile_dpbf16ps(1, 6, 4);
      _tile_dpbf16ps(2, 6, 5);
      _tile_stored(0, od, stride);
      _tile_stored(1, od + 16, stride);
      _tile_stored(2, od + 32, stride);
    }
  }
};
#endif

// The work items of all sequences, costliest first (queries x keys read).
std::vector<Item> plan(const int64_t* qsl, const int64_t* seq_lens, int64_t N, int64_t KVH, int64_t queries_per_item,
                       int64_t window) {
  std::vector<Item> items;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t q_len = qsl[n + 1] - qsl[n], ctx = seq_lens[n] - q_len;
    for (int64_t q0 = 0; q0 < q_len; q0 += queries_per_item) {
      const int64_t q1 = std::min(q_len, q0 + queries_per_item);
      const int64_t k0 = window > 0 ? std::max<int64_t>(0, ctx + q0 - window + 1) : 0, k1 = ctx + q1;
      for (int64_t kh = 0; kh < KVH; ++kh) items.push_back({n, kh, q0, q1, k0, k1});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return (a.q1 - a.q0) * (a.k1 - a.k0) > (b.q1 - b.q0) * (b.k1 - b.k0);
  });
  return items;
}

template <typename T, typename Math>
void prefill_kernel(const T* q, const T* kv, const int64_t* tables, const int64_t* qsl, const int64_t* seq_lens,
                    T* out, int64_t N, int64_t H, int64_t KVH, int64_t D, int64_t num_blocks, int64_t block_size,
                    int64_t max_blocks, float scale, int64_t window, float softcap) {
  const int64_t g = H / KVH;
  const int64_t row = KVH * D;                            // elements per token slot
  const int64_t v_offset = num_blocks * block_size * row;  // kv[1] starts here
  const std::vector<Item> items = plan(qsl, seq_lens, N, KVH, kRows / g, window);
  llmserve_pieces::parallel_single_items(static_cast<int64_t>(items.size()), [&](llmserve_pieces::Pieces& pieces) {
    Tile t{0, {}, {}, {}, {}, std::vector<float>(kKeyTile * kRows), std::vector<float>(D * kRows)};
    Math math;
    const T* q_rows[kRows];
    const T* keys[kKeyTile];
    const T* values[kKeyTile];
    for (int64_t idx; pieces.take(idx);) {
      const Item& it = items[idx];
      const int64_t ctx = seq_lens[it.seq] - (qsl[it.seq + 1] - qsl[it.seq]);
      const int64_t* table = tables + it.seq * max_blocks;
      t.rows = (it.q1 - it.q0) * g;
      for (int64_t r = 0; r < kRows; ++r) {
        t.qpos[r] = r < t.rows ? static_cast<int32_t>(ctx + it.q0 + r / g) : -1;
        t.m[r] = kNegInf;
        t.l[r] = 0.f;
        if (r < t.rows) q_rows[r] = q + ((qsl[it.seq] + it.q0 + r / g) * H + it.kv_head * g + r % g) * D;
      }
      math.load_queries(q_rows, t.rows, D);
      std::fill(t.o.begin(), t.o.end(), 0.f);
      for (int64_t k0 = it.k0; k0 < it.k1; k0 += kKeyTile) {
        const int64_t nk = std::min(kKeyTile, it.k1 - k0);
        for (int64_t k = 0; k < nk; ++k) {
          const int64_t p = k0 + k;
          const T* slot = kv + (table[p / block_size] * block_size + p % block_size) * row + it.kv_head * D;
          keys[k] = slot;
          values[k] = slot + v_offset;
        }
        math.scores(keys, nk, D, scale, t.s.data());
#if defined(__AVX512F__)
        if (softcap == 0.f)
          softmax_tile_avx512(t, k0, nk, window);
        else
#endif
          softmax_tile(t, k0, nk, window, softcap);
        math.accumulate(values, nk, D, t.s.data(), t.alpha, t.o.data());
      }
      for (int64_t r = 0; r < t.rows; ++r) {
        T* o = out + (q_rows[r] - q);
        const float inv = 1.f / t.l[r];  // every query sees at least its own key
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(t.o[d * kRows + r] * inv);
      }
    }
  });
}

bool prefill_bf16_dot_supported() { return LLMSERVE_PREFILL_BF16 == 1; }

at::Tensor paged_attention_prefill(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& tables,
                                   const at::Tensor& qsl, const at::Tensor& seq_lens, double scale, int64_t window,
                                   double softcap) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(0) == 2, "bad shapes");
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous() && tables.is_contiguous() && qsl.is_contiguous() &&
                  seq_lens.is_contiguous(),
              "inputs must be contiguous");
  TORCH_CHECK(tables.scalar_type() == at::kLong && qsl.scalar_type() == at::kLong &&
                  seq_lens.scalar_type() == at::kLong,
              "int64 tables, query starts and lengths");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q and kv_cache dtypes differ");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
  const int64_t N = seq_lens.size(0), H = q.size(1), D = q.size(2), KVH = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D && H % KVH == 0, "head dims do not match");
  TORCH_CHECK(H / KVH <= kRows, "at most ", kRows, " query heads per KV head");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == N && qsl.size(0) == N + 1,
              "one table row and length per sequence");
  const int64_t* starts = qsl.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[N] == q.size(0), "query starts must cover q's rows");
  for (int64_t n = 0; n < N; ++n)
    TORCH_CHECK(starts[n + 1] >= starts[n] && lens[n] >= starts[n + 1] - starts[n] &&
                    (lens[n] + kv_cache.size(2) - 1) / kv_cache.size(2) <= tables.size(1),
                "sequence ", n, ": bad query range, length or block table");
  auto out = at::empty_like(q);
  auto run = [&](auto kernel, auto* data) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(data)>>;
    kernel(q.data_ptr<T>(), kv_cache.data_ptr<T>(), tables.data_ptr<int64_t>(), starts, lens, out.data_ptr<T>(), N, H,
           KVH, D, kv_cache.size(1), kv_cache.size(2), tables.size(1), static_cast<float>(scale), window,
           static_cast<float>(softcap));
  };
  if (q.scalar_type() == at::kFloat) {
    run(prefill_kernel<float, FloatMath<float>>, static_cast<float*>(nullptr));
    return out;
  }
#if LLMSERVE_PREFILL_BF16 && LLMSERVE_AMX
  if (D % 32 == 0 && D <= AmxBf16Math::kMaxD && llmserve_amx::usable()) {
    run(prefill_kernel<c10::BFloat16, AmxBf16Math>, static_cast<c10::BFloat16*>(nullptr));
    return out;
  }
#endif
#if LLMSERVE_PREFILL_BF16
  if (D % 32 == 0) {
    run(prefill_kernel<c10::BFloat16, Bf16Math>, static_cast<c10::BFloat16*>(nullptr));
    return out;
  }
#endif
  run(prefill_kernel<c10::BFloat16, FloatMath<c10::BFloat16>>, static_cast<c10::BFloat16*>(nullptr));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.def("prefill_bf16_dot_supported() -> bool", &prefill_bf16_dot_supported);  // no tensor to dispatch on
  m.def("paged_attention_prefill(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, float scale, int window, float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve_cpu, CPU, m) {
  m.impl("paged_attention_prefill", &paged_attention_prefill);
}
