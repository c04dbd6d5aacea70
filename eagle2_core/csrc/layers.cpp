// The target's layer loop for one sequence in live mode (leanbody.py's native loop), and the draft
// head's one layer through the same code. Two forms: bfloat16 runs the Python loop of
// LeanBody.__call__ op for op over the same ATen ops (bitwise the same, without the interpreter
// between them); float32 runs the arithmetic between the products as our own loops over buffers
// kept between forwards (fused_layers below; within 2e-6 of the Python loop). Figures:
// docs/benchmarks.md.
// A change to the cache layout must change both this and engine.KVLayer.update.
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "products.h"
#include "vec.h"
using at::Tensor;

static Tensor packed_linear(const Tensor& x, const Tensor& w, const Tensor* bias);

// One product by the plan's kernel (rowgemm.KERNEL_CODES): 0 oneDNN packed, 1 F.linear, 2 W @ x.T,
// 3 our streaming kernel (products.cpp); BLOCK + t: the streaming kernel over a uint8 weight of
// GGUF blocks of GGML type t (block_linear: the float32 stream product's bits from the blocks);
// INT8 + t: the same blocks in integer arithmetic (int8_linear: 8-bit activations).
static constexpr int64_t BLOCK = 16;
static constexpr int64_t INT8 = 1024;
static Tensor product(const Tensor& x, const Tensor& w, int64_t kind, const Tensor* bias) {
  if (kind >= INT8) return int8_linear(x, w, kind - INT8, bias ? c10::optional<Tensor>(*bias) : c10::nullopt, 0);
  if (kind >= BLOCK) return block_linear(x, w, kind - BLOCK, bias ? c10::optional<Tensor>(*bias) : c10::nullopt);
  if (kind == 0) return packed_linear(x, w, bias);
  if (kind == 3) return stream_linear(x, w, bias ? c10::optional<Tensor>(*bias) : c10::nullopt);
  if (kind == 1) return bias ? at::linear(x, w, *bias) : at::linear(x, w);
  auto out = at::mm(w, x.t()).t().contiguous();
  return bias ? out.add_(*bias) : out;
}

// The same into a work buffer: ours writes there, the others' results are copied in.
static const Tensor& product_into(const Tensor& x, const Tensor& w, int64_t kind, const Tensor* bias, Tensor& out) {
  if (kind >= INT8)
    int8_into(x, w, kind - INT8, bias, out);
  else if (kind >= BLOCK)
    block_into(x, w, kind - BLOCK, bias, out);
  else if (kind == 3 && w.scalar_type() == at::kFloat)
    stream_into(x, w, bias, out);
  else
    out.copy_(product(x, w, kind, bias).view(out.sizes()));
  return out;
}

// A product whose weight is kept as parts (a fused q/k/v of block types no one type holds
// exactly): each part by its own kernel, their outputs side by side, the bias after the sums as
// the kernels add it. Parts [at, at + count) of `ws`, their kernels at the same places of `kinds`.
static Tensor parts_product(const Tensor& x, const std::vector<Tensor>& ws, const std::vector<int64_t>& kinds, size_t at,
                            int64_t count, const Tensor* bias) {
  if (count == 1) return product(x, ws[at], kinds[at], bias);
  std::vector<Tensor> outs;
  for (int64_t p = 0; p < count; ++p) outs.push_back(product(x, ws[at + p], kinds[at + p], nullptr));
  auto out = at::cat(outs, -1);
  return bias ? out.add_(*bias) : out;
}

