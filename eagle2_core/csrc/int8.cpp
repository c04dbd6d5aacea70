// Products over GGUF block weights in integer arithmetic ("int8"): each activation row is
// quantized once per product to 8 bits, every (weight block, activation block) pair is dotted
// exactly in int32, and a fixed float32 combination per output turns the integers into the result.
//
// Definitions (tests/int8_reference.py is the same in numpy; the bitwise tests hold both to them):
// - Activations: blocks of 32 values (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 and ROW_I8) or 256 (Q4_K Q5_K
//   Q6_K); per block d = amax / 127 (float32), id = 1 / d (0 where d = 0), q = rint(x * id), the
//   product rounded to float32 first, then half to even, clamped to [-127, 127]; and the sums of
//   q per 16 values (int16).
// - Integers per (weight block, activation block), with w the type's stored unsigned value:
//   Q4_0 A = sum (w - 8) q; Q5_0 A = sum (w - 16) q; Q8_0 and ROW_I8 A = sum w q (signed w);
//   Q4_1 and Q5_1 A = sum w q and S = sum q; Q4_K and Q5_K A = sum_j sc_j sum_{i in j} w q and
//   B = sum_j m_j sum_{i in j} q over the 8 sub-blocks of 32; Q6_K A = sum_j sc_j sum (w - 32) q
//   over the 16 sub-blocks of 16. |A| < 2^28 for every legal block (Q6_K's bound: 16 x 128 x
//   16 x 32 x 127), so int32 never overflows, and the order of integer additions is free.
// - Float32, per output, over the row's blocks b in order, from acc = 0 (dw, dm: the weight
//   block's fp16 d and dmin / m widened, ROW_I8's row scale for every block; dx the activation's):
//     acc = acc + (dw * dx) * float(A)
//     Q4_K, Q5_K: acc = acc - (dm * dx) * float(B);   Q4_1, Q5_1: acc = acc + (dm * dx) * float(S)
//   each * and + / - rounded on its own (no fused multiply-add: `keep` below), then y = acc + bias.
//   Nothing in that order depends on the other rows of the product or on the SIMD path, so a row
//   gets the same bits alone, among 16, or in chunks, on every path.
//
// Layout of the SIMD paths: a group of L weight rows (16 for AVX-512, 8 for 256-bit) is unpacked
// block by block and transposed so that each vector lane holds one weight row's 4 consecutive
// values; an activation row's 4 matching values are broadcast to all lanes, and one dpbusd (or
// maddubs + madd on AVX2) adds 4 products into each of the L weight rows' sums. So each weight
// block is unpacked once for all activation rows, no horizontal sums are needed, and the float
// combination runs on L outputs at once. The stored values are the unsigned operand; offsets (-8,
// -16, -32, Q8_0's +128) are taken back through the activation sums. On AVX-512 the packed bytes
// of the 16 rows are transposed as they are (4-bit values before they are split: half the
// shuffles), and at up to 4 activation rows Q4_K and Q6_K are dotted straight from registers.
// Costs (Zen 4, one thread; benchmarks/int8_rows_bench.py): a row's marginal cost is within ~15% of
// the multiply pipes' floor (4 vpdpbusd + 1/2 vpmulld a 256-value block and row, each 1 a cycle
// at 512 bits); the repacking, paid once per weight block, is most of a one-row product.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#include <c10/util/Half.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "products.h"

namespace {

constexpr int64_t ROW_I8 = 100;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define I8_VNNI512 1
#else
#define I8_VNNI512 0
#endif
// 256-bit dpbusd: AVX-VNNI's VEX form, or the same instruction in its EVEX form (AVX512-VNNI + VL)
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define I8_VNNI256 1
#else
#define I8_VNNI256 0
#endif
#if defined(__AVX2__)
#define I8_AVX2 1
#else
#define I8_AVX2 0
#endif

enum Path { GENERIC = 1, AVX2 = 2, VNNI512 = 3, VNNI256 = 4 };

struct Kind {
  int bs;      // values per block (the activation's block too)
  int bytes;   // bytes per weight block (ROW_I8: 32 values, the row's scale before them)
  int groups;  // scale groups per block
  int off;     // subtracted from the stored unsigned value (Q8_0 / ROW_I8 store w + 128 here)
};
constexpr Kind kind_of(int64_t t) {
  switch (t) {
    case 2: return {32, 18, 1, 8};
    case 3: return {32, 20, 1, 0};
    case 6: return {32, 22, 1, 16};
    case 7: return {32, 24, 1, 0};
    case 8: return {32, 34, 1, 128};
    case 12: return {256, 144, 8, 0};
    case 13: return {256, 176, 8, 0};
    case 14: return {256, 210, 16, 32};
    case ROW_I8: return {32, 32, 1, 128};
  }
  return {0, 0, 0, 0};
}
inline bool has_min32(int64_t t) { return t == 3 || t == 7; }
inline bool has_mink(int64_t t) { return t == 12 || t == 13; }
inline int64_t row_bytes_of(int64_t t, int64_t k) { return t == ROW_I8 ? k + 4 : k / kind_of(t).bs * kind_of(t).bytes; }

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// A float kept as computed: the compiler may not fuse the multiply that made it into the add that
// uses it (GCC contracts a * b + c into one rounding by default), which would change the bits on
// one path and not another.
template <class T>
inline void keep(T& v) {
#if defined(__x86_64__) || defined(__i386__)
  __asm__("" : "+v"(v));
#elif defined(__aarch64__)
  __asm__("" : "+w"(v));
#else
  volatile T t = v;
  v = t;
#endif
}

// ---- activations ------------------------------------------------------------------------------
struct Acts {
  int64_t R = 0, K = 0, bs = 0, nb = 0;
  std::vector<int8_t> q;     // [R][K]
  std::vector<float> d;      // [R][nb]
  std::vector<int16_t> s16;  // [R][K / 16]
};

// One block of n values (32 or 256): d, q and the sums per 16.
inline void quantize_block(const float* x, int n, float& d_out, int8_t* q, int16_t* s16) {
  float amax = 0.0f;
#if defined(__AVX512F__)
  __m512 m = _mm512_setzero_ps();
  for (int i = 0; i < n; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  amax = _mm512_reduce_max_ps(m);
#else
  for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
#endif
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  d_out = d;
#if defined(__AVX512F__)
  const __m512 vid = _mm512_set1_ps(id), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  for (int i = 0; i < n; i += 16) {
    __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + i), vid);
    v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);  // the round below is to nearest even (MXCSR's default)
    const __m512i qi = _mm512_cvtps_epi32(v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(qi));
    s16[i / 16] = static_cast<int16_t>(_mm512_reduce_add_epi32(qi));
  }
#else
  for (int i = 0; i < n; i += 16) {
    int s = 0;
    for (int k = 0; k < 16; ++k) {
      float v = x[i + k] * id;
      v = std::min(std::max(v, -127.0f), 127.0f);
      const int qi = static_cast<int>(std::nearbyint(v));
      q[i + k] = static_cast<int8_t>(qi);
      s += qi;
    }
    s16[i / 16] = static_cast<int16_t>(s);
  }
#endif
}

Acts quantize_acts(const float* X, int64_t R, int64_t K, int bs) {
  Acts a;
  a.R = R, a.K = K, a.bs = bs, a.nb = K / bs;
  a.q.resize(R * K);
  a.d.resize(R * a.nb);
  a.s16.resize(R * K / 16);
  at::parallel_for(0, R * a.nb, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / a.nb, b = i % a.nb;
      quantize_block(X + r * K + b * bs, bs, a.d[i], a.q.data() + r * K + b * bs, a.s16.data() + (r * K + b * bs) / 16);
    }
  });
  return a;
}

// The activation-side integers a type's combination needs, per (row, block): `corr` the offset's
// correction (-off x the block's sum, 32-value types), `pairs` int16 pairs of sums for a K-quant
// (Q4_K / Q5_K: the 8 sums per 32 for B; Q6_K: the 16 sums per 16 for its -32 offset).
struct Side {
  int npairs = 0;
  std::vector<int32_t> corr;    // [R][nb]
  std::vector<float> sum;       // [R][nb]: S as float (Q4_1 / Q5_1)
  std::vector<uint32_t> pairs;  // [R][nb][npairs]
};
inline uint32_t pair16(int a, int b) { return (static_cast<uint32_t>(a) & 0xFFFFu) | (static_cast<uint32_t>(b) << 16); }

