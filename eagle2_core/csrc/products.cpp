// The few-row product y = x @ W.T that a verify and a draft step run (rowgemm.py's `stream`
// kernel): W streamed once from memory, in its own row-major layout (no packed copy), every
// output a dot product of one weight row with one input row.
//
// Why our own: EAGLE-2's dynamic tree (section 4) pays where verifying a few more rows costs
// little more than one. On a CPU a product of 1-16 rows is memory-bound, and the kernels torch
// ships reach 10-24 GB/s on shapes of a small model where the memory gives 30-40 (issue 28,
// docs/benchmarks.md). A tile here keeps up to 24 accumulators in registers (6 weight rows x 4
// input rows in float32): each weight is read from memory once, into cache, and reused there for
// every input row, while the next weights are already on their way (Prefetch).
//
// Each output is summed in one fixed order whatever the tile (16 lanes over k, then the lanes
// pairwise: l + l+8, + 4, + 2, + 1): a row's result does not depend on which other rows share
// the product, so a token verified in a tree of 12 gets the bits it gets alone.
//
// Written with the compiler's vector extensions (vec.h), not intrinsics.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstring>

#include "products.h"
#include "vec.h"

namespace {

using namespace eagle2;

// One step of 16 (float32) or 32 (bfloat16) k's: `Row` holds a weight row's values for the step
// (read once, used for every input row of the tile), `X` an input row's, `fma` adds their
// products. bfloat16: 32 weights read as 16 pairs; the even ones are the pair's low half shifted
// up, the odd ones its high half masked, so no shuffle is needed; the input row was laid out to
// match (per 32 k's: the 16 even k's, then the 16 odd ones).
struct F32 {
  using T = float;
  static constexpr int STEP = 16;
  static constexpr int NB = 6, RB = 4;  // 24 accumulators + 4 input rows + 1 weight row: 29 of 32 registers
  struct Row { v16 v; };
  using X = Row;
  static inline Row read(const T* w) { return {load(w)}; }
  static inline X read_x(const float* x) { return {load(x)}; }
  static inline void fma(v16& acc, const Row& w, const X& x) { acc += w.v * x.v; }
};
struct BF16 {
  using T = at::BFloat16;
  static constexpr int STEP = 32;
  static constexpr int NB = 4, RB = 4;  // 16 accumulators + 8 input halves + 2 weight halves
  struct Row { v16 even, odd; };
  using X = Row;
  static inline Row read(const T* w) {
    u32x16 pair;
    std::memcpy(&pair, w, sizeof pair);
    u32x16 lo = pair << 16, hi = pair & 0xFFFF0000u;
    Row r;
    std::memcpy(&r.even, &lo, sizeof lo);
    std::memcpy(&r.odd, &hi, sizeof hi);
    return r;
  }
  static inline X read_x(const float* x) { return {load(x), load(x + 16)}; }
  static inline void fma(v16& acc, const Row& w, const X& x) {
    acc += w.even * x.even;
    acc += w.odd * x.odd;
  }
};

// The next block of weight rows, fetched into cache a few lines a step while this block's tiles
// compute: memory streams while the arithmetic runs, so a product of many rows costs the larger
// of the two, not their sum (prefetching is what took 16 rows from 2.4x to 1.7-2.1x the read).
struct Prefetch {
  const char* at;
  const char* end;
  int per_step;
};

// A loaded value kept in a register: without it the compiler folds each weight load into every
// multiply-add that uses it (4 loads of one row per step instead of 1), and the tile waits on the
// load ports rather than the multipliers (+20% from this on a Zen 4).
inline void in_register(v16& v) {
#if defined(__x86_64__)
  __asm__("" : "+v"(v));
#endif
}
inline void in_register(F32::Row& r) { in_register(r.v); }
inline void in_register(BF16::Row& r) { in_register(r.even); in_register(r.odd); }

// NB weight rows x RB input rows (rows ldx apart), outputs to y[b * ldy + a].
template <typename K, int NB, int RB>
inline void tile(const typename K::T* w, int64_t k_len, const float* x, int64_t ldx, float* y, int64_t ldy, Prefetch& pf) {
  constexpr int T = NB * RB;
  v16 acc[T];
  for (int i = 0; i < T; ++i) acc[i] = v16{};
  const char* next = pf.at;  // a local copy: the reference would be written back every step
  for (int64_t k = 0; k < k_len; k += K::STEP) {
    if (next < pf.end) {
      for (int p = 0; p < pf.per_step; ++p) __builtin_prefetch(next + 64 * p, 0, 2);
      next += 64 * pf.per_step;
    }
    typename K::X xs[RB];
    for (int b = 0; b < RB; ++b) {
      xs[b] = K::read_x(x + b * ldx + k);
      in_register(xs[b]);
    }
    for (int a = 0; a < NB; ++a) {
      typename K::Row wa = K::read(w + a * k_len + k);
      in_register(wa);
      for (int b = 0; b < RB; ++b) K::fma(acc[a * RB + b], wa, xs[b]);
    }
  }
  pf.at = next;
  float s[(T + 7) / 8 * 8];
  int g = 0;
  for (; g + 16 <= T; g += 16) lane_sums(acc + g, s + g);
  for (; g < T; g += 8) {
    if (g + 8 <= T) {
      lane_sums8(acc + g, s + g);
    } else {
      v16 part[8];
      for (int i = 0; i < 8; ++i) part[i] = g + i < T ? acc[g + i] : v16{};
      lane_sums8(part, s + g);
    }
  }
  for (int a = 0; a < NB; ++a)
    for (int b = 0; b < RB; ++b) y[b * ldy + a] = s[a * RB + b];
}

template <typename K, int NB>
inline void rest(int64_t left, const typename K::T* w, int64_t k_len, const float* x, float* y, int64_t ldy, Prefetch& pf) {
  // the last R % RB input rows in one tile
  if (left == 3) tile<K, NB, 3>(w, k_len, x, k_len, y, ldy, pf);
  if (left == 2) tile<K, NB, 2>(w, k_len, x, k_len, y, ldy, pf);
  if (left == 1) tile<K, NB, 1>(w, k_len, x, k_len, y, ldy, pf);
}

template <typename K>
inline void single(const typename K::T* w, int64_t k_len, const float* x, float* y) {
  v16 acc{};
  for (int64_t k = 0; k < k_len; k += K::STEP) K::fma(acc, K::read(w + k), K::read_x(x + k));
  *y = lane_sum(acc);
}

// Y[R, N] = X[R, k] @ W[N, k].T: weight rows in blocks of NB, run by the threads; within a block
// every input row in tiles of RB (the block stays in cache between them), the next block
// prefetched meanwhile; the N % NB last weight rows one dot product at a time.
template <typename K>
void run(const typename K::T* W, int64_t N, int64_t k_len, const float* X, int64_t R, float* Y) {
  constexpr int NB = K::NB, RB = K::RB;
  static_assert(RB <= 4, "rest() covers remainders up to 3");
  const int64_t blocks = N / NB;
  const int tiles = static_cast<int>(R / RB + (R % RB != 0));
  const int64_t block_bytes = NB * k_len * static_cast<int64_t>(sizeof(typename K::T));
  at::parallel_for(0, blocks, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const typename K::T* w = W + t * NB * k_len;
      const char* next = reinterpret_cast<const char*>(w + NB * k_len);
      Prefetch pf{next, t + 1 < t1 ? next + block_bytes : next, (NB + tiles - 1) / tiles};  // lines a step
      float* y = Y + t * NB;
      int64_t r = 0;
      for (; r + RB <= R; r += RB) tile<K, NB, RB>(w, k_len, X + r * k_len, k_len, y + r * N, N, pf);
      rest<K, NB>(R - r, w, k_len, X + r * k_len, y + r * N, N, pf);
    }
  });
  for (int64_t n = blocks * NB; n < N; ++n)
    for (int64_t r = 0; r < R; ++r) single<K>(W + n * k_len, k_len, X + r * k_len, Y + r * N + n);
}

}  // namespace