static const Tensor& parts_into(const Tensor& x, const std::vector<Tensor>& ws, const std::vector<int64_t>& kinds, size_t at,
                                int64_t count, const Tensor* bias, Tensor& out) {
  if (count == 1) return product_into(x, ws[at], kinds[at], bias, out);
  const int64_t rows = out.size(0);
  int64_t off = 0;
  for (int64_t p = 0; p < count; ++p) {
    auto y = product(x, ws[at + p], kinds[at + p], nullptr);
    const int64_t cols = y.numel() / rows;
    out.narrow(1, off, cols).copy_(y.view({rows, cols}));
    off += cols;
  }
  if (bias) out.add_(*bias);
  return out;
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

// Llama's RMSNorm: torch's rms_norm in float32 (bitwise the same), the stock ops otherwise. An
// empty weight is no norm (an EAGLE draft head's layer has no input norm and no final norm).
static Tensor rms(const Tensor& x, const Tensor& w, double eps) {
  if (w.numel() == 0) return x;
  if (x.scalar_type() == at::kFloat) return at::rms_norm(x, {x.size(-1)}, w, eps);
  auto h = x.to(at::kFloat);
  h = h * at::rsqrt(h.pow(2).mean(-1, true) + eps);
  return w * h.to(x.scalar_type());
}

// -- float32, one sequence: the arithmetic between the products in our own loops ---------------
// In the ATen form above each layer runs ~40 small ops (norms, rotary, SDPA, slices, adds), each
// a few microseconds of dispatch and allocation: on SmolLM2 they cost ~10 ms of a 26 ms one-row
// verify whose products take 16. Here they are plain loops over the same buffers.
// The arithmetic is the stock layer's; only the order of additions inside a sum (RMSNorm's mean,
// attention's dot products and softmax) differs from ATen's, as between any two kernels.
namespace fused {
using namespace eagle2;

// RMSNorm of n rows: w * (x * 1/sqrt(mean(x^2) + eps)), as Llama's (float32 inside); no weight: a copy.
static void rms(const float* x, const float* w, float eps, int64_t n, int64_t H, float* out) {
  if (w == nullptr) {
    std::memcpy(out, x, n * H * sizeof(float));
    return;
  }
  for (int64_t r = 0; r < n; ++r) {
    const float* xr = x + r * H;
    const float inv = 1.0f / std::sqrt(dot(xr, xr, H) / static_cast<float>(H) + eps);
    for (int64_t i = 0; i < H; ++i) out[r * H + i] = w[i] * (xr[i] * inv);
  }
}

// Rotary on q and k of each row (x cos + roll(x, hd/2) signed_sin, as leanbody.rotary), q in
// place, k and v written to the cache at slot start + r ([1, nkv, max, hd] each).
static void rotary_and_store(float* t, const float* cos, const float* sin, int64_t n, int64_t nh, int64_t nkv,
                             int64_t hd, float* keys, float* values, int64_t max_len, int64_t start) {
  const int64_t T = (nh + 2 * nkv) * hd, half = hd / 2;
  std::vector<float> tmp(hd);
  for (int64_t r = 0; r < n; ++r) {
    const float* c = cos + r * hd;
    const float* s = sin + r * hd;
    for (int64_t j = 0; j < nh + nkv; ++j) {
      float* x = t + r * T + j * hd;
      for (int64_t i = 0; i < half; ++i) tmp[i] = x[i] * c[i] + x[i + half] * s[i];
      for (int64_t i = half; i < hd; ++i) tmp[i] = x[i] * c[i] + x[i - half] * s[i];
      float* dst = j < nh ? x : keys + ((j - nh) * max_len + start + r) * hd;
      std::memcpy(dst, tmp.data(), hd * sizeof(float));
    }
    for (int64_t g = 0; g < nkv; ++g)
      std::memcpy(values + (g * max_len + start + r) * hd, t + r * T + (nh + nkv + g) * hd, hd * sizeof(float));
  }
}

// Attention of RB rows for one q head: each key and value vector is read once for all of them (a
// tree's rows read the same cache), where a row at a time read the head's whole cache once per
// row from L2. Every score and output is summed in the order one row alone sums it (over d in
// steps of 16 then lane_sums; over the keys in order), so the same bits.
template <int RB>
static void attend_rows(const float* t, int64_t T, const float* K, const float* V, const float* mask, int64_t mask_row,
                        int64_t mask_col, int64_t h, int64_t r0, int64_t nh, int64_t hd, int64_t view, float scale, float* out,
                        float* p) {
  const float* q[RB];
  for (int b = 0; b < RB; ++b) q[b] = t + (r0 + b) * T + h * hd;
  int64_t j = 0;
  if (hd % 16 == 0) {
    constexpr int U = 16 / RB;  // keys a block: RB x U = 16 accumulators
    for (; j + U <= view; j += U) {
      v16 acc[16];
      for (int i = 0; i < 16; ++i) acc[i] = v16{};
      for (int64_t d = 0; d < hd; d += 16) {
        for (int u = 0; u < U; ++u) {
          const v16 k = load(K + (j + u) * hd + d);
          for (int b = 0; b < RB; ++b) acc[b * U + u] += load(q[b] + d) * k;
        }
      }
      float s[16];
      lane_sums(acc, s);
      for (int b = 0; b < RB; ++b)
        for (int u = 0; u < U; ++u) p[b * view + j + u] = s[b * U + u];
    }
  }
  for (; j < view; ++j)
    for (int b = 0; b < RB; ++b) p[b * view + j] = dot(q[b], K + j * hd, hd);
  float sum[RB];
  for (int b = 0; b < RB; ++b) {
    float* pb = p + b * view;
    const float* m = mask + (r0 + b) * mask_row;
    float top = -INFINITY;
    for (j = 0; j < view; ++j) {
      pb[j] = pb[j] * scale + m[j * mask_col];
      top = std::max(top, pb[j]);
    }
    // Every weight by the same vector exp (the tail padded) and the sum taken in key order: a
    // masked key adds an exact 0, so a tree row sums its visible keys as the same row decoded
    // alone does, wherever the tree put them (lanes by key index would group them differently).
    for (j = 0; j + 16 <= view; j += 16) store(pb + j, vexp(load(pb + j) - top));
    if (j < view) {
      float tail[16];
      for (int64_t i = 0; i < 16; ++i) tail[i] = j + i < view ? pb[j + i] - top : 0.0f;
      store(tail, vexp(load(tail)));
      for (int64_t i = 0; j + i < view; ++i) pb[j + i] = tail[i];
    }
    float total = 0.0f;
    for (j = 0; j < view; ++j) total += pb[j];
    sum[b] = total;
  }
  // p . v, 4 slices of 16 d's a pass (RB x 4 accumulators; the keys in order for each), then any
  // slices left one at a time
  const int64_t whole = hd / 16 * 16;
  auto pass = [&](int64_t d0, auto slices) {
    constexpr int C = decltype(slices)::value;
    v16 acc[RB * C];
    for (int i = 0; i < RB * C; ++i) acc[i] = v16{};
    for (int64_t j2 = 0; j2 < view; ++j2) {
      for (int c = 0; c < C; ++c) {
        const v16 v = load(V + j2 * hd + d0 + 16 * c);
        for (int b = 0; b < RB; ++b) acc[b * C + c] += p[b * view + j2] * v;
      }
    }
    for (int b = 0; b < RB; ++b)
      for (int c = 0; c < C; ++c) store(out + (r0 + b) * nh * hd + h * hd + d0 + 16 * c, acc[b * C + c] / sum[b]);
  };
  int64_t d0 = 0;
  for (; d0 + 64 <= whole; d0 += 64) pass(d0, std::integral_constant<int, 4>{});
  for (; d0 < whole; d0 += 16) pass(d0, std::integral_constant<int, 1>{});
  for (int b = 0; b < RB; ++b) {
    float* o = out + (r0 + b) * nh * hd + h * hd;
    for (int64_t d = whole; d < hd; ++d) {
      float acc = 0.0f;
      for (int64_t j2 = 0; j2 < view; ++j2) acc += p[b * view + j2] * V[j2 * hd + d];
      o[d] = acc / sum[b];
    }
  }
}

// How many of the first `view` keys a block of rows reads: up to the last one any of them sees. A
// key masked for every row (the lowest float or -inf) weighs an exact 0 and adds exact zeros to the
// sums in key order, so the keys past the last seen one change no bit; a prefill's causal rows then
// read only the keys before them (a whole view if a row sees none: its result stays what it was).
static int64_t seen_keys(const float* mask, int64_t mask_row, int64_t mask_col, int64_t r0, int64_t rows, int64_t view) {
  const float lowest = std::numeric_limits<float>::lowest();
  int64_t last = 0;
  for (int64_t b = 0; b < rows; ++b) {
    const float* m = mask + (r0 + b) * mask_row;
    int64_t j = view;
    while (j > 0 && m[(j - 1) * mask_col] <= lowest) --j;
    if (j == 0) return view;
    last = std::max(last, j);
  }
  return last;
}

// Attention of each row's q heads over the first `view` cache slots: softmax(q.k * scale + mask) . v,
// head h reading kv group h / (nh / nkv). Out: [n, nh * hd]. The mask is additive, [.., n, view].
// Work items are (head, 4 rows); measured in one process against a row at a time (SmolLM2, 250
// cached tokens): 1.03x at 1-2 rows, 1.07x at 4, 1.12x at 8 of a whole forward; Qwen2.5 0.5B
// 0.99-1.04x (docs/benchmarks.md).
static void attend(const float* t, const float* keys, const float* values, const float* mask, int64_t mask_row,
                   int64_t mask_col, int64_t n, int64_t nh, int64_t nkv, int64_t hd, int64_t max_len, int64_t view,
                   float scale, float* out) {
  const int64_t T = (nh + 2 * nkv) * hd, group = nh / nkv;
  constexpr int64_t RB = 4;
  const int64_t chunks = (n + RB - 1) / RB;
  std::vector<int64_t> seen(chunks);
  for (int64_t c = 0; c < chunks; ++c) seen[c] = seen_keys(mask, mask_row, mask_col, c * RB, std::min(RB, n - c * RB), view);
  at::parallel_for(0, nh * chunks, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> p(RB * view);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t h = i / chunks, r0 = (i % chunks) * RB, rows = std::min(RB, n - r0), keys_read = seen[i % chunks];
      const float* K = keys + (h / group) * max_len * hd;
      const float* V = values + (h / group) * max_len * hd;
      switch (rows) {
        case 4: attend_rows<4>(t, T, K, V, mask, mask_row, mask_col, h, r0, nh, hd, keys_read, scale, out, p.data()); break;
        case 3: attend_rows<3>(t, T, K, V, mask, mask_row, mask_col, h, r0, nh, hd, keys_read, scale, out, p.data()); break;
        case 2: attend_rows<2>(t, T, K, V, mask, mask_row, mask_col, h, r0, nh, hd, keys_read, scale, out, p.data()); break;
        default: attend_rows<1>(t, T, K, V, mask, mask_row, mask_col, h, r0, nh, hd, keys_read, scale, out, p.data()); break;
      }
    }
  });
}

