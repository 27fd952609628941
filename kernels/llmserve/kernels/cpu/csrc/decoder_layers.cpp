// A CPU step's decoder layers in one call: the loop over layers, and each layer's eight
// ops, in C++ instead of Python.
//
//   decoder_layers(hidden [T, E], residual [T, E] or None, cos, sin [T, (1,) R/2],
//                  kv_caches[L] [2, NB, BS, KVH, D], slot_mapping [T],
//                  num_decodes B, decode_tables [B, MB], decode_lens [B],
//                  prefill_tables [P, MB'], prefill_query_start [P + 1], prefill_lens [P],
//                  norms[2L] [E], weights[4L], extras[4L], biases[4L], kinds[4L],
//                  H, KVH, D, eps, scale, windows[L], softcap) -> (hidden [T, E], residual [T, E])
//
// Rows 0..B-1 are decodes (one new token each), rows B..T-1 the prefill rows of P
// sequences (attention_backend's TorchPagedMetadata; the prefill arguments are None when
// P = 0). Per layer, exactly the eager path's ops in its order (models/decoder.py,
// attention/torch_paged.py), so the result is bit for bit the same:
//   hidden, residual = add_rms_norm(hidden, residual)       (rms_norm alone at the first layer)
//   qkv = qkv_proj(hidden); rotate q, k; store k, v at slot_mapping   [T, (H + 2 KVH) D]
//   o = paged_attention_decode(q[:B]) ++ paged_attention_prefill(q[B:])   [T, H, D]
//   hidden, residual = add_rms_norm(o_proj(o), residual)
//   hidden = down_proj(silu_and_mul(gate_up_proj(hidden)))
// Projection i (qkv, o, gate_up, down of each layer) multiplies as kinds[i] says:
//   0 W8A8 int8 (weights: w8a8_pack_weight's, extras: w_scale), 1 our tiles
//   (bf16_pack_weight's or f32_pack_weight's, by the activations' dtype), 2 oneDNN's
//   packed layout, 3 MKL's packed sgemm (extras: the [out, in] stand-in _mkl_linear
//   takes), 4 dense [out, in] (aten::linear), 5 (gate_up only) our bfloat16 tiles with
//   the gate and up blocks interleaved: bf16_linear_silu_mul gives silu_and_mul's result
//   in the product (the same bits). biases: empty for none; added as linear.py
//   does (inside the product for the column-parallel qkv and gate_up, after it for o and
//   down).
//
// Why: an eager step of a 30-layer model is ~270 op calls from Python, each through the
// layers' modules and torch's Python bindings. On a 2-core Zen 5, SmolLM2-135M decode at
// batch 1 took 5.6 ms a step in int8 W8A8 and 9.0 ms in bfloat16 that way, 3.9 and 6.5 ms
// with this loop (the same process, taking turns). Here each op is a call through the
// dispatcher (typed: no boxing) from one C++ loop.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

namespace {

enum ProjectionKind : int64_t { kW8A8 = 0, kTiles = 1, kOneDnn = 2, kMkl = 3, kDense = 4, kTilesSiluMul = 5 };

// Our ops, found once by name (their files register them; their functions are private to
// those files).
struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm =
      find("llmserve_cpu::rms_norm").typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  c10::TypedOperatorHandle<void(at::Tensor&, at::Tensor&, const at::Tensor&, double)> add_rms_norm =
      find("llmserve_cpu::fused_add_rms_norm_").typed<void(at::Tensor&, at::Tensor&, const at::Tensor&, double)>();
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_and_mul =
      find("llmserve_cpu::silu_and_mul").typed<at::Tensor(const at::Tensor&)>();
  c10::TypedOperatorHandle<void(at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&, const at::Tensor&,
                                int64_t, int64_t, int64_t)>
      rotary_and_write_kv =
          find("llmserve_cpu::rotary_and_write_kv_")
              .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&, const at::Tensor&, int64_t,
                          int64_t, int64_t)>();
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      double, int64_t, double)>
      attention = find("llmserve_cpu::paged_attention_decode")
                      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                        double, int64_t, double)>();
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, double, int64_t, double)>
      prefill_attention = find("llmserve_cpu::paged_attention_prefill")
                              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                const at::Tensor&, const at::Tensor&, double, int64_t, double)>();
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)> w8a8_linear =
      find("llmserve_cpu::w8a8_linear")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>();
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)> bf16_linear =
      find("llmserve_cpu::bf16_linear").typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>();
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&)> bf16_linear_silu_mul =
      find("llmserve_cpu::bf16_linear_silu_mul").typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&)> f32_linear =
      find("llmserve_cpu::f32_linear").typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();

  static c10::OperatorHandle find(const char* name) {
    return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
  }
};