Side side_of(const Acts& a, int64_t t, bool sign_trick) {
  Side s;
  const Kind k = kind_of(t);
  const int64_t n = a.R * a.nb;
  if (k.bs == 32) {
    s.corr.resize(n);
    s.sum.resize(n);
    const int off = (sign_trick && k.off == 128) ? 0 : k.off;
    for (int64_t i = 0; i < n; ++i) {
      const int S = a.s16[2 * i] + a.s16[2 * i + 1];
      s.corr[i] = -off * S;
      s.sum[i] = static_cast<float>(S);
    }
  } else {
    s.npairs = t == 14 ? 8 : 4;
    s.pairs.resize(n * s.npairs);
    for (int64_t i = 0; i < n; ++i) {
      const int16_t* v = a.s16.data() + 16 * i;
      for (int p = 0; p < s.npairs; ++p) {
        if (t == 14)
          s.pairs[i * 8 + p] = pair16(v[2 * p], v[2 * p + 1]);
        else
          s.pairs[i * 4 + p] = pair16(v[4 * p] + v[4 * p + 1], v[4 * p + 2] + v[4 * p + 3]);
      }
    }
  }
  return s;
}

// ---- weights -----------------------------------------------------------------------------------
// One weight block's scales: dw, dm (dmin or m; 0 where none), the K-quants' sub-block scales and mins.
struct Meta {
  float dw, dm;
  int sc[16];
  int mn[8];
};

using eagle2::scale_min_k4;

inline void meta_of(int64_t t, const uint8_t* b, float row_scale, Meta& m) {
  m.dm = 0.0f;
  switch (t) {
    case 2: case 6: case 8: m.dw = half(b); break;
    case 3: case 7: m.dw = half(b), m.dm = half(b + 2); break;
    case ROW_I8: m.dw = row_scale; break;
    case 12: case 13:
      m.dw = half(b), m.dm = half(b + 2);
      for (int j = 0; j < 8; ++j) scale_min_k4(b + 4, j, m.sc[j], m.mn[j]);
      break;
    case 14:
      m.dw = half(b + 208);
      for (int j = 0; j < 16; ++j) m.sc[j] = static_cast<int8_t>(b[192 + j]);
      break;
  }
}

// A block's stored unsigned values in order (Q8_0 / ROW_I8: the int8 + 128), one byte each.
inline void unpack(int64_t t, const uint8_t* b, uint8_t* u) {
  switch (t) {
    case 2: case 3: {  // nibbles: value j low, j + 16 high
      const uint8_t* qs = b + (t == 2 ? 2 : 4);
#if I8_AVX2
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), f = _mm_set1_epi8(15);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(u), _mm_and_si128(v, f));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(u + 16), _mm_and_si128(_mm_srli_epi16(v, 4), f));
#else
      for (int i = 0; i < 16; ++i) u[i] = qs[i] & 15, u[i + 16] = qs[i] >> 4;
#endif
      break;
    }
    case 6: case 7: {  // + bit j of the 32-bit qh for value j
      const uint8_t* qh = b + (t == 6 ? 2 : 4);
      const uint8_t* qs = qh + 4;
      uint32_t h;
      std::memcpy(&h, qh, 4);
#if I8_AVX2
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), f = _mm_set1_epi8(15);
      const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), f), _mm_and_si128(v, f));
      // byte i of the spread word: qh's byte i / 8, tested against bit i % 8
      const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(h)),
                                                 _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0));
      const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
      const __m256i high = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(u), _mm256_or_si256(nib, high));
#else
      for (int i = 0; i < 16; ++i) {
        u[i] = (qs[i] & 15) | (((h >> i) & 1) << 4);
        u[i + 16] = (qs[i] >> 4) | (((h >> (i + 16)) & 1) << 4);
      }
#endif
      break;
    }
    case 8: case ROW_I8: {
      const uint8_t* qs = t == 8 ? b + 2 : b;
#if I8_AVX2
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(u), _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80))));
#else
      for (int i = 0; i < 32; ++i) u[i] = qs[i] ^ 0x80;
#endif
      break;
    }
    case 12: case 13: {  // 32 bytes per 64 values: low nibbles the first 32, high the next
      const uint8_t* qs = b + (t == 12 ? 16 : 48);
#if I8_AVX2
      const __m256i f = _mm256_set1_epi8(15);
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
      const __m256i sixteen = _mm256_set1_epi8(16);
      for (int p = 0; p < 4; ++p) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * p));
        __m256i lo = _mm256_and_si256(v, f), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), f);
        if (t == 13) {  // sub-block j's fifth bits: bit j of qh[l]
          const __m256i bl = _mm256_set1_epi8(static_cast<char>(1 << (2 * p))), bh = _mm256_set1_epi8(static_cast<char>(2 << (2 * p)));
          lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bl), bl), sixteen));
          hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bh), bh), sixteen));
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(u + 64 * p), lo);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(u + 64 * p + 32), hi);
      }
#else
      for (int p = 0; p < 4; ++p)
        for (int l = 0; l < 32; ++l) {
          int lo = qs[32 * p + l] & 15, hi = qs[32 * p + l] >> 4;
          if (t == 13) lo |= ((b[16 + l] >> (2 * p)) & 1) << 4, hi |= ((b[16 + l] >> (2 * p + 1)) & 1) << 4;
          u[64 * p + l] = static_cast<uint8_t>(lo);
          u[64 * p + 32 + l] = static_cast<uint8_t>(hi);
        }
#endif
      break;
    }
    case 14: {  // per 128: ql's low nibbles (l, l + 32), high nibbles (l + 64, l + 96), qh's 2-bit pairs
#if I8_AVX2
      const __m256i f = _mm256_set1_epi8(15), three = _mm256_set1_epi8(0x30);
      for (int h = 0; h < 2; ++h) {
        const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h));
        const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
        uint8_t* o = u + 128 * h;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm256_or_si256(_mm256_and_si256(l0, f), _mm256_and_si256(_mm256_slli_epi16(qh, 4), three)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 32), _mm256_or_si256(_mm256_and_si256(l1, f), _mm256_and_si256(_mm256_slli_epi16(qh, 2), three)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 64), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), f), _mm256_and_si256(qh, three)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 96), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), f), _mm256_and_si256(_mm256_srli_epi16(qh, 2), three)));
      }
#else
      for (int h = 0; h < 2; ++h) {
        const uint8_t* ql = b + 64 * h;
        const uint8_t* qh = b + 128 + 32 * h;
        uint8_t* o = u + 128 * h;
        for (int l = 0; l < 32; ++l) {
          o[l] = (ql[l] & 15) | (((qh[l] >> 0) & 3) << 4);
          o[l + 32] = (ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4);
          o[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
          o[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
      }
#endif
      break;
    }
  }
}

// The start of block b of a weight row (ROW_I8: its values; the row's scale is its first 4 bytes)
inline const uint8_t* block_at(int64_t t, const uint8_t* row, int64_t b) {
  return t == ROW_I8 ? row + 4 + 32 * b : row + b * kind_of(t).bytes;
}
inline float row_scale(int64_t t, const uint8_t* row) {
  float s = 0.0f;
  if (t == ROW_I8) std::memcpy(&s, row, 4);
  return s;
}

// ---- the generic path: one output at a time, plain C++ -------------------------------------------
void run_generic(int64_t t, const uint8_t* W, int64_t N, int64_t K, const Acts& a, float* Y) {
  const Kind k = kind_of(t);
  const int64_t rb = row_bytes_of(t, K), nb = K / k.bs;
  const Side side = side_of(a, t, false);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<uint8_t> u(k.bs);
    std::vector<float> acc(a.R);
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = W + n * rb;
      const float rs = row_scale(t, row);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = block_at(t, row, b);
        Meta m;
        meta_of(t, blk, rs, m);
        unpack(t, blk, u.data());
        for (int64_t r = 0; r < a.R; ++r) {
          const int8_t* x = a.q.data() + r * K + b * k.bs;
          const int16_t* s16 = a.s16.data() + (r * K + b * k.bs) / 16;
          int32_t A = 0, B = 0;
          if (k.bs == 32) {
            for (int i = 0; i < 32; ++i) A += (static_cast<int>(u[i]) - k.off) * x[i];
          } else {
            const int g = k.bs / k.groups;
            for (int j = 0; j < k.groups; ++j) {
              int32_t s = 0;
              for (int i = j * g; i < (j + 1) * g; ++i) s += (static_cast<int>(u[i]) - k.off) * x[i];
              A += m.sc[j] * s;
              if (has_mink(t)) B += m.mn[j] * (s16[2 * j] + s16[2 * j + 1]);
            }
          }
          const float dx = a.d[r * nb + b];
          float p = m.dw * dx;
          keep(p);
          float v = p * static_cast<float>(A);
          keep(v);
          float c = acc[r] + v;
          if (has_mink(t) || has_min32(t)) {
            float p2 = m.dm * dx;
            keep(p2);
            float v2 = p2 * (has_mink(t) ? static_cast<float>(B) : side.sum[r * nb + b]);
            keep(v2);
            c = has_mink(t) ? c - v2 : c + v2;
          }
          acc[r] = c;
        }
      }
      for (int64_t r = 0; r < a.R; ++r) Y[r * N + n] = acc[r];
    }
  });
}

