// Paged attention for decode on CPU: one query token per sequence, keys and values
// read in place from the paged KV cache through the block table (no gather copy).
//
//   q        [B, H, D]                     one query per sequence (rows at any stride)
//   kv_cache [2, num_blocks, block_size, KVH, D]
//   tables   [B, max_blocks] int64         physical block of each logical block
//   seq_lens [B] int64                     tokens of context (incl. the new one)
//   window   W > 0: attend to the last W keys only (0 = all)
//   softcap  c > 0: scores -> c * tanh(scores / c) before the softmax (0 = off)
//   out      [B, H, D]
//
// With a window, a row's work starts at the block holding its first visible key
// (position len - W) and skips that block's earlier rows: blocks wholly before the
// window are never read (the scheduler may have freed them). Scores are indexed from
// the start of that block:
//
//   len 11, W 6, block 4:  | 0 1 2 3 | 4 5 6 7 | 8 9 10 . |
//                                      ^ blk0 = 1, base = 4; start = 5 (skip 1 row): keys 5..10
//
// Work item = one sequence, all its heads (when there are enough sequences; fewer than 2
// per thread: one sequence and KV head, and where that still loads the threads unevenly,
// e.g. one sequence's 3 KV heads on 2 threads, each sequence's keys are also cut into
// chunks whose partial softmax sums are merged at the end, see key_chunks). A block's K
// (and V) for all KV heads is one contiguous run of block_size * KVH * D elements, so each is streamed front to back
// once per step; per-head work items would read it as 256-byte pieces at a KVH-fold
// stride, which the hardware prefetchers turn into wasted bandwidth. While a block is
// processed, the next block's lines are prefetched a line or two per row computed (blocks are
// scattered in memory, so the streamers cannot guess them; issuing a whole block's
// lines at once overflows the miss queues). Two passes: scores for all positions, then a
// softmax-weighted sum of V; the g = H / KVH query heads of a KV head share each row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "shared_pieces.h"

namespace {

// Touches the cache lines of `bytes` bytes from p (read, keep in L2).
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 2);
}

// The next block's first rows as a run of cache lines, prefetched a line or two at a time
// from inside the block math's row loops (`issue`), the rest at the block's end.
// NOTE: the same lines issued a call's share at a time (12 back to back before each query
// head's 16 rows) left the core waiting on full miss queues: on the 2-core Intel Xeon
// (AMX host), bfloat16, 30 layers' caches cycled, 1.00-1.07x faster spread (medians of
// 9 alternating rounds: 64 x 256 1.04, 16 x 512 1.07, 4 x 1024 1.04, 64 x 128 1.00).
struct LinePrefetch {
  const char* at = nullptr;
  int64_t lines = 0;
  inline void issue(int64_t k) {
    for (int64_t i = 0; i < k && lines > 0; ++i, --lines, at += 64) __builtin_prefetch(at, 0, 2);
  }
  inline void issue_rest() { issue(lines); }
};

// The rows [n, block_size) of the block at p: the part of the next block that a
// current block of only n tokens does not prefetch row by row.
template <typename T>
inline void prefetch_rows(const T* p, int64_t n, int64_t block_size, int64_t row) {
  if (n < block_size) prefetch_bytes(p + n * row, (block_size - n) * row * sizeof(T));
}

#if defined(__AVX512F__)
// Register-tiled block math for float32 and bfloat16 with D = 64 or 128 on AVX-512: one
// block of a KV head at a time, its rows read from L1 by each query head that shares
// them (the block came in from memory once).
//   scores: 16 rows' dot products stay 16 vectors until one transpose-and-add network
//           (~3 instructions a row) sums each to its lane of one result vector, where a
//           horizontal sum per score costs ~8.
//   values: the weighted sums of up to `kValueHeads` query heads stay in registers over
//           the block's rows (each V row widened once for all of them), where the
//           row-at-a-time path loads and stores a head's accumulator for every row.
// Measured on the 2-core AMD EPYC (Zen 4, AVX-512 BF16), batch 64 x 256 tokens, 9 heads
// over 3 KV heads of 64, one layer: bfloat16 0.62 -> 0.28 ms (blocks spread over 258 MB:
// 0.68 -> 0.33 ms); float32 unchanged at ~0.7-0.8 ms, already bound by memory bandwidth.
template <typename T>
inline __m512 load16(const T* p);
template <>
inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// r[t] = sum of the 16 lanes of a[t], t < 16.
inline __m512 sum_lanes16(__m512 (&a)[16]) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit group: [a0+a2, b0+b2, a1+a3, b1+b3] of rows 2i, 2i+1
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit group: rows 4i..4i+3, each its group's sum
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // Add the 4 groups: group k of the result holds rows 4k..4k+3.
  const __m512 e01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 e23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e01, e23, 0x88), _mm512_shuffle_f32x4(e01, e23, 0xDD));
}