const Ops& ops() {
  static const Ops instance;
  return instance;
}

// torch's own packed-weight ops (oneDNN, MKL), called boxed with the arguments
// packed_weight.py gives them from Python. NOTE: looked up on first use: a torch built
// without them never gets here (the worker then keeps those weights in another layout).
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w, const c10::IValue& bias) {
  static const c10::OperatorHandle op = Ops::find("mkldnn::_linear_pointwise");
  torch::jit::Stack stack{x.contiguous(), w, bias, std::string("none"), c10::List<std::optional<at::Scalar>>(),
                          std::string("")};
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

at::Tensor mkl_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& shape, const c10::IValue& bias) {
  static const c10::OperatorHandle op = Ops::find("mkl::_mkl_linear");
  const at::Tensor xc = x.contiguous();
  torch::jit::Stack stack{xc, w, shape, bias, xc.size(0)};
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

// y = x @ W.T (+ bias), rounded as the eager path rounds it (the header's comment).
at::Tensor project(const at::Tensor& x, int64_t kind, const at::Tensor& w, const at::Tensor& extra,
                   const at::Tensor& bias, bool row_parallel) {
  const bool has_bias = bias.numel() > 0;
  at::Tensor y;
  switch (kind) {
    case kW8A8:
      y = ops().w8a8_linear.call(x, w, extra, 0);
      break;
    case kTiles:
      y = x.scalar_type() == at::kFloat ? ops().f32_linear.call(x, w) : ops().bf16_linear.call(x, w, 0);
      break;
    case kOneDnn:
    case kMkl: {
      const c10::IValue inside = has_bias && !row_parallel ? c10::IValue(bias) : c10::IValue();
      y = kind == kOneDnn ? onednn_linear(x, w, inside) : mkl_linear(x, w, extra, inside);
      return has_bias && row_parallel ? y + bias : y;
    }
    case kDense:
      y = at::linear(x, w, has_bias && !row_parallel ? std::optional<at::Tensor>(bias) : std::nullopt);
      return has_bias && row_parallel ? y + bias : y;
    default:
      TORCH_CHECK(false, "decoder_layers: unknown projection kind ", kind);
  }
  return has_bias ? y + bias : y;
}

// Attention of layer l's T rows: decode rows through paged_attention_decode, prefill rows
// through paged_attention_prefill, as TorchPagedAttention.forward calls them.
struct StepAttention {
  int64_t B, H, D;
  const std::optional<at::Tensor>&decode_tables, &decode_lens, &prefill_tables, &prefill_query_start, &prefill_lens;
  double scale, softcap;

  at::Tensor operator()(const at::Tensor& qkv, const at::Tensor& cache, int64_t window) const {
    const int64_t T = qkv.size(0);
    const at::Tensor q = qkv.narrow(1, 0, H * D).view({T, H, D});  // rows at qkv's stride
    const Ops& op = ops();
    if (B == T) {
      return op.attention.call(q, cache, *decode_tables, *decode_lens, scale, window, softcap);
    }
    at::Tensor out = at::empty_like(q);
    if (B > 0) {
      out.narrow(0, 0, B).copy_(
          op.attention.call(q.narrow(0, 0, B), cache, *decode_tables, *decode_lens, scale, window, softcap));
    }
    out.narrow(0, B, T - B)
        .copy_(op.prefill_attention.call(q.narrow(0, B, T - B).contiguous(), cache, *prefill_tables,
                                         *prefill_query_start, *prefill_lens, scale, window, softcap));
    return out;
  }
};

std::tuple<at::Tensor, at::Tensor> decoder_layers(
    const at::Tensor& hidden_in, const std::optional<at::Tensor>& residual_in, const at::Tensor& cos,
    const at::Tensor& sin, at::TensorList kv_caches, const at::Tensor& slot_mapping, int64_t num_decodes,
    const std::optional<at::Tensor>& decode_tables, const std::optional<at::Tensor>& decode_lens,
    const std::optional<at::Tensor>& prefill_tables,
    const std::optional<at::Tensor>& prefill_query_start, const std::optional<at::Tensor>& prefill_lens,
    at::TensorList norms, at::TensorList weights, at::TensorList extras, at::TensorList biases,
    at::IntArrayRef kinds, int64_t H, int64_t KVH, int64_t D, double eps, double scale, at::IntArrayRef windows,
    double softcap) {
  const int64_t L = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(hidden_in.dim() == 2, "decoder_layers: hidden must be [T, hidden_size]");
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * L && static_cast<int64_t>(weights.size()) == 4 * L &&
                  static_cast<int64_t>(extras.size()) == 4 * L && static_cast<int64_t>(biases.size()) == 4 * L &&
                  static_cast<int64_t>(kinds.size()) == 4 * L && static_cast<int64_t>(windows.size()) == L,
              "decoder_layers: ", L, " KV caches need 2 norms, 4 weights, extras, biases and kinds per layer and ",
              "one window each");
  const int64_t T = hidden_in.size(0);
  TORCH_CHECK(num_decodes >= 0 && num_decodes <= T, "decoder_layers: ", num_decodes, " decodes of ", T, " rows");
  TORCH_CHECK(num_decodes == 0 || (decode_tables && decode_lens),
              "decoder_layers: decode rows need their block tables and lengths");
  TORCH_CHECK(num_decodes == T || (prefill_tables && prefill_query_start && prefill_lens),
              "decoder_layers: prefill rows need their block tables, query starts and lengths");
  const Ops& op = ops();
  const StepAttention attention{num_decodes,  H,     D,       decode_tables, decode_lens, prefill_tables,
                                prefill_query_start, prefill_lens, scale, softcap};
  at::Tensor hidden = hidden_in;
  at::Tensor residual = residual_in.has_value() ? *residual_in : at::Tensor();
  for (int64_t l = 0; l < L; ++l) {
    at::Tensor cache = kv_caches[l];
    const int64_t p = 4 * l;
    if (!residual.defined()) {
      residual = hidden;
      hidden = op.rms_norm.call(hidden, norms[2 * l], eps);
    } else {
      op.add_rms_norm.call(hidden, residual, norms[2 * l], eps);
    }
    at::Tensor qkv = project(hidden, kinds[p], weights[p], extras[p], biases[p], false);
    op.rotary_and_write_kv.call(qkv, cos, sin, cache, slot_mapping, H, KVH, D);
    const at::Tensor o = attention(qkv, cache, windows[l]);
    hidden = project(o.view({T, H * D}), kinds[p + 1], weights[p + 1], extras[p + 1], biases[p + 1], true);
    op.add_rms_norm.call(hidden, residual, norms[2 * l + 1], eps);
    const at::Tensor act =
        kinds[p + 2] == kTilesSiluMul
            ? op.bf16_linear_silu_mul.call(hidden, weights[p + 2])
            : op.silu_and_mul.call(project(hidden, kinds[p + 2], weights[p + 2], extras[p + 2], biases[p + 2], false));
    hidden = project(act, kinds[p + 3], weights[p + 3], extras[p + 3], biases[p + 3], true);
  }
  return {hidden, residual};
}

}  // namespace

// A composite of other ops (registered for every backend: oneDNN's and MKL's packed
// weights are tensors of another dispatch key than CPU).
TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.def(
      "decoder_layers(Tensor(a!) hidden, Tensor(b!)? residual, Tensor cos, Tensor sin, Tensor(c!)[] kv_caches, "
      "Tensor slot_mapping, int num_decodes, Tensor? decode_tables, Tensor? decode_lens, Tensor? prefill_tables, "
      "Tensor? prefill_query_start, Tensor? prefill_lens, Tensor[] norms, Tensor[] weights, Tensor[] extras, "
      "Tensor[] biases, int[] kinds, int num_heads, int num_kv_heads, int head_dim, float eps, float scale, "
      "int[] windows, float softcap) -> (Tensor, Tensor)",
      &decoder_layers);
}