// act = silu(gate) * up for n rows of [gate | up] (each 2I wide): silu(g) = g / (1 + e^-g), as ATen's.
static void silu_mul(const float* gu, int64_t n, int64_t I, float* act) {
  for (int64_t r = 0; r < n; ++r) {
    const float* g = gu + r * 2 * I;
    const float* u = g + I;
    float* o = act + r * I;
    int64_t i = 0;
    for (; i + 16 <= I; i += 16) {
      const v16 x = load(g + i);
      store(o + i, x / (1.0f + vexp(-x)) * load(u + i));
    }
    for (; i < I; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  }
}

static void add_into(float* h, const float* y, int64_t len) {
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) store(h + i, load(h + i) + load(y + i));
  for (; i < len; ++i) h[i] += y[i];
}

}  // namespace fused

// Whether the float32 loops above take this forward (else the ATen form below runs, one sequence only).
static bool fused_fits(const Tensor& h, const Tensor& mask, int64_t view, size_t starts) {
  return h.scalar_type() == at::kFloat && h.size(0) == static_cast<int64_t>(starts) && mask.scalar_type() == at::kFloat && mask.dim() == 4 &&
         (mask.size(0) == 1 || mask.size(0) == h.size(0)) && mask.size(2) == h.size(1) && mask.size(3) == view;
}