template <typename T, int64_t D>
struct TiledMath {
  static constexpr int kValueHeads = D == 64 ? 5 : 2;  // accumulators: heads x D/16 <= 20 registers

  // One query head's 16-lane partial products with row k (summed by sum_lanes16).
  // bfloat16 with AVX-512 BF16: VDPBF16PS on q as stored (a bf16 x bf16 product is exact
  // in float); otherwise q in float (qf) times the row widened to float.
  static inline __m512 partial_dot(const T* q, const float* qf, const T* k) {
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(k + d));
      return acc;
    }
#endif
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qf + d), load16<T>(k + d), acc);
    return acc;
  }

  // out[t] = scale * q . k_t for the n <= 16 rows k_t = k0 + t * row; a line of pf a row.
  static inline void scores16(const T* q, const float* qf, const T* k0, int64_t row, int64_t n, float scale,
                              float* out, LinePrefetch& pf) {
    __m512 a[16];
    for (int t = 0; t < 16; ++t) {
      pf.issue(1);
      a[t] = t < n ? partial_dot(q, qf, k0 + t * row) : _mm512_setzero_ps();
    }
    const __m512 r = _mm512_mul_ps(sum_lanes16(a), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << n) - 1), r);
  }

  // acc[j] += sum_t w[j][t] * v_t for HEADS query heads j (acc[j] = acc0 + j * D, w[j] =
  // w0 + j * w_stride) and the n rows v_t = v0 + t * row; two lines of pf a row.
  template <int HEADS>
  static inline void weighted_rows(const float* w0, int64_t w_stride, const T* v0, int64_t row, int64_t n,
                                   float* acc0, LinePrefetch& pf) {
    constexpr int C = D / 16;
    __m512 acc[HEADS][C];
    for (int j = 0; j < HEADS; ++j)
      for (int c = 0; c < C; ++c) acc[j][c] = _mm512_loadu_ps(acc0 + j * D + 16 * c);
    for (int64_t t = 0; t < n; ++t) {
      pf.issue(2);
      __m512 v[C];
      for (int c = 0; c < C; ++c) v[c] = load16<T>(v0 + t * row + 16 * c);
      for (int j = 0; j < HEADS; ++j) {
        const __m512 w = _mm512_set1_ps(w0[j * w_stride + t]);
        for (int c = 0; c < C; ++c) acc[j][c] = _mm512_fmadd_ps(w, v[c], acc[j][c]);
      }
    }
    for (int j = 0; j < HEADS; ++j)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc0 + j * D + 16 * c, acc[j][c]);
  }

  // The g query heads of one KV head, in groups of at most kValueHeads.
  static inline void weighted_rows_all(const float* w0, int64_t w_stride, const T* v0, int64_t row, int64_t n,
                                       float* acc0, int64_t g, LinePrefetch& pf) {
    int64_t j = 0;
    for (; j + kValueHeads <= g; j += kValueHeads)
      weighted_rows<kValueHeads>(w0 + j * w_stride, w_stride, v0, row, n, acc0 + j * D, pf);
    switch (g - j) {
      case 4: weighted_rows<4>(w0 + j * w_stride, w_stride, v0, row, n, acc0 + j * D, pf); break;
      case 3: weighted_rows<3>(w0 + j * w_stride, w_stride, v0, row, n, acc0 + j * D, pf); break;
      case 2: weighted_rows<2>(w0 + j * w_stride, w_stride, v0, row, n, acc0 + j * D, pf); break;
      case 1: weighted_rows<1>(w0 + j * w_stride, w_stride, v0, row, n, acc0 + j * D, pf); break;
      default: break;
    }
  }
};

template <typename T, int64_t D>
constexpr bool kTiled = (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) && (D == 64 || D == 128);
#else
template <typename T, int64_t D>
constexpr bool kTiled = false;
#endif

// The block holding a row's first visible key: 0 without a window.
inline int64_t first_block(int64_t len, int64_t window, int64_t block_size) {
  return window > 0 ? std::max<int64_t>(0, len - window) / block_size : 0;
}