// ---- the SIMD paths ------------------------------------------------------------------------------
// A policy gives L lanes of int32 / float32 and the dot step; `dot(t, w, x)` adds, in each lane,
// the 4 products of the lane's 4 unsigned weight bytes with the 4 signed activation bytes at x.
#if I8_VNNI512
struct V512 {
  static constexpr int L = 16;
  static constexpr bool SIGN = false;
  using VI = __m512i;
  using VF = __m512;
  static VI zero() { return _mm512_setzero_si512(); }
  static VI set1(int v) { return _mm512_set1_epi32(v); }
  static VI bcast(const void* p) { int v; std::memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
  static VI load(const void* p) { return _mm512_load_si512(p); }
  static VI loadu(const void* p) { return _mm512_loadu_si512(p); }
  static void store(void* p, VI v) { _mm512_store_si512(p, v); }
  static VI dot(VI t, VI w, const int8_t* x) { return _mm512_dpbusd_epi32(t, w, bcast(x)); }
  static VI pairs(VI t, VI w, uint32_t x) { return _mm512_dpwssd_epi32(t, w, _mm512_set1_epi32(static_cast<int>(x))); }
  static VI add(VI a, VI b) { return _mm512_add_epi32(a, b); }
  static VI sub(VI a, VI b) { return _mm512_sub_epi32(a, b); }
  static VI mul(VI a, VI b) { return _mm512_mullo_epi32(a, b); }
  static VI shl5(VI a) { return _mm512_slli_epi32(a, 5); }
  static VF cvt(VI a) { return _mm512_cvtepi32_ps(a); }
  static VF fload(const float* p) { return _mm512_load_ps(p); }
  static void fstore(float* p, VF v) { _mm512_store_ps(p, v); }
  static VF fset1(float v) { return _mm512_set1_ps(v); }
  static VF fmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
  static VF fadd(VF a, VF b) { return _mm512_add_ps(a, b); }
  static VF fsub(VF a, VF b) { return _mm512_sub_ps(a, b); }
  // 16 rows of 16 dwords (row i at src + i * stride) -> out[c] = dword c of every row
  static void transpose(const uint8_t* src, int64_t stride, VI* out) {
    VI r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * stride);
    transpose(r, out);
  }
  // the same from 16 row pointers, `off` bytes in
  static void transpose(const uint8_t* const* rows, int64_t off, VI* out) {
    VI r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(rows[i] + off);
    transpose(r, out);
  }
  // 16 rows of 4 dwords (`off` bytes in) -> out[c] = dword c of every row: 4 rows to a vector
  // (rows i, i + 4, i + 8, i + 12 in its 128-bit lanes), then 4 x 4 transposes inside the lanes
  static void transpose4(const uint8_t* const* rows, int64_t off, VI* out) {
    VI z[4];
    for (int i = 0; i < 4; ++i) {
      z[i] = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[i] + off)));
      for (int q = 1; q < 4; ++q)
        z[i] = _mm512_inserti32x4(z[i], _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[4 * q + i] + off)), q);
    }
    const VI t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    const VI t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    out[0] = _mm512_unpacklo_epi64(t0, t2);
    out[1] = _mm512_unpackhi_epi64(t0, t2);
    out[2] = _mm512_unpacklo_epi64(t1, t3);
    out[3] = _mm512_unpackhi_epi64(t1, t3);
  }
  // 16 rows of 8 dwords (row i's 32 bytes in z[i % 8]'s low or high half: rows i and i + 8 share
  // a vector) -> out[c] = dword c of every row
  static void transpose8(VI* z, VI* out) {
    VI t[8];
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {  // z[4i + c]: 128-bit lane k holds rows 4i.. (k < 2) or 8 + 4i.. (k >= 2), column 4 (k % 2) + c
      z[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
      z[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
      z[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
      z[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    const VI lo = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0), hi = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
    for (int c = 0; c < 4; ++c) {
      out[c] = _mm512_permutex2var_epi64(z[c], lo, z[4 + c]);
      out[4 + c] = _mm512_permutex2var_epi64(z[c], hi, z[4 + c]);
    }
  }
  static void transpose(VI* r, VI* out) {
    VI t[16];
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // r[4i + c]: rows 4i..4i+3, column 4k + c in 128-bit lane k
      r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
      r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
      r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
      r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; ++c) {
      const VI v0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
      const VI v2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44), v3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
      out[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
      out[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
      out[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
      out[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
  }
};
#endif

#if I8_AVX2
struct Y256 {  // the 256-bit parts both 8-lane policies share
  static constexpr int L = 8;
  using VI = __m256i;
  using VF = __m256;
  static VI zero() { return _mm256_setzero_si256(); }
  static VI set1(int v) { return _mm256_set1_epi32(v); }
  static VI bcast(const void* p) { int v; std::memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
  static VI load(const void* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }
  static VI loadu(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static void store(void* p, VI v) { _mm256_store_si256(reinterpret_cast<__m256i*>(p), v); }
  static VI add(VI a, VI b) { return _mm256_add_epi32(a, b); }
  static VI sub(VI a, VI b) { return _mm256_sub_epi32(a, b); }
  static VI mul(VI a, VI b) { return _mm256_mullo_epi32(a, b); }
  static VI shl5(VI a) { return _mm256_slli_epi32(a, 5); }
  static VF cvt(VI a) { return _mm256_cvtepi32_ps(a); }
  static VF fload(const float* p) { return _mm256_load_ps(p); }
  static void fstore(float* p, VF v) { _mm256_store_ps(p, v); }
  static VF fset1(float v) { return _mm256_set1_ps(v); }
  static VF fmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
  static VF fadd(VF a, VF b) { return _mm256_add_ps(a, b); }
  static VF fsub(VF a, VF b) { return _mm256_sub_ps(a, b); }
  static void transpose(const uint8_t* src, int64_t stride, VI* out) {
    VI r[8], t[8];
    for (int i = 0; i < 8; ++i) r[i] = loadu(src + i * stride);
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
      r[4 * i + 0] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
      r[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
      r[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
      r[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; ++c) {
      out[c] = _mm256_permute2x128_si256(r[c], r[4 + c], 0x20);
      out[4 + c] = _mm256_permute2x128_si256(r[c], r[4 + c], 0x31);
    }
  }
};
// AVX2: maddubs (unsigned weight x signed activation, pairs into int16) then madd with ones. No
// int16 saturation: a pair is at most 2 x 63 x 127 = 16002 (Q6_K; 4- and 5-bit values less); the
// 8-bit types (Q8_0, ROW_I8) take |w| and the activation with w's sign, 2 x 128 x 127 = 32512.
struct A256 : Y256 {
  static constexpr bool SIGN = true;
  static VI dot(VI t, VI w, const int8_t* x) {
    return _mm256_add_epi32(t, _mm256_madd_epi16(_mm256_maddubs_epi16(w, bcast(x)), _mm256_set1_epi16(1)));
  }
  static VI dot_signed(VI t, VI wabs, VI w, const int8_t* x) {
    return _mm256_add_epi32(t, _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(bcast(x), w)), _mm256_set1_epi16(1)));
  }
  static VI pairs(VI t, VI w, uint32_t x) { return _mm256_add_epi32(t, _mm256_madd_epi16(w, _mm256_set1_epi32(static_cast<int>(x)))); }
};
#endif

#if I8_VNNI256
struct N256 : Y256 {
  static constexpr bool SIGN = false;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  static VI dot(VI t, VI w, const int8_t* x) { return _mm256_dpbusd_epi32(t, w, bcast(x)); }
  static VI pairs(VI t, VI w, uint32_t x) { return _mm256_dpwssd_epi32(t, w, _mm256_set1_epi32(static_cast<int>(x))); }
#else
  static VI dot(VI t, VI w, const int8_t* x) { return _mm256_dpbusd_avx_epi32(t, w, bcast(x)); }
  static VI pairs(VI t, VI w, uint32_t x) { return _mm256_dpwssd_avx_epi32(t, w, _mm256_set1_epi32(static_cast<int>(x))); }
#endif
  static VI dot_signed(VI t, VI, VI, const int8_t*) { return t; }  // unused: SIGN is false
};
#endif

// Keeps a float vector out of multiply-add contraction (see keep).
template <class VF>
inline void keepv(VF& v) {
  __asm__("" : "+v"(v));
}

#if I8_VNNI512
// Where a 16-row K-quant block's transposed bytes come from: `Rows` transposes them from the 16
// rows as they lie in the file; `Tile` reads them from a tile that `interleave` wrote at load (the
// same vectors, stored: dword c of the 16 rows' block at 64 c, and Q6_K's 16 fp16 d at 16 x 208),
// so a product streams one stretch of memory and spends nothing on transposes.
struct Rows {
  const uint8_t* const* rows;
  int64_t off;  // the block's offset in a row
  __m512i idx;  // the rows' offsets from rows[0], for gathers
  void t16(int o, __m512i* out) const { V512::transpose(rows, off + o, out); }
  void t4(int o, __m512i* out) const { V512::transpose4(rows, off + o, out); }
  __m512 d6() const {  // Q6_K's d of the 16 rows (the dword at 206: sc 14, sc 15, d)
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_i32gather_epi32(idx, rows[0] + off + 206, 1), 16)));
  }
};
struct Tile {
  const uint8_t* p;  // the tile of this block
  void t16(int o, __m512i* out) const {
    for (int c = 0; c < 16; ++c) out[c] = _mm512_loadu_si512(p + 16 * o + 64 * c);
  }
  void t4(int o, __m512i* out) const {
    for (int c = 0; c < 4; ++c) out[c] = _mm512_loadu_si512(p + 16 * o + 64 * c);
  }
  __m512 d6() const { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * 208))); }
};

// AVX-512: a K-quant block of 16 weight rows made ready straight from the rows' bytes, without
// unpacking each row first: the packed bytes are transposed (a dword, 4 bytes of one row, per lane)
// and then split into nibbles, which halves the shuffles; the scales and minimums of all 16 rows
// are decoded at once from their gathered 12 bytes.
template <int T, bool VALUES = true, class Src>
inline void repack_k16(const Src& src, __m512i* Tw, int32_t (*scm)[16], int32_t (*mpm)[16], float* dw, float* dm) {
  const __m512i f4 = _mm512_set1_epi32(0x0F0F0F0F);
  if constexpr (T == 12 || T == 13) {
    __m512i hd[4];
    src.t4(0, hd);  // d | dmin, then the 12 scale bytes in three words
    const __m512i H = hd[0], A = hd[1], B = hd[2], C = hd[3];
    _mm512_store_ps(dw, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(H)));
    _mm512_store_ps(dm, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(H, 16))));
    const __m512i c3 = _mm512_set1_epi32(0x30303030), m6 = _mm512_set1_epi32(0x3F3F3F3F);
    const __m512i sc[2] = {_mm512_and_si512(A, m6), _mm512_or_si512(_mm512_and_si512(C, f4), _mm512_and_si512(_mm512_srli_epi32(A, 2), c3))};
    const __m512i mn[2] = {_mm512_and_si512(B, m6), _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(C, 4), f4), _mm512_and_si512(_mm512_srli_epi32(B, 2), c3))};
    const __m512i byte = _mm512_set1_epi32(0xFF), lo16 = _mm512_set1_epi32(0x000000FF), hi16 = _mm512_set1_epi32(0x00FF0000);
    for (int h = 0; h < 2; ++h) {
      for (int j = 0; j < 4; ++j) _mm512_store_si512(scm[4 * h + j], _mm512_and_si512(_mm512_srli_epi32(sc[h], 8 * j), byte));
      // (m 2p, m 2p+1) as an int16 pair: bytes 0 and 1 to 16-bit halves, then bytes 2 and 3
      _mm512_store_si512(mpm[2 * h], _mm512_or_si512(_mm512_and_si512(mn[h], lo16), _mm512_and_si512(_mm512_slli_epi32(mn[h], 8), hi16)));
      _mm512_store_si512(mpm[2 * h + 1], _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(mn[h], 16), lo16), _mm512_and_si512(_mm512_srli_epi32(mn[h], 8), hi16)));
    }
    if constexpr (!VALUES) return;
    __m512i P[16], QH[16];
    if constexpr (T == 13) src.t16(16, QH);  // qh's 8 dwords (and 8 unused)
    const int qs = T == 12 ? 16 : 48;
    const __m512i one = _mm512_set1_epi32(0x01010101);
    for (int half = 0; half < 2; ++half) {
      src.t16(qs + 64 * half, P);
      for (int i = 0; i < 16; ++i) {
        const int p = 2 * half + i / 8, c = i % 8;  // bytes 4c.. of chunk p: values 64p + 4c (low) and 64p + 32 + 4c (high)
        __m512i lo = _mm512_and_si512(P[i], f4), hi = _mm512_and_si512(_mm512_srli_epi32(P[i], 4), f4);
        if constexpr (T == 13) {
          lo = _mm512_or_si512(lo, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(QH[c], 2 * p), one), 4));
          hi = _mm512_or_si512(hi, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(QH[c], 2 * p + 1), one), 4));
        }
        Tw[16 * p + c] = lo;
        Tw[16 * p + 8 + c] = hi;
      }
    }
  } else {  // Q6_K
    _mm512_store_ps(dw, src.d6());
    __m512i sd[4];
    src.t4(192, sd);
    for (int q = 0; q < 4; ++q) {
      const __m512i S = sd[q];
      __m512i v[4];
      for (int j = 0; j < 4; ++j) {
        v[j] = _mm512_srai_epi32(_mm512_slli_epi32(S, 24 - 8 * j), 24);
        _mm512_store_si512(scm[4 * q + j], v[j]);
      }
      const __m512i m16 = _mm512_set1_epi32(0xFFFF);
      _mm512_store_si512(mpm[2 * q], _mm512_or_si512(_mm512_and_si512(v[0], m16), _mm512_slli_epi32(v[1], 16)));
      _mm512_store_si512(mpm[2 * q + 1], _mm512_or_si512(_mm512_and_si512(v[2], m16), _mm512_slli_epi32(v[3], 16)));
    }
    if constexpr (!VALUES) return;
    const __m512i m33 = _mm512_set1_epi32(0x33333333);
    __m512i QH[16];
    src.t16(128, QH);  // qh: dwords 0-7 the first 128 values, 8-15 the second
    for (int h = 0; h < 2; ++h) {
      __m512i P[16];
      src.t16(64 * h, P);  // ql: dwords 0-7 bytes l, 8-15 bytes l + 32
      for (int c = 0; c < 8; ++c) {
        const __m512i q = QH[8 * h + c];
        const __m512i h0 = _mm512_and_si512(q, m33), h1 = _mm512_and_si512(_mm512_srli_epi32(q, 2), m33);
        // (a & 0x0F) | (b & 0xF0) per byte: ternary logic 0xE4 with the mask as c
        __m512i* o = Tw + 32 * h + c;
        o[0] = _mm512_ternarylogic_epi32(P[c], _mm512_slli_epi32(h0, 4), f4, 0xE4);                           // value l
        o[8] = _mm512_ternarylogic_epi32(P[8 + c], _mm512_slli_epi32(h1, 4), f4, 0xE4);                       // l + 32
        o[16] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(P[c], 4), h0, f4, 0xE4);                          // l + 64
        o[24] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(P[8 + c], 4), h1, f4, 0xE4);                      // l + 96
      }
    }
  }
}