static const float* weight_or_null(const Tensor& w) { return w.numel() ? w.data_ptr<float>() : nullptr; }

static Tensor fused_layers(Tensor h, const Tensor& cos_, const Tensor& sin_, const Tensor& mask,
                           const std::vector<Tensor>& qkv, const std::vector<Tensor>& qkv_bias, const std::vector<Tensor>& o,
                           const std::vector<Tensor>& gate_up, const std::vector<Tensor>& down, const std::vector<int64_t>& kinds,
                           const std::vector<int64_t>& counts,
                           const std::vector<Tensor>& ln1, const std::vector<Tensor>& ln2, const Tensor& norm, double eps,
                           const std::vector<Tensor>& keys, const std::vector<Tensor>& values, const std::vector<int64_t>& starts,
                           int64_t view, int64_t nh, int64_t nkv, int64_t hd, double scaling) {
  // B sequences of m rows each: the products take all n = B * m rows at once; rotary, the cache
  // writes and attention go sequence by sequence, each at its own cells (starts[b] on) of its
  // own cache row, so a row's bits do not depend on the other sequences
  const int64_t B = h.size(0), m = h.size(1), n = B * m, H = h.size(2);
  h = h.clone(at::MemoryFormat::Contiguous);  // the residual stream, added into in place (the caller's stays)
  auto cos = cos_.contiguous(), sin = sin_.contiguous();
  // work buffers for the whole forward, kept from one forward to the next (a fresh allocation per
  // product touched new pages each time: 3 ms of a 16-row verify on a VM where first touches are slow)
  int64_t I2 = 0;  // gate/up's outputs: the rows of its parts (a block weight's rows are its outputs too)
  for (int64_t p = 0; p < (counts.empty() ? 1 : counts[2]); ++p) I2 += gate_up[p].size(0);
  const int64_t T = (nh + 2 * nkv) * hd;
  thread_local Tensor kept;  // grown, never shrunk: later forwards reuse the touched pages
  const int64_t need = n * (H + nh * hd + T + H + I2 + I2 / 2 + H);
  if (!kept.defined() || kept.numel() < need) kept = at::empty({need}, h.options());
  auto work = kept;
  int64_t at_ = 0;
  auto take = [&](int64_t cols) { auto t = work.narrow(0, at_, n * cols).view({n, cols}); at_ += n * cols; return t; };
  auto x = take(H), a = take(nh * hd), t = take(T), y = take(H), gu = take(I2), act = take(I2 / 2), y2 = take(H);
  float* hp = h.data_ptr<float>();
  const float* mp = mask.data_ptr<float>();
  // kinds and parts in order: a layer's q/k/v parts, o, gate/up parts, down (counts: parts per product, 4 a layer)
  size_t qi = 0, oi = 0, gi = 0, di = 0, ki = 0;
  std::vector<int64_t> kq, ko, kg, kd;
  const size_t L = ln1.size();
  for (size_t i = 0; i < L; ++i) {
    const int64_t c[4] = {counts.empty() ? 1 : counts[4 * i], counts.empty() ? 1 : counts[4 * i + 1],
                          counts.empty() ? 1 : counts[4 * i + 2], counts.empty() ? 1 : counts[4 * i + 3]};
    for (int64_t p = 0; p < c[0]; ++p) kq.push_back(kinds[ki++]);
    for (int64_t p = 0; p < c[1]; ++p) ko.push_back(kinds[ki++]);
    for (int64_t p = 0; p < c[2]; ++p) kg.push_back(kinds[ki++]);
    for (int64_t p = 0; p < c[3]; ++p) kd.push_back(kinds[ki++]);
  }
  for (size_t i = 0; i < L; ++i) {
    const int64_t cq = counts.empty() ? 1 : counts[4 * i], co = counts.empty() ? 1 : counts[4 * i + 1];
    const int64_t cg = counts.empty() ? 1 : counts[4 * i + 2], cd = counts.empty() ? 1 : counts[4 * i + 3];
    fused::rms(hp, weight_or_null(ln1[i]), static_cast<float>(eps), n, H, x.data_ptr<float>());
    parts_into(x, qkv, kq, qi, cq, qkv_bias.empty() ? nullptr : &qkv_bias[i], t);
    qi += cq;
    const int64_t max_len = keys[i].size(2), ks = keys[i].stride(0), vs = values[i].stride(0);
    const int64_t ms = mask.size(0) == 1 ? 0 : mask.stride(0);
    for (int64_t b = 0; b < B; ++b) {
      float* tb = t.data_ptr<float>() + b * m * T;
      fused::rotary_and_store(tb, cos.data_ptr<float>() + b * m * hd, sin.data_ptr<float>() + b * m * hd, m, nh, nkv, hd,
                              keys[i].data_ptr<float>() + b * ks, values[i].data_ptr<float>() + b * vs, max_len, starts[b]);
      fused::attend(tb, keys[i].data_ptr<float>() + b * ks, values[i].data_ptr<float>() + b * vs, mp + b * ms, mask.stride(2),
                    mask.stride(3), m, nh, nkv, hd, max_len, view, static_cast<float>(scaling), a.data_ptr<float>() + b * m * nh * hd);
    }
    fused::add_into(hp, parts_into(a, o, ko, oi, co, nullptr, y).data_ptr<float>(), n * H);
    oi += co;
    fused::rms(hp, weight_or_null(ln2[i]), static_cast<float>(eps), n, H, x.data_ptr<float>());
    const Tensor& g = parts_into(x, gate_up, kg, gi, cg, nullptr, gu);
    gi += cg;
    fused::silu_mul(g.data_ptr<float>(), n, I2 / 2, act.data_ptr<float>());
    fused::add_into(hp, parts_into(act, down, kd, di, cd, nullptr, y2).data_ptr<float>(), n * H);
    di += cd;
  }
  if (norm.numel() == 0) return h;
  auto out = at::empty_like(h);
  fused::rms(hp, norm.data_ptr<float>(), static_cast<float>(eps), n, H, out.data_ptr<float>());
  return out;
}