// How many chunks to cut each sequence's keys into, so that `items` work items (one per
// sequence, or per sequence and KV head) keep `threads` threads evenly busy (flash-
// decoding): with c chunks a thread's share is ceil(items * c / threads) / c items' work;
// the smallest share wins, the fewest chunks on a tie. A chunk spans at least 2 blocks of
// the longest sequence's visible keys, and there are at most 8. One sequence with 3 KV
// heads on 2 threads: c = 2 (3 + 3 half-heads, 1.5 heads of work each, not 2 + 1).
inline int64_t key_chunks(int64_t items, int64_t threads, int64_t longest_visible_blocks) {
  const int64_t most = std::clamp<int64_t>(longest_visible_blocks / 2, 1, 8);
  int64_t best = 1;
  int64_t best_units = (items + threads - 1) / threads;  // the share is units / c chunk-sized pieces
  for (int64_t c = 2; c <= most; ++c) {
    const int64_t units = (items * c + threads - 1) / threads;
    if (units * best < best_units * c) best = c, best_units = units;
  }
  return best;
}

// HEAD_DIM > 0 fixes the head size at compile time (fully unrolled inner loops);
// 0 reads it from `head_dim`.
template <typename T, int64_t HEAD_DIM>
void decode_kernel(const T* q, const T* kv, const int64_t* tables, const int64_t* seq_lens, T* out,
                   int64_t B, int64_t H, int64_t KVH, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                   int64_t max_blocks, float scale, int64_t window, float softcap, int64_t q_stride) {
  const int64_t D = HEAD_DIM > 0 ? HEAD_DIM : head_dim;
  const int64_t g = H / KVH;
  const int64_t row = KVH * D;                            // elements per token slot
  const int64_t v_offset = num_blocks * block_size * row;  // kv[1] starts here
  const int64_t threads = at::get_num_threads();
  // Few sequences (a lone long decode): one item per (sequence, KV head) so every
  // thread has work, at the cost of the strided reads described above.
  const int64_t splits = B < 2 * threads ? KVH : 1;
  const int64_t heads_per_item = KVH / splits;
  int64_t longest = 0;  // visible blocks of the longest sequence
  for (int64_t b = 0; b < B; ++b)
    longest = std::max(longest, (seq_lens[b] + block_size - 1) / block_size - first_block(seq_lens[b], window,
                                                                                              block_size));
  const int64_t chunks = key_chunks(B * splits, threads, longest);
  // With chunks > 1 an item leaves its heads' unnormalized sums, score max and exp-sum
  // here, merged below: item i's query head j (of heads_per_item * g) at i * item_heads + j.
  const int64_t item_heads = heads_per_item * g;
  std::vector<float> part_acc, part_max, part_sum;
  if (chunks > 1) {
    part_acc.resize(B * splits * chunks * item_heads * D);
    part_max.resize(B * splits * chunks * item_heads);
    part_sum.resize(B * splits * chunks * item_heads);
  }
  // Items one at a time off a shared counter (sequences' lengths differ; an item is tens
  // of microseconds, taking one far less); an item's last block prefetches the first of
  // the item its thread runs next.
  llmserve_pieces::parallel_single_items(B * splits * chunks, [&](llmserve_pieces::Pieces& pieces) {
    std::vector<float> qf(H * D), acc(H * D), scores;
    llmserve_pieces::Walk walk(pieces);
    for (int64_t item, ahead; walk.next(item, ahead);) {
      const int64_t chunk = item % chunks, b = item / chunks / splits;
      const int64_t kh0 = (item / chunks % splits) * heads_per_item, kh1 = kh0 + heads_per_item;
      const int64_t len = seq_lens[b];
      const int64_t* table = tables + b * max_blocks;
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;  // first visible key
      const int64_t blk0 = start / block_size, n_blocks = (len + block_size - 1) / block_size;
      // This item's blocks [lo, hi): its share of the visible ones.
      const int64_t lo = blk0 + (n_blocks - blk0) * chunk / chunks;
      const int64_t hi = blk0 + (n_blocks - blk0) * (chunk + 1) / chunks;
      float* p_acc = chunks > 1 ? part_acc.data() + item * item_heads * D : nullptr;
      if (lo == hi) {  // (more chunks than this short sequence has blocks): weight 0 in the merge
        if (chunks > 1) std::fill(part_sum.begin() + item * item_heads, part_sum.begin() + (item + 1) * item_heads, 0.f);
        continue;
      }
      const int64_t base = lo * block_size;  // scores kept per head: keys base..min(len, hi * block_size)-1
      const int64_t span = std::min(len, hi * block_size) - base;
      scores.assign(H * span, 0.f);
      const T* qb = q + b * q_stride;
      // The tiled path scales each score; the row-at-a-time path scales q once.
      const float q_scale = kTiled<T, HEAD_DIM> ? 1.f : scale;
      for (int64_t i = kh0 * g * D; i < kh1 * g * D; ++i) qf[i] = static_cast<float>(qb[i]) * q_scale;
      // Pass 1: scores[h][p - base] = q_h . k_p (h over the item's query heads, k of its KV head).
      for (int64_t blk = lo; blk < hi; ++blk) {
        // Rows t0..n-1 of this block are keys in the window; `first` indexes their scores.
        const T* blk_ptr = kv + table[blk] * block_size * row;
        // What this pass reads next: the following K block, or the first V block.
        const T* next = blk + 1 < hi ? kv + table[blk + 1] * block_size * row
                                     : kv + v_offset + table[lo] * block_size * row;
        const int64_t first = blk * block_size - base, n = std::min(block_size, len - blk * block_size);
        const int64_t t0 = std::max<int64_t>(0, start - blk * block_size);
        prefetch_rows(next, n, block_size, row);
#if defined(__AVX512F__)
        if constexpr (kTiled<T, HEAD_DIM>) {
          // One call per (KV head, query head), the next block's rows prefetched as they go.
          LinePrefetch pf{reinterpret_cast<const char*>(next), (n * row * static_cast<int64_t>(sizeof(T)) + 63) / 64};
          for (int64_t kh = kh0; kh < kh1; ++kh) {
            for (int64_t j = 0; j < g; ++j) {
              const int64_t h = kh * g + j;
              for (int64_t c0 = t0; c0 < n; c0 += 16) {
                TiledMath<T, HEAD_DIM>::scores16(qb + h * D, qf.data() + h * D, blk_ptr + c0 * row + kh * D, row,
                                                 std::min<int64_t>(16, n - c0), scale,
                                                 scores.data() + h * span + first + c0, pf);
              }
            }
          }
          pf.issue_rest();
          continue;
        }
#endif
        for (int64_t t = t0; t < n; ++t) {
          prefetch_bytes(next + t * row, row * sizeof(T));  // spread over the block's work
          for (int64_t kh = kh0; kh < kh1; ++kh) {
            const T* k = blk_ptr + t * row + kh * D;
            for (int64_t j = 0; j < g; ++j) {
              const int64_t h = kh * g + j;
              const float* qh = qf.data() + h * D;
              float s = 0.f;
              for (int64_t d = 0; d < D; ++d) s += qh[d] * static_cast<float>(k[d]);
              scores[h * span + first + t] = s;
            }
          }
        }
      }
      // Softmax per query head over the item's visible keys (skip..span-1); the rows before
      // them keep weight 0 (and are never read). A chunk keeps its weights unnormalized
      // and leaves their max and sum for the merge.
      const int64_t skip = std::max<int64_t>(0, start - base);
      for (int64_t h = kh0 * g; h < kh1 * g; ++h) {
        float* sh = scores.data() + h * span;
        if (softcap > 0.f)
          for (int64_t p = skip; p < span; ++p) sh[p] = softcap * std::tanh(sh[p] / softcap);
        const float m = *std::max_element(sh + skip, sh + span);
        float sum = 0.f;
        for (int64_t p = skip; p < span; ++p) sum += (sh[p] = std::exp(sh[p] - m));
        if (chunks > 1) {
          part_max[item * item_heads + h - kh0 * g] = m;
          part_sum[item * item_heads + h - kh0 * g] = sum;
          continue;
        }
        const float inv = 1.f / sum;
        for (int64_t p = skip; p < span; ++p) sh[p] *= inv;
      }
      // Pass 2: out_h = sum_p softmax_h[p] * v_p
      std::fill(acc.begin() + kh0 * g * D, acc.begin() + kh1 * g * D, 0.f);
      for (int64_t blk = lo; blk < hi; ++blk) {
        // As in pass 1, but rows before t0 are skipped by offsetting the block's rows.
        const int64_t t0 = std::max<int64_t>(0, start - blk * block_size);
        const int64_t n = std::min(block_size, len - blk * block_size) - t0;
        const int64_t first = blk * block_size - base + t0;
        const T* blk_ptr = kv + v_offset + table[blk] * block_size * row + t0 * row;
        // Next: the following V block, or the first K block of the sequence this thread
        // runs next (items are sequences when splits * chunks == 1).
        const T* next = blk + 1 < hi ? kv + v_offset + table[blk + 1] * block_size * row
                        : splits * chunks == 1 && ahead >= 0 && seq_lens[ahead] > 0
                            ? kv + tables[ahead * max_blocks + first_block(seq_lens[ahead], window, block_size)] *
                                       block_size * row
                            : nullptr;
        if (next != nullptr) prefetch_rows(next, n, block_size, row);
#if defined(__AVX512F__)
        if constexpr (kTiled<T, HEAD_DIM>) {
          LinePrefetch pf{reinterpret_cast<const char*>(next),
                          next != nullptr ? (n * row * static_cast<int64_t>(sizeof(T)) + 63) / 64 : 0};
          for (int64_t kh = kh0; kh < kh1; ++kh) {
            TiledMath<T, HEAD_DIM>::weighted_rows_all(scores.data() + kh * g * span + first, span, blk_ptr + kh * D,
                                                      row, n, acc.data() + kh * g * D, g, pf);
          }
          pf.issue_rest();
          continue;
        }
#endif
        for (int64_t t = 0; t < n; ++t) {
          if (next != nullptr) prefetch_bytes(next + t * row, row * sizeof(T));
          for (int64_t kh = kh0; kh < kh1; ++kh) {
            const T* v = blk_ptr + t * row + kh * D;
            for (int64_t j = 0; j < g; ++j) {
              const int64_t h = kh * g + j;
              const float w = scores[h * span + first + t];
              float* ah = acc.data() + h * D;
              for (int64_t d = 0; d < D; ++d) ah[d] += w * static_cast<float>(v[d]);
            }
          }
        }
      }
      if (chunks > 1)
        std::copy(acc.begin() + kh0 * g * D, acc.begin() + kh1 * g * D, p_acc);
      else
        for (int64_t i = kh0 * g * D; i < kh1 * g * D; ++i) out[b * H * D + i] = static_cast<T>(acc[i]);
    }
  });
  if (chunks == 1) return;
  // Merge each query head's chunks: out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) sum_c,
  // M the largest chunk max (empty chunks, sum 0, take no part).
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(D);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const int64_t first_item = (b * splits + h / item_heads) * chunks, j = h % item_heads;
      float m = std::numeric_limits<float>::lowest();
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t at = (first_item + c) * item_heads + j;
        if (part_sum[at] > 0.f) m = std::max(m, part_max[at]);
      }
      std::fill(merged.begin(), merged.end(), 0.f);
      float total = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t at = (first_item + c) * item_heads + j;
        if (part_sum[at] == 0.f) continue;
        const float w = std::exp(part_max[at] - m);
        total += w * part_sum[at];
        const float* a = part_acc.data() + at * D;
        for (int64_t d = 0; d < D; ++d) merged[d] += w * a[d];
      }
      const float inv = 1.f / total;
      for (int64_t d = 0; d < D; ++d) out[bh * D + d] = static_cast<T>(merged[d] * inv);
    }
  });
}

