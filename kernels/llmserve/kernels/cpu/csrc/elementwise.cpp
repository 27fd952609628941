// Fused element-wise ops of a decoder layer on CPU. Each replaces a chain of 3-6 torch
// ops (each a full pass over the activations plus a dispatch) with one pass.
//
//   rms_norm(x [T, H], w [H], eps)                -> w * (x * rsqrt(mean(x^2) + eps))
//   fused_add_rms_norm_(x, residual, w, eps)      in place: residual += x; x = rms_norm(residual)
//   silu_and_mul(x [T, 2d])                       -> silu(x[:, :d]) * x[:, d:]   [T, d]
//   rotary_neox_(x [T, >= heads*D], cos, sin [T, D/2], heads, D)
//                                                 in place on the first `heads` heads of each row:
//                                                 [x1 | x2] -> [x1 cos - x2 sin | x2 cos + x1 sin]
//
// Arithmetic follows the torch reference op by op: statistics in float32, and for
// 16-bit inputs every intermediate the reference materialises is rounded to the input
// dtype (`round_to<T>`), so bfloat16 results match the torch path bit for bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <type_traits>

#include "rotary_math.h"
#include "vec_math.h"

namespace {

using llmserve_vec::round_to;

// Rows per task: keep small (decode) batches on one thread, where a fork costs more
// than the work.
inline int64_t row_grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

// One row's norm 16 lanes at a time, with the scalar loop's roundings (float32 and
// bfloat16 on AVX-512; returns false where it does not apply). The sum of squares goes
// by 16 lanes, then across them: another order than the scalar loop's (float32 sums,
// so a last-bit difference at most, inside what torch's own reduction order differs by).
// `s` [H] holds the row's values (x, or x + residual as rounded) between the passes.
template <typename T>
inline bool rms_norm_row16(const T* xr, T* o, T* rr, const T* w, float* s, int64_t H, float eps) {
#if defined(__AVX512F__)
  using namespace llmserve_vec;
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    constexpr bool kBf16 = std::is_same_v<T, c10::BFloat16>;
    const auto load = [](const T* p) { return kBf16 ? load_bf16(p) : _mm512_loadu_ps(reinterpret_cast<const float*>(p)); };
    const auto store = [](T* p, __m512 v) {  // (bfloat16: rounded as stored)
      if constexpr (kBf16) {
        store_bf16(p, v);
      } else {
        _mm512_storeu_ps(reinterpret_cast<float*>(p), v);
      }
    };
    const auto rounded = [](__m512 v) { return kBf16 ? round_bf16(v) : v; };
    const int64_t n = H - H % 16;
    __m512 sq16 = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      __m512 v = load(xr + i);
      if (rr != nullptr) {  // s = x + residual, stored back as the new residual
        v = rounded(_mm512_add_ps(v, load(rr + i)));
        store(rr + i, v);
      }
      _mm512_storeu_ps(s + i, v);
      sq16 = _mm512_fmadd_ps(v, v, sq16);
    }
    float sq = _mm512_reduce_add_ps(sq16);
    for (int64_t i = n; i < H; ++i) {
      float v = static_cast<float>(xr[i]);
      if (rr != nullptr) {
        v = round_to<T>(v + static_cast<float>(rr[i]));
        rr[i] = static_cast<T>(v);
      }
      s[i] = v;
      sq += v * v;
    }
    const float inv = 1.f / std::sqrt(sq / static_cast<float>(H) + eps);
    const __m512 inv16 = _mm512_set1_ps(inv);
    for (int64_t i = 0; i < n; i += 16)
      store(o + i, _mm512_mul_ps(load(w + i), rounded(_mm512_mul_ps(_mm512_loadu_ps(s + i), inv16))));
    for (int64_t i = n; i < H; ++i) o[i] = static_cast<T>(static_cast<float>(w[i]) * round_to<T>(s[i] * inv));
    return true;
  }
#endif
  return false;
}

// NOTE: the vector path was measured against GCC's own vectorisation of the scalar loop
// (-ffast-math): on the 2-core Xeon (AMX host), [512, 576] bfloat16 with the residual
// add, 90 / 124 / 124 -> 103 / 71 / 79 us (alternating, the host's spread); the float
// roundings, not the arithmetic, cost most (see vec_math.h's narrow_bf16).
template <typename T>
void rms_norm_rows(const T* x, T* out, T* residual, const T* w, int64_t rows, int64_t H, int64_t x_stride,
                   float eps) {
  at::parallel_for(0, rows, row_grain(H), [&](int64_t begin, int64_t end) {
    std::vector<float> s(H);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      T* rr = residual != nullptr ? residual + r * H : nullptr;
      if (rms_norm_row16<T>(xr, out + r * H, rr, w, s.data(), H, eps)) continue;
      float sq = 0.f;
      if (rr != nullptr) {  // s = x + residual, stored back as the new residual
        for (int64_t i = 0; i < H; ++i) {
          const float v = round_to<T>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
          rr[i] = static_cast<T>(v);
          s[i] = v;
          sq += v * v;
        }
      } else {
        for (int64_t i = 0; i < H; ++i) {
          const float v = static_cast<float>(xr[i]);
          s[i] = v;
          sq += v * v;
        }
      }
      const float inv = 1.f / std::sqrt(sq / static_cast<float>(H) + eps);
      T* o = out + r * H;
      for (int64_t i = 0; i < H; ++i) o[i] = static_cast<T>(static_cast<float>(w[i]) * round_to<T>(s[i] * inv));
    }
  });
}

