// Paged attention for decode on CPU: one query token per sequence, keys and values
// read in place from the paged KV cache through the block table (no gather copy).
//
//   q        [B, H, D]                     one query per sequence
//   kv_cache [2, num_blocks, block_size, KVH, D]
//   tables   [B, max_blocks] int64         physical block of each logical block
//   seq_lens [B] int64                     tokens of context (incl. the new one)
//   out      [B, H, D]
//
// Work item = (sequence, kv head): its g = H / KVH query heads share every K/V row
// loaded, so each K and V byte of the sequence is read once per step. Two passes:
// scores for all positions (q.k, g at a time), then a softmax-weighted sum of V.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// HEAD_DIM > 0 fixes the head size at compile time (fully unrolled inner loops);
// 0 reads it from `head_dim`.
template <typename T, int64_t HEAD_DIM>
void decode_kernel(const T* q, const T* kv, const int64_t* tables, const int64_t* seq_lens, T* out,
                   int64_t B, int64_t H, int64_t KVH, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                   int64_t max_blocks, float scale) {
  const int64_t D = HEAD_DIM > 0 ? HEAD_DIM : head_dim;
  const int64_t g = H / KVH;
  const int64_t row = KVH * D;                            // elements per token slot
  const int64_t v_offset = num_blocks * block_size * row;  // kv[1] starts here
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(g * D), acc(g * D), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, h = item % KVH;
      const int64_t len = seq_lens[b];
      scores.assign(g * len, 0.f);
      for (int64_t j = 0; j < g; ++j)
        for (int64_t d = 0; d < D; ++d)
          qf[j * D + d] = static_cast<float>(q[(b * H + h * g + j) * D + d]) * scale;
      // Pass 1: scores[j][p] = q_j . k_p, block by block (one table lookup per block).
      const int64_t n_blocks = (len + block_size - 1) / block_size;
      for (int64_t blk = 0; blk < n_blocks; ++blk) {
        const T* base = kv + tables[b * max_blocks + blk] * block_size * row + h * D;
        const int64_t first = blk * block_size, n = std::min(block_size, len - first);
        for (int64_t t = 0; t < n; ++t) {
          const T* k = base + t * row;
          for (int64_t j = 0; j < g; ++j) {
            const float* qj = qf.data() + j * D;
            float s = 0.f;
            for (int64_t d = 0; d < D; ++d) s += qj[d] * static_cast<float>(k[d]);
            scores[j * len + first + t] = s;
          }
        }
      }
      // Softmax per query head.
      for (int64_t j = 0; j < g; ++j) {
        float* sj = scores.data() + j * len;
        const float m = *std::max_element(sj, sj + len);
        float sum = 0.f;
        for (int64_t p = 0; p < len; ++p) sum += (sj[p] = std::exp(sj[p] - m));
        const float inv = 1.f / sum;
        for (int64_t p = 0; p < len; ++p) sj[p] *= inv;
      }
      // Pass 2: out_j = sum_p softmax_j[p] * v_p
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t blk = 0; blk < n_blocks; ++blk) {
        const T* base = kv + v_offset + tables[b * max_blocks + blk] * block_size * row + h * D;
        const int64_t first = blk * block_size, n = std::min(block_size, len - first);
        for (int64_t t = 0; t < n; ++t) {
          const T* v = base + t * row;
          for (int64_t j = 0; j < g; ++j) {
            const float w = scores[j * len + first + t];
            float* aj = acc.data() + j * D;
            for (int64_t d = 0; d < D; ++d) aj[d] += w * static_cast<float>(v[d]);
          }
        }
      }
      for (int64_t j = 0; j < g; ++j)
        for (int64_t d = 0; d < D; ++d)
          out[(b * H + h * g + j) * D + d] = static_cast<T>(acc[j * D + d]);
    }
  });
}

at::Tensor paged_attention_decode(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& tables,
                                  const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(0) == 2, "bad shapes");
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous() && tables.is_contiguous() && seq_lens.is_contiguous(),
              "inputs must be contiguous");
  TORCH_CHECK(tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 tables/lens");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q and kv_cache dtypes differ");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D && H % KVH == 0, "head dims do not match");
  TORCH_CHECK(tables.size(0) == B && seq_lens.size(0) == B, "one table row and length per sequence");
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention_decode", [&] {
    auto run = [&](auto kernel) {
      kernel(q.data_ptr<scalar_t>(), kv_cache.data_ptr<scalar_t>(), tables.data_ptr<int64_t>(),
             seq_lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B, H, KVH, D, kv_cache.size(1),
             kv_cache.size(2), tables.size(1), static_cast<float>(scale));
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
  m.def("paged_attention_decode(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve_cpu, CPU, m) {
  m.impl("paged_attention_decode", &paged_attention_decode);
}