at::Tensor paged_attention_decode(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& tables,
                                  const at::Tensor& seq_lens, double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(0) == 2, "bad shapes");
  // q may be a view of the fused qkv projection's output: its rows at any stride, each
  // row's heads [H, D] contiguous (no copy per layer).
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && kv_cache.is_contiguous() && tables.is_contiguous() &&
                  seq_lens.is_contiguous(),
              "inputs must be contiguous (q: each row's heads)");
  TORCH_CHECK(tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 tables/lens");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q and kv_cache dtypes differ");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D && H % KVH == 0, "head dims do not match");
  TORCH_CHECK(tables.size(0) == B && seq_lens.size(0) == B, "one table row and length per sequence");
  auto out = at::empty({B, H, D}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention_decode", [&] {
    auto run = [&](auto kernel) {
      kernel(q.data_ptr<scalar_t>(), kv_cache.data_ptr<scalar_t>(), tables.data_ptr<int64_t>(),
             seq_lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B, H, KVH, D, kv_cache.size(1),
             kv_cache.size(2), tables.size(1), static_cast<float>(scale), window, static_cast<float>(softcap),
             q.stride(0));
    };
    if (D == 64) {
      run(decode_kernel<scalar_t, 64>);
    } else if (D == 128) {
      run(decode_kernel<scalar_t, 128>);
    } else {
      run(decode_kernel<scalar_t, 0>);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.def("paged_attention_decode(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, float scale, int window, float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve_cpu, CPU, m) {
  m.impl("paged_attention_decode", &paged_attention_decode);
}