void check_norm_args(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && x.size(1) == w.size(0), "rms_norm: x [T, H], weight [H]");
  TORCH_CHECK(x.stride(1) == 1 && w.is_contiguous(), "rms_norm: rows of x must be contiguous");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "rms_norm: x and weight dtypes differ");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_norm_args(x, w);
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), nullptr, w.data_ptr<scalar_t>(),
                            x.size(0), x.size(1), x.stride(0), static_cast<float>(eps));
  });
  return out;
}

void fused_add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps) {
  check_norm_args(x, w);
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && residual.sizes() == x.sizes() &&
                  residual.scalar_type() == x.scalar_type(),
              "fused_add_rms_norm: x and residual must be contiguous [T, H] of one dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_add_rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(),
                            w.data_ptr<scalar_t>(), x.size(0), x.size(1), x.size(1), static_cast<float>(eps));
  });
}

// The first multiple of 16 of a row's d outputs, 16 lanes at a time, with the scalar
// loop's roundings (float32 and bfloat16 on AVX-512; returns how many it did). Against the
// scalar loop on the 2-core Xeon (AMX host), [512, 2 x 1536], three alternating pairs:
// bfloat16 417 / 455 / 364 -> 317 / 379 / 310 us, float32 342 / 324 / 310 -> 216 / 318 /
// 197 us; at 64 rows within noise. (vec_math.h's silu: where it differs from torch's.)
template <typename T>
inline int64_t silu_and_mul_row16(const T* gate, const T* up, T* out, int64_t d) {
#if defined(__AVX512F__)
  using namespace llmserve_vec;
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    constexpr bool kBf16 = std::is_same_v<T, c10::BFloat16>;
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) {
      const __m512 g = kBf16 ? load_bf16(gate + i) : _mm512_loadu_ps(reinterpret_cast<const float*>(gate + i));
      const __m512 u = kBf16 ? load_bf16(up + i) : _mm512_loadu_ps(reinterpret_cast<const float*>(up + i));
      const __m512 act = silu(g);
      if constexpr (kBf16) {
        store_bf16(out + i, _mm512_mul_ps(round_bf16(act), u));  // (stores round)
      } else {
        _mm512_storeu_ps(reinterpret_cast<float*>(out + i), _mm512_mul_ps(act, u));
      }
    }
    return i;
  }
#endif
  return 0;
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && x.stride(1) == 1, "silu_and_mul: x [T, 2d], rows contiguous");
  const int64_t T = x.size(0), d = x.size(1) / 2, stride = x.stride(0);
  auto out = at::empty({T, d}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, row_grain(2 * d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = in + r * stride;
        const scalar_t* up = gate + d;
        scalar_t* orow = o + r * d;
        const int64_t vectorized = silu_and_mul_row16<scalar_t>(gate, up, orow, d);
        for (int64_t i = vectorized; i < d; ++i) {
          const float g = static_cast<float>(gate[i]);
          const float act = round_to<scalar_t>(g / (1.f + std::exp(-g)));
          orow[i] = static_cast<scalar_t>(act * static_cast<float>(up[i]));
        }
      }
    });
  });
  return out;
}

void rotary_neox_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t head_dim) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) >= heads * head_dim, "rotary: x [T, >= heads * D]");
  TORCH_CHECK(head_dim % 2 == 0, "rotary: even head_dim");
  const int64_t T = x.size(0), half = head_dim / 2, stride = x.stride(0);
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == T && cos.size(1) == half && cos.is_contiguous() &&
                  sin.sizes() == cos.sizes() && sin.is_contiguous(),
              "rotary: cos/sin [T, D/2] contiguous");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary: cos/sin dtype must match x");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_neox", [&] {
    scalar_t* base = x.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    at::parallel_for(0, T, row_grain(heads * head_dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        llmserve_rotary::rotate_heads(base + t * stride, cp + t * half, sp + t * half, heads, half, head_dim);
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary_neox_(Tensor(a!) x, Tensor cos, Tensor sin, int heads, int head_dim) -> ()");
}

TORCH_LIBRARY_IMPL(llmserve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm_", &fused_add_rms_norm_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_neox_", &rotary_neox_);
}