bool stream_fits(const at::Tensor& w) {
  if (w.dim() != 2 || !w.is_contiguous() || w.device().type() != at::kCPU) return false;
  if (w.scalar_type() == at::kFloat) return w.size(1) % F32::STEP == 0;
  if (w.scalar_type() == at::kBFloat16) return w.size(1) % BF16::STEP == 0;
  return false;
}

void stream_into(const at::Tensor& x, const at::Tensor& w, const at::Tensor* bias, at::Tensor& out) {
  TORCH_CHECK(stream_fits(w) && w.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat && x.is_contiguous() &&
              out.is_contiguous() && x.size(-1) == w.size(1) && out.numel() == x.numel() / w.size(1) * w.size(0) &&
              (!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == w.size(0))),
              "stream_into: contiguous float32 input, weight, bias and output of matching sizes");
  const int64_t k_len = w.size(1), N = w.size(0), R = x.numel() / k_len;
  if (R == 0) return;
  float* y = out.data_ptr<float>();
  run<F32>(w.data_ptr<float>(), N, k_len, x.data_ptr<float>(), R, y);
  if (bias) {
    const float* b = bias->data_ptr<float>();
    for (int64_t r = 0; r < R; ++r)
      for (int64_t n = 0; n < N; ++n) y[r * N + n] += b[n];
  }
}

at::Tensor stream_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(stream_fits(w), "stream_linear: a contiguous 2-D float32/bfloat16 CPU weight whose rows are a whole number of steps");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && x.size(-1) == w.size(1), "stream_linear: input and weight disagree");
  const int64_t k_len = w.size(1), N = w.size(0);
  auto x2 = x.reshape({-1, k_len}).to(at::kFloat).contiguous();
  const int64_t R = x2.size(0);
  auto y = at::empty({R, N}, x2.options());
  if (w.scalar_type() == at::kFloat) {
    const at::Tensor b = bias ? bias->contiguous() : at::Tensor();
    stream_into(x2, w, bias ? &b : nullptr, y);
  } else {
    if (R > 0) {
      // per 32 k's: the even ones, then the odd ones (BF16::fma reads the weights in that order)
      x2 = x2.view({R, k_len / 32, 16, 2}).transpose(2, 3).contiguous();
      run<BF16>(w.data_ptr<at::BFloat16>(), N, k_len, x2.data_ptr<float>(), R, y.data_ptr<float>());
    }
    if (bias) y.add_(bias->to(at::kFloat));
  }
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.to(x.scalar_type()).view(sizes);
}