// Q4_K at up to 4 activation rows: each transposed vector of packed nibbles split and dotted at
// once, in registers (the values are not stored and read back: a third of a one-row product).
// The same integers as the stored steps give.
template <int R, class Src>
inline void q4k_fused(const Src& src, const int8_t* const* x, int32_t (*scm)[16], __m512i* A) {
  const __m512i f4 = _mm512_set1_epi32(0x0F0F0F0F);
  for (int half = 0; half < 2; ++half) {
    __m512i P[16];
    src.t16(16 + 64 * half, P);
    for (int pp = 0; pp < 2; ++pp) {
      const int p = 2 * half + pp;
      __m512i tl[R], th[R];
      for (int r = 0; r < R; ++r) tl[r] = th[r] = _mm512_setzero_si512();
      for (int c = 0; c < 8; ++c) {
        const __m512i lo = _mm512_and_si512(P[8 * pp + c], f4), hi = _mm512_and_si512(_mm512_srli_epi32(P[8 * pp + c], 4), f4);
        for (int r = 0; r < R; ++r) {
          tl[r] = V512::dot(tl[r], lo, x[r] + 64 * p + 4 * c);
          th[r] = V512::dot(th[r], hi, x[r] + 64 * p + 32 + 4 * c);
        }
      }
      const __m512i sl = _mm512_load_si512(scm[2 * p]), sh = _mm512_load_si512(scm[2 * p + 1]);
      for (int r = 0; r < R; ++r)
        A[r] = _mm512_add_epi32(A[r], _mm512_add_epi32(_mm512_mullo_epi32(tl[r], sl), _mm512_mullo_epi32(th[r], sh)));
    }
  }
}

