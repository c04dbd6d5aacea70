// The few-row product y = x @ W.T that a verify and a draft step run (rowgemm.py's `stream`
// kernel): W streamed once from memory, in its own row-major layout (no packed copy), every
// output a dot product of one weight row with one input row.
//
// Why our own: EAGLE-2's dynamic tree (section 4) pays where verifying a few more rows costs
// little more than one. On a CPU a product of 1-16 rows is memory-bound, and the kernels torch
// ships reach 10-24 GB/s on shapes of a small model where the memory gives 30-40 (issue 28,
// docs/benchmarks.md). A tile here keeps 16 accumulators in registers: 16 weight rows x 1 input
// row, 8 x 2 or 4 x 4, so each weight is read from memory once and reused from cache for the
// other rows.
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

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
// The 16 accumulators' lane sums at once, by shuffles (the same additions as lane_sum, in the
// same order); lane i of the result is acc[i]'s.
inline void lane_sums(const v16* acc, float* out) {
  v16 s1[8], s2[4], s3[2];
  for (int i = 0; i < 8; ++i)  // l + l+8: acc 2i | acc 2i+1, 8 lanes each
    s1[i] = SHUF(acc[2 * i], acc[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            SHUF(acc[2 * i], acc[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  // + 4: acc 4i, 4i+2, 4i+1, 4i+3, 4 lanes each
    s2[i] = SHUF(s1[2 * i], s1[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
            SHUF(s1[2 * i], s1[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // + 2: 2 lanes each of acc 8i + 0, 4, 2, 6, 1, 5, 3, 7
    s3[i] = SHUF(s2[2 * i], s2[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
            SHUF(s2[2 * i], s2[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  // + 1: lanes hold acc 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15
  v16 r = SHUF(s3[0], s3[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
          SHUF(s3[0], s3[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  r = SHUF(r, r, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
  std::memcpy(out, &r, sizeof r);
}
#else
inline void lane_sums(const v16* acc, float* out) {
  for (int i = 0; i < 16; ++i) out[i] = lane_sum(acc[i]);
}
#endif

// One step of 16 (float32) or 32 (bfloat16) k's: `Row` holds a weight row's values for the step
// (read once, used for every input row of the tile), `fma` adds their products with an input row.
// bfloat16: 32 weights read as 16 pairs; the even ones are the pair's low half shifted up, the
// odd ones its high half masked, so no shuffle is needed; the input row was laid out to match
// (per 32 k's: the 16 even k's, then the 16 odd ones).
struct F32 {
  using T = float;
  static constexpr int STEP = 16;
  struct Row { v16 v; };
  static inline Row read(const T* w) { return {load(w)}; }
  static inline void fma(v16& acc, const Row& w, const float* x) { acc += w.v * load(x); }
};
struct BF16 {
  using T = at::BFloat16;
  static constexpr int STEP = 32;
  struct Row { v16 even, odd; };
  static inline Row read(const T* w) {
    u32x16 pair;
    std::memcpy(&pair, w, sizeof pair);
    u32x16 lo = pair << 16, hi = pair & 0xFFFF0000u;
    Row r;
    std::memcpy(&r.even, &lo, sizeof lo);
    std::memcpy(&r.odd, &hi, sizeof hi);
    return r;
  }
  static inline void fma(v16& acc, const Row& w, const float* x) {
    acc += w.even * load(x);
    acc += w.odd * load(x + 16);
  }
};

// NB weight rows x RB input rows: 16 accumulators, outputs to y[b * ldy + a].
template <typename K, int NB, int RB>
inline void tile(const typename K::T* w, int64_t k_len, const float* x, float* y, int64_t ldy) {
  v16 acc[NB * RB];
  for (int i = 0; i < NB * RB; ++i) acc[i] = v16{};
  for (int64_t k = 0; k < k_len; k += K::STEP) {
    typename K::Row row[NB];
    for (int a = 0; a < NB; ++a) row[a] = K::read(w + a * k_len + k);
    for (int b = 0; b < RB; ++b)
      for (int a = 0; a < NB; ++a) K::fma(acc[a * RB + b], row[a], x + b * k_len + k);
  }
  float s[16];
  lane_sums(acc, s);
  for (int a = 0; a < NB; ++a)
    for (int b = 0; b < RB; ++b) y[b * ldy + a] = s[a * RB + b];
}

template <typename K>
inline void single(const typename K::T* w, int64_t k_len, const float* x, float* y) {
  v16 acc{};
  for (int64_t k = 0; k < k_len; k += K::STEP) K::fma(acc, K::read(w + k), x + k);
  *y = lane_sum(acc);
}

// Y[R, N] = X[R, k] @ W[N, k].T: weight rows in blocks of 16, run by the threads; within a block
// the first input row streams it from memory (16 x 1), the rest reuse it from cache in 4s,
// then a 2 and a 1 (the mix measured fastest from 2 to 16 rows on a Zen 4).
template <typename K>
void run(const typename K::T* W, int64_t N, int64_t k_len, const float* X, int64_t R, float* Y) {
  at::parallel_for(0, (N + 15) / 16, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * 16;
      if (n0 + 16 > N) {  // the last, partial block
        for (int64_t n = n0; n < N; ++n)
          for (int64_t r = 0; r < R; ++r) single<K>(W + n * k_len, k_len, X + r * k_len, Y + r * N + n);
        continue;
      }
      const typename K::T* w = W + n0 * k_len;
      tile<K, 16, 1>(w, k_len, X, Y + n0, N);
      int64_t r = 1;
      for (; r + 4 <= R; r += 4)
        for (int q = 0; q < 4; ++q) tile<K, 4, 4>(w + 4 * q * k_len, k_len, X + r * k_len, Y + r * N + n0 + 4 * q, N);
      if (r + 2 <= R) {
        for (int q = 0; q < 2; ++q) tile<K, 8, 2>(w + 8 * q * k_len, k_len, X + r * k_len, Y + r * N + n0 + 8 * q, N);
        r += 2;
      }
      if (r < R) tile<K, 16, 1>(w, k_len, X + r * k_len, Y + r * N + n0, N);
    }
  });
}

}  // namespace

bool stream_fits(const at::Tensor& w) {
  if (w.dim() != 2 || !w.is_contiguous() || w.device().type() != at::kCPU) return false;
  if (w.scalar_type() == at::kFloat) return w.size(1) % F32::STEP == 0;
  if (w.scalar_type() == at::kBFloat16) return w.size(1) % BF16::STEP == 0;
  return false;
}

at::Tensor stream_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(stream_fits(w), "stream_linear: a contiguous 2-D float32/bfloat16 CPU weight whose rows are a whole number of steps");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && x.size(-1) == w.size(1), "stream_linear: input and weight disagree");
  const int64_t k_len = w.size(1), N = w.size(0);
  auto x2 = x.reshape({-1, k_len}).to(at::kFloat).contiguous();
  const int64_t R = x2.size(0);
  auto y = at::empty({R, N}, x2.options());
  if (w.scalar_type() == at::kFloat) {
    run<F32>(w.data_ptr<float>(), N, k_len, x2.data_ptr<float>(), R, y.data_ptr<float>());
  } else {
    // per 32 k's: the even ones, then the odd ones (BF16::fma reads the weights in that order)
    x2 = x2.view({R, k_len / 32, 16, 2}).transpose(2, 3).contiguous();
    run<BF16>(w.data_ptr<at::BFloat16>(), N, k_len, x2.data_ptr<float>(), R, y.data_ptr<float>());
  }
  if (bias) y.add_(bias->to(at::kFloat));
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.to(x.scalar_type()).view(sizes);
}
