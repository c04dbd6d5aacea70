// The target's layer loop for one sequence in live mode (leanbody.py's native loop): the Python
// loop of LeanBody.__call__ op for op, over the same ATen ops, without the interpreter between
// them (on SmolLM2, AMD EPYC Zen 4, 2 cores: a forward of 1 / 6 / 16 rows took 25.3 / 26.7 / 35.4 ms
// against 34.3 / 34.3 / 46.0 for the Python loop, bitwise the same; docs/benchmarks.md).
// A change to the cache layout must change both this and engine.KVLayer.update.
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "products.h"
using at::Tensor;

static Tensor packed_linear(const Tensor& x, const Tensor& w, const Tensor* bias);

// One product by the plan's kernel (rowgemm.KERNEL_CODES): 0 oneDNN packed, 1 F.linear, 2 W @ x.T,
// 3 our streaming kernel (products.cpp).
static Tensor product(const Tensor& x, const Tensor& w, int64_t kind, const Tensor* bias) {
  if (kind == 0) return packed_linear(x, w, bias);
  if (kind == 3) return stream_linear(x, w, bias ? c10::optional<Tensor>(*bias) : c10::nullopt);
  if (kind == 1) return bias ? at::linear(x, w, *bias) : at::linear(x, w);
  auto out = at::mm(w, x.t()).t().contiguous();
  return bias ? out.add_(*bias) : out;
}

static Tensor packed_linear(const Tensor& x, const Tensor& w, const Tensor* bias) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack s;
  s.emplace_back(x);
  s.emplace_back(w);
  if (bias) s.emplace_back(*bias); else s.emplace_back(c10::IValue());
  s.emplace_back(std::string("none"));
  s.emplace_back(c10::List<c10::optional<c10::Scalar>>());
  s.emplace_back(std::string(""));
  op.callBoxed(&s);
  return s[0].toTensor();
}

// Llama's RMSNorm: torch's rms_norm in float32 (bitwise the same), the stock ops otherwise.
static Tensor rms(const Tensor& x, const Tensor& w, double eps) {
  if (x.scalar_type() == at::kFloat) return at::rms_norm(x, {x.size(-1)}, w, eps);
  auto h = x.to(at::kFloat);
  h = h * at::rsqrt(h.pow(2).mean(-1, true) + eps);
  return w * h.to(x.scalar_type());
}

Tensor layers(Tensor h, const Tensor& cos, const Tensor& sin, const Tensor& mask,
              const std::vector<Tensor>& qkv, const std::vector<Tensor>& qkv_bias, const std::vector<Tensor>& o,
              const std::vector<Tensor>& gate_up, const std::vector<Tensor>& down, const std::vector<int64_t>& kinds,
              const std::vector<Tensor>& ln1, const std::vector<Tensor>& ln2, const Tensor& norm, double eps,
              const std::vector<Tensor>& keys, const std::vector<Tensor>& values, int64_t start, int64_t view,
              int64_t nh, int64_t nkv, int64_t hd, double scaling) {
  const int64_t b = h.size(0), n = h.size(1), H = h.size(2);
  for (size_t i = 0; i < qkv.size(); ++i) {
    auto x = rms(h, ln1[i], eps).view({b * n, H});
    auto t = product(x, qkv[i], kinds[4 * i], qkv_bias.empty() ? nullptr : &qkv_bias[i]).view({b, n, nh + 2 * nkv, hd});
    auto qk = t.narrow(2, 0, nh + nkv);
    qk = qk * cos + at::roll(qk, {hd / 2}, {-1}) * sin;
    auto q = qk.narrow(2, 0, nh).transpose(1, 2);
    keys[i].narrow(2, start, n).copy_(qk.narrow(2, nh, nkv).transpose(1, 2));
    values[i].narrow(2, start, n).copy_(t.narrow(2, nh + nkv, nkv).transpose(1, 2));
    auto K = keys[i].narrow(2, 0, view), V = values[i].narrow(2, 0, view);
    Tensor a = (n == 1 && nkv < nh)
        ? at::scaled_dot_product_attention(q.reshape({b, nkv, nh / nkv, hd}), K, V, mask, 0.0, false, scaling)
        : at::scaled_dot_product_attention(q, K, V, mask, 0.0, false, scaling, nkv < nh);
    a = a.reshape({b, nh, n, hd}).transpose(1, 2).reshape({b * n, nh * hd});
    h = h + product(a, o[i], kinds[4 * i + 1], nullptr).view({b, n, H});
    x = rms(h, ln2[i], eps).view({b * n, H});
    auto gu = product(x, gate_up[i], kinds[4 * i + 2], nullptr).chunk(2, -1);
    h = h + product(at::silu(gu[0]) * gu[1], down[i], kinds[4 * i + 3], nullptr).view({b, n, H});
  }
  return rms(h, norm, eps);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("layers", &layers, "the target's layers and final norm for one sequence in live mode");
  m.def("stream_linear", &stream_linear, "x @ w.T (+ bias) by the streaming few-row kernel",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  m.def("stream_fits", &stream_fits, "whether stream_linear takes this weight");
}