// Q6_K at up to 4 activation rows, the same way: each step's values assembled and dotted at once.
template <int R, class Src>
inline void q6k_fused(const Src& src, const int8_t* const* x, int32_t (*scm)[16], __m512i* A) {
  const __m512i f4 = _mm512_set1_epi32(0x0F0F0F0F), m33 = _mm512_set1_epi32(0x33333333);
  __m512i QH[16];
  src.t16(128, QH);
  for (int h = 0; h < 2; ++h) {
    __m512i P[16];
    src.t16(64 * h, P);
    for (int t = 0; t < 4; ++t) {  // values 128 h + 32 t + 4 c: sub-blocks 8 h + 2 t (c < 4) and the next
      __m512i acc0[R], acc1[R];
      for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_si512();
      for (int c = 0; c < 8; ++c) {
        const __m512i q = QH[8 * h + c];
        __m512i w;
        switch (t) {
          case 0: w = _mm512_ternarylogic_epi32(P[c], _mm512_slli_epi32(_mm512_and_si512(q, m33), 4), f4, 0xE4); break;
          case 1: w = _mm512_ternarylogic_epi32(P[8 + c], _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(q, 2), m33), 4), f4, 0xE4); break;
          case 2: w = _mm512_ternarylogic_epi32(_mm512_srli_epi32(P[c], 4), _mm512_and_si512(q, m33), f4, 0xE4); break;
          default: w = _mm512_ternarylogic_epi32(_mm512_srli_epi32(P[8 + c], 4), _mm512_and_si512(_mm512_srli_epi32(q, 2), m33), f4, 0xE4); break;
        }
        const int8_t* xs = nullptr;
        for (int r = 0; r < R; ++r) {
          xs = x[r] + 128 * h + 32 * t + 4 * c;
          if (c < 4)
            acc0[r] = V512::dot(acc0[r], w, xs);
          else
            acc1[r] = V512::dot(acc1[r], w, xs);
        }
      }
      const int j = 8 * h + 2 * t;
      const __m512i s0 = _mm512_load_si512(scm[j]), s1 = _mm512_load_si512(scm[j + 1]);
      for (int r = 0; r < R; ++r)
        A[r] = _mm512_add_epi32(A[r], _mm512_add_epi32(_mm512_mullo_epi32(acc0[r], s0), _mm512_mullo_epi32(acc1[r], s1)));
    }
  }
}

// Q5_0 / Q5_1: 16 added to value j where bit j of the block's 32-bit qh (one row's per lane) is set,
// over the block's 8 steps o[st] (values 4 st .. 4 st + 3 of each lane's row)
inline void add_qh16(__m512i QH, __m512i* o) {
  const __m512i at = _mm512_set_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0, 0x0C0C0C0C, 0x08080808, 0x04040404, 0,
                                      0x0C0C0C0C, 0x08080808, 0x04040404, 0, 0x0C0C0C0C, 0x08080808, 0x04040404, 0);
  const __m512i sixteen = _mm512_set1_epi8(16);
  for (int st = 0; st < 8; ++st) {  // qh's byte st / 2 in each of the dword's bytes, tested bit by bit
    const __m512i b = _mm512_shuffle_epi8(QH, _mm512_add_epi8(at, _mm512_set1_epi8(static_cast<char>(st >> 1))));
    const __mmask64 m = _mm512_test_epi8_mask(b, _mm512_set1_epi32(st & 1 ? static_cast<int>(0x80402010u) : 0x08040201));
    o[st] = _mm512_mask_add_epi8(o[st], m, o[st], sixteen);
  }
}

// AVX-512: two 32-value blocks of 16 weight rows made ready from the rows' bytes (the second block
// repeats the first where the row has one block left: its steps are not used): the packed values
// transposed, a dword of one row per lane, then split; d (and m) of the 16 rows gathered.
template <int T>
inline void repack_32x16(const uint8_t* const* rows, int64_t b, bool two, __m512i idx, const float* rs, __m512i* Tw,
                         float (*dw)[16], float (*dm)[16]) {
  constexpr int bytes = kind_of(T).bytes;
  const int64_t o0 = T == ROW_I8 ? 4 + 32 * b : b * bytes, o1 = T == ROW_I8 ? o0 + (two ? 32 : 0) : o0 + (two ? bytes : 0);
  if constexpr (T == ROW_I8) {
    const __m512 s = _mm512_loadu_ps(rs);
    _mm512_store_ps(dw[0], s);
    _mm512_store_ps(dw[1], s);
  } else {
    for (int i = 0; i < 2; ++i) {
      const __m512i H = _mm512_i32gather_epi32(idx, rows[0] + (i ? o1 : o0), 1);  // d, then m or values
      _mm512_store_ps(dw[i], _mm512_cvtph_ps(_mm512_cvtepi32_epi16(H)));
      _mm512_store_ps(dm[i], _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(H, 16))));
    }
  }
  if constexpr (T == 8 || T == ROW_I8) {  // 32 signed bytes a block: + 128
    const int q = T == 8 ? 2 : 0;
    __m512i r[16];
    for (int l = 0; l < 16; ++l)
      r[l] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[l] + o0 + q))),
                                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[l] + o1 + q)), 1);
    V512::transpose(r, Tw);
    const __m512i flip = _mm512_set1_epi32(static_cast<int>(0x80808080u));
    for (int s = 0; s < 16; ++s) Tw[s] = _mm512_xor_si512(Tw[s], flip);
  } else {  // 16 bytes of nibbles a block (value j low, j + 16 high)
    constexpr int q = T == 2 ? 2 : T == 3 ? 4 : T == 6 ? 6 : 8;
    __m512i z[8], P[8];
    for (int i = 0; i < 8; ++i) {
      __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[i] + o0 + q)));
      v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[i] + o1 + q)), 1);
      v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[i + 8] + o0 + q)), 2);
      z[i] = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[i + 8] + o1 + q)), 3);
    }
    V512::transpose8(z, P);
    const __m512i f4 = _mm512_set1_epi32(0x0F0F0F0F);
    for (int i = 0; i < 2; ++i) {
      __m512i* o = Tw + 8 * i;
      for (int c = 0; c < 4; ++c) {
        o[c] = _mm512_and_si512(P[4 * i + c], f4);
        o[4 + c] = _mm512_and_si512(_mm512_srli_epi32(P[4 * i + c], 4), f4);
      }
      if constexpr (T == 6 || T == 7)
        add_qh16(_mm512_i32gather_epi32(idx, rows[0] + (i ? o1 : o0) + (T == 6 ? 2 : 4), 1), o);
    }
  }
}
#endif

#if I8_VNNI512
// The same two 32-value blocks of 16 rows from their interleaved tiles (tile_layout): d (and m) of
// the 16 rows as 16 fp16 each, then the blocks' dwords, a dword of one row per lane, split as
// repack_32x16 splits them.
template <int T>
inline void tiles_32x16(const uint8_t* t0, const uint8_t* t1, __m512i* Tw, float (*dw)[16], float (*dm)[16]) {
  constexpr int head = T == 3 || T == 7 ? 2 : 1;  // fp16 fields before the values: d (and m)
  const __m512i f4 = _mm512_set1_epi32(0x0F0F0F0F);
  for (int i = 0; i < 2; ++i) {
    const uint8_t* t = i ? t1 : t0;
    _mm512_store_ps(dw[i], _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t))));
    _mm512_store_ps(dm[i], head == 2 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32))) : _mm512_setzero_ps());
    const uint8_t* body = t + 32 * head;
    __m512i* o = Tw + 8 * i;
    if constexpr (T == 8) {  // 32 signed bytes: + 128
      const __m512i flip = _mm512_set1_epi32(static_cast<int>(0x80808080u));
      for (int st = 0; st < 8; ++st) o[st] = _mm512_xor_si512(_mm512_loadu_si512(body + 64 * st), flip);
    } else {
      const int q = T == 6 || T == 7 ? 1 : 0;  // Q5's qh dword first
      for (int c = 0; c < 4; ++c) {
        const __m512i P = _mm512_loadu_si512(body + 64 * (q + c));
        o[c] = _mm512_and_si512(P, f4);
        o[4 + c] = _mm512_and_si512(_mm512_srli_epi32(P, 4), f4);
      }
      if constexpr (T == 6 || T == 7) add_qh16(_mm512_loadu_si512(body), o);
    }
  }
}
#endif

// Products of one group of L weight rows (rows n0.., `valid` of them real) with every activation
// row, the activation rows RB at a time (each weight vector loaded once for them).
template <class P, int T>
struct Group {
  using VI = typename P::VI;
  using VF = typename P::VF;
  static constexpr int L = P::L;
  static constexpr Kind k = kind_of(T);
  static constexpr bool MIN32 = T == 3 || T == 7, MINK = T == 12 || T == 13, Q6 = T == 14;
  static constexpr bool SIGNED = P::SIGN && k.off == 128;  // AVX2's |w| x sign trick for the 8-bit types
  static constexpr int UNIT = 4 * L;                        // values per transposed unit (4 a lane)
  static constexpr int SB = k.bs > UNIT ? k.bs : UNIT;      // values unpacked at once
  static constexpr int BPS = SB / k.bs;                     // blocks in them
  static constexpr int RB = 4;