Tensor layers(Tensor h, const Tensor& cos, const Tensor& sin, const Tensor& mask,
              const std::vector<Tensor>& qkv, const std::vector<Tensor>& qkv_bias, const std::vector<Tensor>& o,
              const std::vector<Tensor>& gate_up, const std::vector<Tensor>& down, const std::vector<int64_t>& kinds,
              const std::vector<int64_t>& counts,
              const std::vector<Tensor>& ln1, const std::vector<Tensor>& ln2, const Tensor& norm, double eps,
              const std::vector<Tensor>& keys, const std::vector<Tensor>& values, const std::vector<int64_t>& starts,
              int64_t view, int64_t nh, int64_t nkv, int64_t hd, double scaling) {
  if (fused_fits(h, mask, view, starts.size()) && keys[0].is_contiguous() && values[0].is_contiguous())
    return fused_layers(h, cos, sin, mask, qkv, qkv_bias, o, gate_up, down, kinds, counts, ln1, ln2, norm, eps, keys, values, starts,
                        view, nh, nkv, hd, scaling);
  TORCH_CHECK(starts.size() == 1 && h.size(0) == 1, "the ATen form of the layer loop takes one sequence");
  const int64_t start = starts[0];
  const int64_t b = h.size(0), n = h.size(1), H = h.size(2);
  std::vector<int64_t> kq, ko, kg, kd;
  size_t ki = 0;
  for (size_t i = 0; i < ln1.size(); ++i) {
    for (int64_t p = 0; p < (counts.empty() ? 1 : counts[4 * i]); ++p) kq.push_back(kinds[ki++]);
    for (int64_t p = 0; p < (counts.empty() ? 1 : counts[4 * i + 1]); ++p) ko.push_back(kinds[ki++]);
    for (int64_t p = 0; p < (counts.empty() ? 1 : counts[4 * i + 2]); ++p) kg.push_back(kinds[ki++]);
    for (int64_t p = 0; p < (counts.empty() ? 1 : counts[4 * i + 3]); ++p) kd.push_back(kinds[ki++]);
  }
  size_t qi = 0, oi = 0, gi = 0, di = 0;
  for (size_t i = 0; i < ln1.size(); ++i) {
    const int64_t cq = counts.empty() ? 1 : counts[4 * i], co = counts.empty() ? 1 : counts[4 * i + 1];
    const int64_t cg = counts.empty() ? 1 : counts[4 * i + 2], cd = counts.empty() ? 1 : counts[4 * i + 3];
    auto x = rms(h, ln1[i], eps).view({b * n, H});
    auto t = parts_product(x, qkv, kq, qi, cq, qkv_bias.empty() ? nullptr : &qkv_bias[i]).view({b, n, nh + 2 * nkv, hd});
    qi += cq;
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
    h = h + parts_product(a, o, ko, oi, co, nullptr).view({b, n, H});
    oi += co;
    x = rms(h, ln2[i], eps).view({b * n, H});
    auto gu = parts_product(x, gate_up, kg, gi, cg, nullptr).chunk(2, -1);
    gi += cg;
    h = h + parts_product(at::silu(gu[0]) * gu[1], down, kd, di, cd, nullptr).view({b, n, H});
    di += cd;
  }
  return rms(h, norm, eps);
}