  const Acts& a;
  const Side& side;
  VI* Tw;
  VI* Ts;
  alignas(64) float dw[BPS][L], dm[BPS][L];
  alignas(64) int32_t scm[16][L], mpm[8][L];

  // rows r0 .. r0 + R of block b (its steps Tb, Sb), into acc
  template <int R>
  inline void rows(int64_t r0, int64_t b, const VI* Tb, const VI* Sb, const VF dwv, const VF dmv, float* acc) const {
    const int64_t K = a.K, nb = a.nb;
    const int8_t* x[R];
    for (int i = 0; i < R; ++i) x[i] = a.q.data() + (r0 + i) * K + b * k.bs;
    VI A[R];
    if constexpr (k.groups == 1) {
      for (int i = 0; i < R; ++i) A[i] = P::set1(side.corr[(r0 + i) * nb + b]);
      for (int s = 0; s < 8; ++s) {
        const VI w = Tb[s];
        for (int i = 0; i < R; ++i) {
          if constexpr (SIGNED)
            A[i] = P::dot_signed(A[i], w, Sb[s], x[i] + 4 * s);
          else
            A[i] = P::dot(A[i], w, x[i] + 4 * s);
        }
      }
    } else {
      constexpr int G = 256 / k.groups / 4;  // steps per scale group: 8 or 4
      for (int i = 0; i < R; ++i) A[i] = P::zero();
      for (int j = 0; j < k.groups; ++j) {
        VI t[R];
        for (int i = 0; i < R; ++i) t[i] = P::zero();
        for (int s = 0; s < G; ++s) {
          const VI w = Tb[j * G + s];
          for (int i = 0; i < R; ++i) t[i] = P::dot(t[i], w, x[i] + 4 * (j * G + s));
        }
        const VI sc = P::load(scm[j]);
        for (int i = 0; i < R; ++i) A[i] = P::add(A[i], P::mul(t[i], sc));
      }
    }
    finish<R>(r0, b, A, dwv, dmv, acc);
  }

  // the float combination of rows r0 .. r0 + R of block b, from their integers A
  template <int R>
  inline void finish(int64_t r0, int64_t b, VI* A, const VF dwv, const VF dmv, float* acc) const {
    const int64_t nb = a.nb;
    for (int i = 0; i < R; ++i) {
      const int64_t rb = (r0 + i) * nb + b;
      const uint32_t* pr = side.pairs.data() + rb * side.npairs;
      if constexpr (Q6) {
        VI C = P::zero();
        for (int p = 0; p < 8; ++p) C = P::pairs(C, P::load(mpm[p]), pr[p]);
        A[i] = P::sub(A[i], P::shl5(C));
      }
      const VF dx = P::fset1(a.d[rb]);
      VF p = P::fmul(dwv, dx);
      keepv(p);
      VF v = P::fmul(p, P::cvt(A[i]));
      keepv(v);
      float* ac = acc + (r0 + i) * L;
      VF c = P::fadd(P::fload(ac), v);
      if constexpr (MINK) {
        VI B = P::zero();
        for (int q = 0; q < 4; ++q) B = P::pairs(B, P::load(mpm[q]), pr[q]);
        VF p2 = P::fmul(dmv, dx);
        keepv(p2);
        VF v2 = P::fmul(p2, P::cvt(B));
        keepv(v2);
        c = P::fsub(c, v2);
      }
      if constexpr (MIN32) {
        VF p2 = P::fmul(dmv, dx);
        keepv(p2);
        VF v2 = P::fmul(p2, P::fset1(side.sum[rb]));
        keepv(v2);
        c = P::fadd(c, v2);
      }
      P::fstore(ac, c);
    }
  }

  // `next`..`next_end`: the next group's bytes, to prefetch (null: none)
  // `tiles`: the group's interleaved tiles (null: the rows as the file has them)
  void run(const uint8_t* W, int64_t rbytes, int64_t n0, int valid, int64_t N, float* Y, uint8_t* U, float* acc, const char* next,
           const char* next_end, const uint8_t* tiles) {
    const int64_t nb = a.nb, R = a.R;
    const int64_t steps = (nb + BPS - 1) / BPS;
    const int64_t pf_step = next ? ((next_end - next) / steps + 64) & ~int64_t(63) : 0;
    const uint8_t* rowp[L];
    float rs[L];
    alignas(64) int32_t idx[L];
    for (int l = 0; l < L; ++l) {
      rowp[l] = W + (n0 + (l < valid ? l : 0)) * rbytes;
      rs[l] = row_scale(T, rowp[l]);
      idx[l] = static_cast<int32_t>(rowp[l] - rowp[0]);
    }
    for (int64_t i = 0; i < R * L; ++i) acc[i] = 0.0f;
    for (int64_t b0 = 0; b0 < nb; b0 += BPS) {
      const int nbl = static_cast<int>(std::min<int64_t>(BPS, nb - b0));
      // the next group's rows (one stretch of memory) into cache a part per step while this group
      // computes: a row of few blocks is too short a stream for the hardware to fetch ahead
      if (next) {
        const char* e = std::min(next + pf_step, next_end);
        for (; next < e; next += 64) __builtin_prefetch(next, 0, 2);
      }
      bool fast = false;
#if I8_VNNI512
      if constexpr (std::is_same<P, V512>::value && k.bs == 256) {
        // the block's 16 rows from the interleaved tiles, or transposed from the rows
        auto blockwise = [&](auto&& body) {
          if (tiles)
            body(Tile{tiles + b0 * 16 * k.bytes});
          else
            body(Rows{rowp, b0 * k.bytes, _mm512_load_si512(idx)});
        };
        // Q4_K and Q6_K at a few rows (Q4_K from tiles at any count: its nibbles split again per
        // pass from L1 cost less than storing them; Q6_K's assembly does not): unpacked and dotted
        // in registers, 4 activation rows a pass
        if (T != 13 && (R <= 4 || (T == 12 && tiles))) {
          blockwise([&](const auto& src) {
            repack_k16<T, false>(src, Tw, scm, mpm, dw[0], dm[0]);
            const VF dwv = P::fload(dw[0]), dmv = P::fload(dm[0]);
            for (int64_t r0 = 0; r0 < R; r0 += 4) {
              const int8_t* x[4];
              VI A[4];
              for (int i = 0; i < 4; ++i) {
                x[i] = a.q.data() + std::min<int64_t>(r0 + i, R - 1) * a.K + b0 * 256;
                A[i] = P::zero();
              }
              auto fused = [&](auto rows_c) {
                constexpr int RR = decltype(rows_c)::value;
                if constexpr (T == 12)
                  q4k_fused<RR>(src, x, scm, A);
                else if constexpr (T == 14)
                  q6k_fused<RR>(src, x, scm, A);
                finish<RR>(r0, b0, A, dwv, dmv, acc);
              };
              switch (std::min<int64_t>(R - r0, 4)) {
                case 4: fused(std::integral_constant<int, 4>{}); break;
                case 3: fused(std::integral_constant<int, 3>{}); break;
                case 2: fused(std::integral_constant<int, 2>{}); break;
                default: fused(std::integral_constant<int, 1>{}); break;
              }
            }
          });
          continue;
        }
        blockwise([&](const auto& src) { repack_k16<T>(src, Tw, scm, mpm, dw[0], dm[0]); });
        fast = true;
      }
      if constexpr (std::is_same<P, V512>::value && k.bs == 32) {
        if (tiles && T != ROW_I8) {
          const uint8_t* t0 = tiles + b0 * 16 * k.bytes;
          tiles_32x16<T>(t0, nbl == 2 ? t0 + 16 * k.bytes : t0, Tw, dw, dm);
        } else {
          repack_32x16<T>(rowp, b0, nbl == 2, _mm512_load_si512(idx), rs, Tw, dw, dm);
        }
        fast = true;
      }
#endif
      if (!fast) {
        for (int l = 0; l < L; ++l) {
          for (int i = 0; i < BPS; ++i) {
            uint8_t* u = U + l * SB + i * k.bs;
            if (i >= nbl) {
              std::memset(u, 0, k.bs);
              continue;
            }
            const uint8_t* blk = block_at(T, rowp[l], b0 + i);
            Meta m;
            meta_of(T, blk, rs[l], m);
            unpack(T, blk, u);
            dw[i][l] = m.dw, dm[i][l] = m.dm;
            if (k.groups > 1)
              for (int j = 0; j < k.groups; ++j) scm[j][l] = m.sc[j];
            if (MINK)
              for (int p = 0; p < 4; ++p) mpm[p][l] = static_cast<int32_t>(pair16(m.mn[2 * p], m.mn[2 * p + 1]));
            if (Q6)
              for (int p = 0; p < 8; ++p) mpm[p][l] = static_cast<int32_t>(pair16(m.sc[2 * p], m.sc[2 * p + 1]));
          }
        }
        for (int c = 0; c < SB / UNIT; ++c) P::transpose(U + c * UNIT, SB, Tw + c * L);
      }
      if constexpr (SIGNED) {
#if I8_AVX2
        // Tw holds w + 128: Ts the signed w, Tw |w|
        for (int s = 0; s < SB / 4; ++s) {
          const __m256i w = _mm256_xor_si256(Tw[s], _mm256_set1_epi8(static_cast<char>(0x80)));
          Ts[s] = w;
          Tw[s] = _mm256_abs_epi8(w);
        }
#endif
      }
      for (int i = 0; i < nbl; ++i) {
        const int64_t b = b0 + i;
        const VF dwv = P::fload(dw[i]);
        const VF dmv = P::fload(dm[i]);
        const VI* Tb = Tw + i * (k.bs / 4);
        const VI* Sb = Ts + (SIGNED ? i * (k.bs / 4) : 0);
        int64_t r = 0;
        for (; r + RB <= R; r += RB) rows<RB>(r, b, Tb, Sb, dwv, dmv, acc);
        switch (R - r) {
          case 3: rows<3>(r, b, Tb, Sb, dwv, dmv, acc); break;
          case 2: rows<2>(r, b, Tb, Sb, dwv, dmv, acc); break;
          case 1: rows<1>(r, b, Tb, Sb, dwv, dmv, acc); break;
        }
      }
    }
    for (int64_t r = 0; r < R; ++r)
      for (int l = 0; l < valid; ++l) Y[r * N + n0 + l] = acc[r * L + l];
  }
};

#if I8_VNNI512
// One activation row over Q6_K: each weight row dotted along its own bytes, start to end
// (a thread's rows one contiguous stretch, which the hardware prefetcher streams from DRAM; the
// 16-row transpose reads 16 short interleaved streams it does not follow). The block's integers
// come from per-lane sums times per-lane scales and one horizontal sum; the float steps per block
// are the definition's, as everywhere. (Q4_K stays on the 16-row kernel: its scale decoding per
// row and block costs more there than the transpose saves.)
//
// an fp16 value as float32 (the same IEEE widening as half, in one instruction)
inline float half1(const uint8_t* p) {
#if defined(__F16C__)
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
#else
  return half(p);
#endif
}

void run_row1_q6k(const uint8_t* W, int64_t N, int64_t K, const Acts& a, float* Y) {
  const int64_t nb = K / 256, rb = row_bytes_of(14, K);
  const int8_t* X = a.q.data();
  const float* DX = a.d.data();
  const int16_t* S16 = a.s16.data();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    const __m512i fifteen = _mm512_set1_epi8(15);
    // per 128 values h: ql's 64 bytes give values 0..63 (low nibbles) and 64..127 (high), qh's
    // 32 bytes (both halves) their 2-bit tops: << 4 / << 2 for the low, >> 0 / >> 2 for the high
    const __m512i sl = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i sr = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i three = _mm512_set1_epi8(0x30);
    __m512i idx[4];
    for (int c = 0; c < 4; ++c)
      idx[c] = _mm512_set_epi32(4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 2,
                                4 * c + 1, 4 * c + 1, 4 * c + 1, 4 * c + 1, 4 * c, 4 * c, 4 * c, 4 * c);
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = W + n * rb;
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + b * 210;
        const int8_t* x = X + b * 256;
        const __m512i scs = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
        const __m512i s16v = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(S16 + b * 16)));
        __m512i tot = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(_mm512_mullo_epi32(scs, s16v), 5));
        for (int h = 0; h < 2; ++h) {
          const __m512i L = _mm512_loadu_si512(blk + 64 * h);
          const __m512i QH = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h)));
          const __m512i lo = _mm512_or_si512(_mm512_and_si512(L, fifteen), _mm512_and_si512(_mm512_sllv_epi16(QH, sl), three));
          const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), fifteen), _mm512_and_si512(_mm512_srlv_epi16(QH, sr), three));
          const __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(x + 128 * h));
          const __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, _mm512_loadu_si512(x + 128 * h + 64));
          tot = _mm512_add_epi32(tot, _mm512_mullo_epi32(d0, _mm512_permutexvar_epi32(idx[2 * h], scs)));
          tot = _mm512_add_epi32(tot, _mm512_mullo_epi32(d1, _mm512_permutexvar_epi32(idx[2 * h + 1], scs)));
        }
        const int A = _mm512_reduce_add_epi32(tot);
        float pr = half1(blk + 208) * DX[b];
        keep(pr);
        float v = pr * static_cast<float>(A);
        keep(v);
        acc = acc + v;
      }
      Y[n] = acc;
    }
  });
}
#endif

template <class P, int T>
void run_simd(const uint8_t* W, int64_t N, int64_t K, const Acts& a, float* Y, bool tiled = false) {
  constexpr int L = P::L;
  const Kind k = kind_of(T);
  const int64_t rb = row_bytes_of(T, K);
  const int SB = std::max(k.bs, 4 * L);
  const Side side = side_of(a, T, P::SIGN);
  const int64_t groups = (N + L - 1) / L;
#if I8_VNNI512
  if constexpr (std::is_same<P, V512>::value && T == 14) {
    if (a.R == 1 && !tiled) {
      run_row1_q6k(W, N, K, a, Y);
      return;
    }
  }
#endif
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<typename P::VI> Tw(SB / 4), Ts(P::SIGN ? SB / 4 : 1);
    Group<P, T> grp{a, side, Tw.data(), Ts.data(), {}, {}, {}, {}};
    std::vector<uint8_t> U(static_cast<size_t>(L) * SB + 64);
    std::vector<float> accbuf(a.R * L + 16);  // acc: 64-byte aligned inside it
    float* acc = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(accbuf.data()) + 63) & ~uintptr_t(63));
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * L;
      const char* next = g + 1 < g1 ? reinterpret_cast<const char*>(W + (n0 + L) * rb) : nullptr;
      const char* next_end = g + 1 < g1 ? reinterpret_cast<const char*>(W + std::min<int64_t>(n0 + 2 * L, N) * rb) : nullptr;
      grp.run(W, rb, n0, static_cast<int>(std::min<int64_t>(L, N - n0)), N, Y, U.data(), acc, next, next_end,
              tiled ? W + n0 * rb : nullptr);
    }
  });
}

template <class P>
void run_path(int64_t t, const uint8_t* W, int64_t N, int64_t K, const Acts& a, float* Y) {
  switch (t) {
    case 2: run_simd<P, 2>(W, N, K, a, Y); break;
    case 3: run_simd<P, 3>(W, N, K, a, Y); break;
    case 6: run_simd<P, 6>(W, N, K, a, Y); break;
    case 7: run_simd<P, 7>(W, N, K, a, Y); break;
    case 8: run_simd<P, 8>(W, N, K, a, Y); break;
    case 12: run_simd<P, 12>(W, N, K, a, Y); break;
    case 13: run_simd<P, 13>(W, N, K, a, Y); break;
    case 14: run_simd<P, 14>(W, N, K, a, Y); break;
    case ROW_I8: run_simd<P, 100>(W, N, K, a, Y); break;
  }
}

// ---- the interleaved layout ---------------------------------------------------------------------
// A weight laid out for the AVX-512 kernel at load: each group of 16 rows, block by block, as one
// tile of 16 x the block's bytes holding what the kernel would otherwise gather and transpose from
// the rows at every product. A block is read as fp16 fields, dwords, fp16 fields (Layout); in its
// tile each field or dword keeps its place in the block's order, the 16 rows' copies side by side
// (row l's at 2 l or 4 l): so dword c of a K-quant block (no leading fields) is at 64 c + 4 l, and
// Q6_K's trailing d at 16 x 208 + 2 l. A weight keeps its [N, row bytes] shape; N is a multiple of 16.
constexpr int64_t TILED = 256;  // qtype | TILED: the weight is interleaved

struct Layout {
  int head, dwords, tail;  // fp16 fields before the dwords, dwords, fp16 fields after
};
constexpr Layout layout_of(int64_t t) {
  switch (t) {
    case 2: case 6: case 8: return {1, (kind_of(t).bytes - 2) / 4, 0};  // d, values
    case 3: case 7: return {2, (kind_of(t).bytes - 4) / 4, 0};          // d, m, values
    case 12: case 13: return {0, kind_of(t).bytes / 4, 0};
    case 14: return {0, 52, 1};                                        // ql, qh, scales, then d
  }
  return {0, 0, 0};
}