// e^x by vec.h's vexp over a float32 tensor (16 at a time, std::exp for a tail): for the tests.
static Tensor vector_exp(const Tensor& x) {
  auto in = x.contiguous();
  auto out = at::empty_like(in);
  const float* p = in.data_ptr<float>();
  float* o = out.data_ptr<float>();
  int64_t i = 0;
  for (; i + 16 <= in.numel(); i += 16) eagle2::store(o + i, eagle2::vexp(eagle2::load(p + i)));
  for (; i < in.numel(); ++i) o[i] = std::exp(p[i]);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("vector_exp", &vector_exp, "e^x by the native loop's vector exp (tests)");
  m.def("layers", &layers, "the target's layers and final norm for one sequence in live mode");
  m.def("stream_linear", &stream_linear, "x @ w.T (+ bias) by the streaming few-row kernel",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  m.def("stream_fits", &stream_fits, "whether stream_linear takes this weight");
  m.def("block_linear", &block_linear, "x @ dequantize(w).T (+ bias) from a GGUF block weight, bitwise the float32 stream product",
        py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("bias") = py::none());
  m.def("block_type_known", &block_type_known, "whether block_linear takes this GGML type");
  m.def("int8_type_known", &int8_type_known, "whether int8_linear takes this type");
  m.def("int8_interleaves", &int8_interleaves, "whether int8_linear reads this type interleaved (qtype | 256) here");
  m.def("int8_interleave", &int8_interleave, "a [16 n, row bytes] block weight in the interleaved layout (forward) or back",
        py::arg("w"), py::arg("qtype"), py::arg("forward") = true);
  m.def("int8_paths", &int8_paths, "the int8 SIMD paths built here: 1 generic, 2 AVX2, 3 AVX512-VNNI, 4 256-bit VNNI");
  m.def("int8_linear", &int8_linear, "x @ w.T (+ bias) over a block weight in integer arithmetic (8-bit activations)",
        py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("bias") = py::none(), py::arg("path") = 0);
  m.def("int8_quantize", &int8_quantize, "the activation blocks int8_linear makes of x [R, K]", py::arg("x"), py::arg("qtype"));
  m.def("block_rows", &block_rows, "float32 rows of a block weight, rebuilt as the block kernel reads them",
        py::arg("w"), py::arg("qtype"), py::arg("k_len"), py::arg("rows") = py::none(), py::arg("into") = py::none());
}