bool tiles_take(int64_t t) {
#if I8_VNNI512
  return t != ROW_I8 && kind_of(t).bs != 0;
#else
  (void)t;
  return false;
#endif
}

// rows -> tiles (forward) or tiles -> rows
void retile(const uint8_t* in, uint8_t* out, int64_t t, int64_t N, int64_t rb, bool forward) {
  const int64_t bytes = kind_of(t).bytes, nb = rb / bytes;
  const Layout lay = layout_of(t);
  at::parallel_for(0, N / 16 * nb, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = i / nb, b = i % nb;
      uint8_t* tile = (forward ? out : const_cast<uint8_t*>(in)) + g * 16 * rb + b * 16 * bytes;
      for (int l = 0; l < 16; ++l) {
        uint8_t* row = (forward ? const_cast<uint8_t*>(in) : out) + (g * 16 + l) * rb + b * bytes;
        int64_t at = 0;  // the unit's offset in the block; its copies start at 16 x that in the tile
        auto move = [&](int unit) {
          uint8_t* tp = tile + 16 * at + unit * l;
          if (forward)
            std::memcpy(tp, row + at, unit);
          else
            std::memcpy(row + at, tp, unit);
          at += unit;
        };
        for (int f = 0; f < lay.head; ++f) move(2);
        for (int c = 0; c < lay.dwords; ++c) move(4);
        for (int f = 0; f < lay.tail; ++f) move(2);
      }
    }
  });
}

std::vector<int64_t> built_paths() {
  std::vector<int64_t> p{GENERIC};
#if I8_AVX2
  p.push_back(AVX2);
#endif
#if I8_VNNI512
  p.push_back(VNNI512);
#endif
#if I8_VNNI256
  p.push_back(VNNI256);
#endif
  return p;
}

int64_t best_path() {
#if I8_VNNI512
  return VNNI512;
#elif I8_VNNI256
  return VNNI256;
#elif I8_AVX2
  return AVX2;
#else
  return GENERIC;
#endif
}

void check(const at::Tensor& x, const at::Tensor& w, int64_t qtype, const char* who) {
  TORCH_CHECK(int8_type_known(qtype), who, ": unknown type ", qtype);
  if (qtype & TILED) TORCH_CHECK(w.size(0) % 16 == 0, who, ": an interleaved weight has a multiple of 16 rows");
  qtype &= ~TILED;
  const int64_t k_len = x.size(-1), bs = kind_of(qtype).bs;
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), who, ": a contiguous float32 input");
  TORCH_CHECK(k_len % bs == 0, who, ": the row length ", k_len, " is not a multiple of the block (", bs, ")");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kByte && w.size(1) == row_bytes_of(qtype, k_len),
              who, ": a [N, blocks x bytes] uint8 weight for this input width");
}

}  // namespace

bool int8_type_known(int64_t qtype) { return kind_of(qtype & ~TILED).bs != 0 && (!(qtype & TILED) || tiles_take(qtype & ~TILED)); }

bool int8_interleaves(int64_t qtype) { return tiles_take(qtype); }

at::Tensor int8_interleave(const at::Tensor& w, int64_t qtype, bool forward) {
  TORCH_CHECK(tiles_take(qtype), "int8_interleave: type ", qtype, " is not interleaved here");
  const Layout lay = layout_of(qtype);
  TORCH_CHECK(2 * (lay.head + lay.tail) + 4 * lay.dwords == kind_of(qtype).bytes, "int8_interleave: no layout for type ", qtype);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.size(0) % 16 == 0 && w.size(1) % kind_of(qtype).bytes == 0,
              "int8_interleave: a [16 n, blocks x bytes] uint8 weight");
  auto wc = w.contiguous();
  // 64-byte aligned: a Q4_K / Q5_K tile is a whole number of cache lines
  auto buf = at::empty({wc.numel() + 64}, wc.options());
  const int64_t shift = (64 - reinterpret_cast<uintptr_t>(buf.data_ptr<uint8_t>()) % 64) % 64;
  auto out = buf.narrow(0, shift, wc.numel()).view({wc.size(0), wc.size(1)});
  retile(wc.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), qtype, wc.size(0), wc.size(1), forward);
  return out;
}

std::vector<int64_t> int8_paths() { return built_paths(); }

void int8_into(const at::Tensor& x, const at::Tensor& w, int64_t qtype, const at::Tensor* bias, at::Tensor& out, int64_t path) {
  check(x, w, qtype, "int8_into");
  const int64_t K = x.size(-1), N = w.size(0), R = x.numel() / K;
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kFloat && out.numel() == R * N &&
              (!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N)),
              "int8_into: a contiguous float32 output and bias of matching sizes");
  if (path == 0) path = best_path();
  const auto paths = built_paths();
  TORCH_CHECK(std::find(paths.begin(), paths.end(), path) != paths.end(), "int8_into: path ", path, " is not built here");
  if (R == 0) return;
  const bool tiled = qtype & TILED;
  qtype &= ~TILED;
  const Acts a = quantize_acts(x.data_ptr<float>(), R, K, kind_of(qtype).bs);
  const uint8_t* W = w.data_ptr<uint8_t>();
  at::Tensor rows;
  if (tiled && path != VNNI512) {  // another path (the tests force each): the rows back first
    rows = int8_interleave(w, qtype, false);
    W = rows.data_ptr<uint8_t>();
  }
  float* Y = out.data_ptr<float>();
  switch (path) {
    case GENERIC: run_generic(qtype, W, N, K, a, Y); break;
#if I8_AVX2
    case AVX2: run_path<A256>(qtype, W, N, K, a, Y); break;
#endif
#if I8_VNNI512
    case VNNI512:
      switch (tiled ? qtype : 0) {
        case 2: run_simd<V512, 2>(W, N, K, a, Y, true); break;
        case 3: run_simd<V512, 3>(W, N, K, a, Y, true); break;
        case 6: run_simd<V512, 6>(W, N, K, a, Y, true); break;
        case 7: run_simd<V512, 7>(W, N, K, a, Y, true); break;
        case 8: run_simd<V512, 8>(W, N, K, a, Y, true); break;
        case 12: run_simd<V512, 12>(W, N, K, a, Y, true); break;
        case 13: run_simd<V512, 13>(W, N, K, a, Y, true); break;
        case 14: run_simd<V512, 14>(W, N, K, a, Y, true); break;
        default: run_path<V512>(qtype, W, N, K, a, Y);
      }
      break;
#endif
#if I8_VNNI256
    case VNNI256: run_path<N256>(qtype, W, N, K, a, Y); break;
#endif
  }
  if (bias) {  // after the sum, as block_into adds it
    const float* b = bias->data_ptr<float>();
    for (int64_t r = 0; r < R; ++r)
      for (int64_t n = 0; n < N; ++n) Y[r * N + n] += b[n];
  }
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, int64_t qtype, const c10::optional<at::Tensor>& bias, int64_t path) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "int8_linear: a float32 input");
  const int64_t K = x.size(-1), N = w.size(0);
  auto x2 = x.reshape({-1, K}).contiguous();
  auto y = at::empty({x2.size(0), N}, x2.options());
  const at::Tensor b = bias ? bias->contiguous() : at::Tensor();
  int8_into(x2, w, qtype, bias ? &b : nullptr, y, path);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

at::Tensor int8_quantize(const at::Tensor& x, int64_t qtype) {
  TORCH_CHECK(int8_type_known(qtype), "int8_quantize: unknown type ", qtype);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int8_quantize: a [R, K] float32 input");
  qtype &= ~TILED;
  const int64_t bs = kind_of(qtype).bs, K = x.size(1), R = x.size(0);
  TORCH_CHECK(K % bs == 0, "int8_quantize: the row length is not a multiple of the block (", bs, ")");
  auto xc = x.contiguous();
  const Acts a = quantize_acts(xc.data_ptr<float>(), R, K, static_cast<int>(bs));
  const int64_t nb = K / bs, per = 4 + bs + bs / 8;
  auto out = at::empty({R, nb * per}, at::TensorOptions().dtype(at::kByte));
  uint8_t* o = out.data_ptr<uint8_t>();
  for (int64_t r = 0; r < R; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* p = o + r * nb * per + b * per;
      std::memcpy(p, &a.d[r * nb + b], 4);
      std::memcpy(p + 4, a.q.data() + r * K + b * bs, bs);
      std::memcpy(p + 4 + bs, a.s16.data() + (r * K + b * bs) / 16, bs / 8);
    }
  return out;
}
