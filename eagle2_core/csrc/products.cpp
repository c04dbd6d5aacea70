// The few-row product y = x @ W.T that a verify and a draft step run (rowgemm.py's `stream`
// kernel): W streamed once from memory, in its own row-major layout (no packed copy), every
// output a dot product of one weight row with one input row.
//
// Why our own: EAGLE-2's dynamic tree (section 4) pays where verifying a few more rows costs
// little more than one. On a CPU a product of 1-16 rows is memory-bound, and the kernels torch
// ships reach 10-24 GB/s on shapes of a small model where the memory gives 30-40
// (docs/benchmarks.md). A tile here keeps up to 24 accumulators in registers (6 weight rows x 4
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
#include <algorithm>
#include <cstring>
#include <vector>
#include <c10/util/Half.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

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
  static constexpr bool BLOCKS = false;
  static constexpr bool PAIRS = false;  // whether `read2` rebuilds a 32-value group at once (block types)
  static constexpr bool CHUNKS = false;  // whether `chunk` rebuilds up to 256 values at once (block types)
  struct Row { v16 v; };
  using X = Row;
  static inline int64_t row_bytes(int64_t k_len) { return k_len * 4; }
  static inline Row read(const uint8_t* row, int64_t k) { return {load(reinterpret_cast<const float*>(row) + k)}; }
  static inline X read_x(const float* x) { return {load(x)}; }
  static inline void fma(v16& acc, const Row& w, const X& x) { acc += w.v * x.v; }
};
struct BF16 {
  using T = at::BFloat16;
  static constexpr int STEP = 32;
  static constexpr int NB = 4, RB = 4;  // 16 accumulators + 8 input halves + 2 weight halves
  static constexpr bool BLOCKS = false;
  static constexpr bool PAIRS = false;
  static constexpr bool CHUNKS = false;
  struct Row { v16 even, odd; };
  using X = Row;
  static inline int64_t row_bytes(int64_t k_len) { return k_len * 2; }
  static inline Row read(const uint8_t* row, int64_t k) {
    u32x16 pair;
    std::memcpy(&pair, row + 2 * k, sizeof pair);
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

// GGUF's block types: the weights stay in the file's blocks, 4-8 bits a weight where
// float32 takes 32, and `read` rebuilds a step of 16 float32 weights in registers exactly as
// gguf-py's dequantizer (which transformers loads GGUF files through) computes them: every scale
// is an fp16 widened to float32 and every product in the order numpy runs it. Nearly all of those
// products are exact in float32 (an 11-bit scale times a small integer), so the rebuilt weights
// are the bits the dequantized float32 weights hold, and `fma` below is F32's: each output is the
// same sum, in the same order, as the float32 stream product over the dequantized weight. The
// bitwise test against gguf-py is the specification (tests/test_blocks.py).
typedef int i32x16 __attribute__((vector_size(64)));

inline float f16(const uint8_t* p) {  // exact: every fp16 is a float32
#if defined(__FLT16_MAX__)
  _Float16 h;  // one instruction where the machine converts half floats (F16C), a library call elsewhere
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
#else
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}
// An fp16 scale in all 16 lanes, converted as a vector (vcvtph2ps): the scalar conversion
// (vcvtsh2ss) writes only the low lane of a register and so waits on that register's previous
// value, which chained every block's rebuilding to the one before it (a third of the speed at one
// input row). The same values: every fp16 is a float32.
inline v16 splat16(const uint8_t* p) {
#if defined(__AVX512F__)
  short h;
  std::memcpy(&h, p, 2);
  const __m512 r = _mm512_cvtph_ps(_mm256_set1_epi16(h));
  v16 v;
  std::memcpy(&v, &r, 64);
  return v;
#else
  const float f = f16(p);
  return (v16){f, f, f, f, f, f, f, f, f, f, f, f, f, f, f, f};
#endif
}

// 16 bytes widened to 16 int lanes, zero- or sign-extended. The one place we name the machine's
// instructions: GCC builds the generic form a lane at a time through memory, which made the
// block product 5x slower than the float32 one it is meant to beat; the generic loop stays as
// the fallback, with the same values.
template <bool SIGNED>
inline i32x16 lanes(const uint8_t* p) {
  i32x16 v;
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m512i r = SIGNED ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
  std::memcpy(&v, &r, sizeof v);
#elif defined(__AVX2__)
  const __m128i b0 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i b1 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8));
  const __m256i lo = SIGNED ? _mm256_cvtepi8_epi32(b0) : _mm256_cvtepu8_epi32(b0);
  const __m256i hi = SIGNED ? _mm256_cvtepi8_epi32(b1) : _mm256_cvtepu8_epi32(b1);
  std::memcpy(&v, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &hi, 32);
#else
  for (int i = 0; i < 16; ++i) v[i] = SIGNED ? static_cast<int>(static_cast<int8_t>(p[i])) : static_cast<int>(p[i]);
#endif
  return v;
}
inline i32x16 u8_lanes(const uint8_t* p) { return lanes<false>(p); }
inline i32x16 i8_lanes(const uint8_t* p) { return lanes<true>(p); }
inline v16 to_f(i32x16 v) { return __builtin_convertvector(v, v16); }  // exact: every value is a small integer
inline v16 splat(float f) { return (v16){f, f, f, f, f, f, f, f, f, f, f, f, f, f, f, f}; }
// a small integer in all lanes as float32, converted as a vector (exact; no scalar vcvtsi2ss,
// which waits on its register's previous value as vcvtsh2ss does: splat16)
inline v16 splat_int(int v) { return to_f(i32x16{} + v); }
// the 16 low or high nibbles of 16 bytes (the first or second half of a 32-value group)
inline i32x16 nibbles(const uint8_t* p, bool high) { return (u8_lanes(p) >> (high ? 4 : 0)) & 15; }
const i32x16 IOTA = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};


// Table lookups: a 4-bit value q picks the rebuilt weight from the 16 a block can hold, computed
// once per block by the same arithmetic `read` runs per value (so the same bits), in one permute
// where the rebuilding took a conversion and a multiply-add per value (AVX-512: vpermps takes the
// index's low 4 bits, vpermt2ps its low 5). Elsewhere the arithmetic form runs.
#if defined(__AVX512F__)
inline __m512 as_m(v16 v) { __m512 m; std::memcpy(&m, &v, 64); return m; }
inline __m512i as_mi(i32x16 v) { __m512i m; std::memcpy(&m, &v, 64); return m; }
inline v16 as_v(__m512 m) { v16 v; std::memcpy(&v, &m, 64); return v; }
inline v16 lookup16(v16 table, i32x16 idx) { return as_v(_mm512_permutexvar_ps(as_mi(idx), as_m(table))); }
inline v16 lookup32(v16 lo, v16 hi, i32x16 idx) { return as_v(_mm512_permutex2var_ps(as_m(lo), as_mi(idx), as_m(hi))); }
#define EAGLE2_LOOKUP 1
#else
#define EAGLE2_LOOKUP 0
#endif
const i32x16 IOTA16 = IOTA + 16;
#if EAGLE2_LOOKUP
// a 32-value group's weights from 16 bytes of nibbles (value j low, value j + 16 high) and its table
inline void nibble_lookup(v16 table, const uint8_t* qs, v16& lo, v16& hi) {
  const i32x16 q = u8_lanes(qs);
  lo = lookup16(table, q);
  hi = lookup16(table, q >> 4);
}
#endif

// K-quant blocks rebuilt whole (256 values) into a buffer the tile then reads (`chunk`,
// AVX-512BW): a sub-block's scales cost more vector work than its 32 values where each sub-block
// widened its own (14 of a Q4_K sub-block's 24 vector operations at one input row). Here a
// block's 8 or 16 scales are decoded in one word and widened in one multiply, and Q6_K's 6-bit
// values are assembled 64 bytes at a time. The same values as `read`, by the same arithmetic (the
// bitwise tests are unchanged). Measured in one process at one row, one thread (Intel Xeon, AMX
// VM): Q6_K 1.55x, Q4_K 1.45x; the 32-value blocks ran 0.84-0.9x this way (a buffer's store and
// reload cost more than their one scale a block), so they keep read2 in registers.
#if defined(__AVX512F__) && defined(__AVX512BW__) && EAGLE2_LOOKUP
#define EAGLE2_CHUNKS 1
#else
#define EAGLE2_CHUNKS 0
#endif

// Q4_K / Q5_K: sub-block j's (d * sc) and (dmin * m) in every lane
inline void k_scales(const uint8_t* b, int j, v16& d, v16& dm) {
  int sc, mn;
  scale_min_k4(b + 4, j, sc, mn);
  d = splat16(b) * splat_int(sc);
  dm = splat16(b + 2) * splat_int(mn);
}

template <int BLOCK, int BYTES>
struct Blocks : F32 {  // F32's step, tile and fma; only the weights' bytes differ
  static constexpr int NB = 4, RB = 4;  // 16 accumulators: the rebuilding needs registers of its own
  static constexpr bool BLOCKS = true;
  static constexpr bool PAIRS = true;  // read2: 32 values (a block, or a K-quant's sub-block) at once, their scales read once
  static constexpr bool CHUNKS = false;  // K-quants: `chunk` rebuilds a whole block into a buffer (else read2 in registers)
  static inline int64_t row_bytes(int64_t k_len) { return k_len / BLOCK * BYTES; }
};
struct Q8_0 : Blocks<32, 34> {  // d, 32 x int8: x * d
  static inline Row read(const uint8_t* row, int64_t k) {
    const uint8_t* b = row + (k >> 5) * 34;
    return {to_f(i8_lanes(b + 2 + (k & 16))) * splat16(b)};
  }
  static inline void read2(const uint8_t* row, int64_t k, Row& lo, Row& hi) {
    const uint8_t* b = row + (k >> 5) * 34;
    const v16 d = splat16(b);
    lo.v = to_f(i8_lanes(b + 2)) * d;
    hi.v = to_f(i8_lanes(b + 18)) * d;
  }
};
struct Q4_0 : Blocks<32, 18> {  // d, 16 bytes of nibbles (values j and j+16): d * (q - 8)
  static inline Row read(const uint8_t* row, int64_t k) {
    const uint8_t* b = row + (k >> 5) * 18;
    return {splat16(b) * (to_f(nibbles(b + 2, k & 16)) - 8.0f)};
  }
  static inline void read2(const uint8_t* row, int64_t k, Row& lo, Row& hi) {
    const uint8_t* b = row + (k >> 5) * 18;
#if EAGLE2_LOOKUP
    nibble_lookup(splat16(b) * (to_f(IOTA) - 8.0f), b + 2, lo.v, hi.v);
#else
    lo = read(row, k), hi = read(row, k + 16);
#endif
  }
};
struct Q4_1 : Blocks<32, 20> {  // d, m, nibbles: (d * q) + m
  static inline Row read(const uint8_t* row, int64_t k) {
    const uint8_t* b = row + (k >> 5) * 20;
    return {splat16(b) * to_f(nibbles(b + 4, k & 16)) + splat16(b + 2)};
  }
  static inline void read2(const uint8_t* row, int64_t k, Row& lo, Row& hi) {
    const uint8_t* b = row + (k >> 5) * 20;
#if EAGLE2_LOOKUP
    nibble_lookup(splat16(b) * to_f(IOTA) + splat16(b + 2), b + 4, lo.v, hi.v);
#else
    lo = read(row, k), hi = read(row, k + 16);
#endif
  }
};
// Q5_0 / Q5_1: a fifth bit per value in a 32-bit word (bit j for value j)
inline v16 five_bits(const uint8_t* b_qh, const uint8_t* b_qs, int64_t k) {
  uint32_t qh;
  std::memcpy(&qh, b_qh, 4);
  const i32x16 high = ((i32x16{} + static_cast<int>((qh >> (k & 16)) & 0xFFFF)) >> IOTA) & 1;
  return to_f(nibbles(b_qs, k & 16) | (high << 4));
}
#if EAGLE2_LOOKUP
// a Q5 block's 32 weights from its 32-entry table (t0: values 0-15, t1: 16-31): each index is the
// value's nibble, with 16 added where the block's bit j is set
inline void five_bit_lookup(v16 t0, v16 t1, const uint8_t* b_qh, const uint8_t* b_qs, v16& lo, v16& hi) {
  uint32_t qh;
  std::memcpy(&qh, b_qh, 4);
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b_qs)));
  const __m512i sixteen = _mm512_set1_epi32(16);
  const __m512i l = _mm512_and_si512(q, _mm512_set1_epi32(15)), h = _mm512_srli_epi32(q, 4);
  const __m512i L = _mm512_mask_or_epi32(l, static_cast<__mmask16>(qh & 0xFFFF), l, sixteen);
  const __m512i H = _mm512_mask_or_epi32(h, static_cast<__mmask16>(qh >> 16), h, sixteen);
  i32x16 il, ih;
  std::memcpy(&il, &L, 64);
  std::memcpy(&ih, &H, 64);
  lo = lookup32(t0, t1, il);
  hi = lookup32(t0, t1, ih);
}
#endif
struct Q5_0 : Blocks<32, 22> {  // d, qh, nibbles: d * (q - 16)
  static inline Row read(const uint8_t* row, int64_t k) {
    const uint8_t* b = row + (k >> 5) * 22;
    return {splat16(b) * (five_bits(b + 2, b + 6, k) - 16.0f)};
  }
  static inline void read2(const uint8_t* row, int64_t k, Row& lo, Row& hi) {
    const uint8_t* b = row + (k >> 5) * 22;
#if EAGLE2_LOOKUP
    const v16 d = splat16(b);
    five_bit_lookup(d * (to_f(IOTA) - 16.0f), d * (to_f(IOTA16) - 16.0f), b + 2, b + 6, lo.v, hi.v);
#else
    lo = read(row, k), hi = read(row, k + 16);
#endif
  }
};
struct Q5_1 : Blocks<32, 24> {  // d, m, qh, nibbles: (d * q) + m
  static inline Row read(const uint8_t* row, int64_t k) {
    const uint8_t* b = row + (k >> 5) * 24;
    return {splat16(b) * five_bits(b + 4, b + 8, k) + splat16(b + 2)};
  }
  static inline void read2(const uint8_t* row, int64_t k, Row& lo, Row& hi) {
    const uint8_t* b = row + (k >> 5) * 24;
#if EAGLE2_LOOKUP
    const v16 d = splat16(b), m = splat16(b + 2);
    five_bit_lookup(d * to_f(IOTA) + m, d * to_f(IOTA16) + m, b + 4, b + 8, lo.v, hi.v);
#else
    lo = read(row, k), hi = read(row, k + 16);
#endif
  }
};
struct Q4_K : Blocks<256, 144> {  // d, dmin, 12 scale bytes, 128 nibble bytes: (d * sc) * q - dmin * m
  static inline Row read(const uint8_t* row, int64_t k) {
    const uint8_t* b = row + (k >> 8) * 144;
    const int v = k & 255, j = v >> 5;
    v16 d, dm;
    k_scales(b, j, d, dm);
    return {d * to_f(nibbles(b + 16 + 32 * (j >> 1) + (v & 16), j & 1)) - dm};
  }
  static inline void read2(const uint8_t* row, int64_t k, Row& lo, Row& hi) {
#if EAGLE2_LOOKUP
    const uint8_t* b = row + (k >> 8) * 144;
    const int j = (k & 255) >> 5;
    v16 d, dm;
    k_scales(b, j, d, dm);
    const v16 table = d * to_f(IOTA) - dm;
    const uint8_t* q = b + 16 + 32 * (j >> 1);
    const int shift = 4 * (j & 1);
    lo.v = lookup16(table, u8_lanes(q) >> shift);
    hi.v = lookup16(table, u8_lanes(q + 16) >> shift);
#else
    lo = read(row, k), hi = read(row, k + 16);
#endif
  }
#if EAGLE2_CHUNKS
  // the 8 sub-blocks' (d * sc) and (dmin * m) in one multiply; sub-blocks 2i and 2i + 1 share
  // their 32 bytes (low and high nibbles), read once
  static constexpr bool CHUNKS = true;
  static inline void chunk(const uint8_t* row, int64_t k0, int64_t, float* out) {
    const uint8_t* b = row + (k0 >> 8) * 144;
    // scale_min_k4 for all 8 sub-blocks, 4 bytes at a time in a word: sc 0-3 = A & 63, m 0-3 =
    // B & 63, sc 4-7 = (C & 15) | (A >> 6) << 4, m 4-7 = (C >> 4) | (B >> 6) << 4 (A, B, C: the
    // 12 scale bytes in three words)
    uint32_t A, B, C;
    std::memcpy(&A, b + 4, 4);
    std::memcpy(&B, b + 8, 4);
    std::memcpy(&C, b + 12, 4);
    const uint32_t sc_hi = (C & 0x0F0F0F0Fu) | ((A >> 2) & 0x30303030u), m_hi = ((C >> 4) & 0x0F0F0F0Fu) | ((B >> 2) & 0x30303030u);
    const uint64_t sc = (A & 0x3F3F3F3Fu) | (static_cast<uint64_t>(sc_hi) << 32), mn = (B & 0x3F3F3F3Fu) | (static_cast<uint64_t>(m_hi) << 32);
    const __m512i smv = _mm512_cvtepu8_epi32(_mm_set_epi64x(static_cast<long long>(mn), static_cast<long long>(sc)));
    i32x16 sm;
    std::memcpy(&sm, &smv, sizeof sm);
    const __m512 dd = _mm512_mask_blend_ps(0xFF00, as_m(splat16(b)), as_m(splat16(b + 2)));  // d x 8, dmin x 8
    alignas(64) float s[16];
    store(s, as_v(dd) * to_f(sm));
    for (int j = 0; j < 8; j += 2, out += 64) {
      const uint8_t* q = b + 16 + 16 * j;
      const i32x16 q0 = u8_lanes(q), q1 = u8_lanes(q + 16);
      const v16 t0 = splat(s[j]) * to_f(IOTA) - splat(s[8 + j]);
      const v16 t1 = splat(s[j + 1]) * to_f(IOTA) - splat(s[9 + j]);
      store(out, lookup16(t0, q0));
      store(out + 16, lookup16(t0, q1));
      store(out + 32, lookup16(t1, q0 >> 4));
      store(out + 48, lookup16(t1, q1 >> 4));
    }
  }
#endif
};
struct Q5_K : Blocks<256, 176> {  // d, dmin, 12 scale bytes, 32 high-bit bytes, 128 nibble bytes
  static inline Row read(const uint8_t* row, int64_t k) {
    const uint8_t* b = row + (k >> 8) * 176;
    const int v = k & 255, j = v >> 5;
    v16 d, dm;
    k_scales(b, j, d, dm);
    const i32x16 high = (u8_lanes(b + 16 + (v & 16)) >> j) & 1;  // bit j of qh[i]: sub-block j's fifth bits
    return {d * to_f(nibbles(b + 48 + 32 * (j >> 1) + (v & 16), j & 1) | (high << 4)) - dm};
  }
  static inline void read2(const uint8_t* row, int64_t k, Row& lo, Row& hi) {
#if EAGLE2_LOOKUP
    const uint8_t* b = row + (k >> 8) * 176;
    const int j = (k & 255) >> 5;
    v16 d, dm;
    k_scales(b, j, d, dm);
    const v16 t0 = d * to_f(IOTA) - dm, t1 = d * to_f(IOTA16) - dm;
    const uint8_t* q = b + 48 + 32 * (j >> 1);
    const int shift = 4 * (j & 1);
    const i32x16 il = ((u8_lanes(q) >> shift) & 15) | (((u8_lanes(b + 16) >> j) & 1) << 4);
    const i32x16 ih = ((u8_lanes(q + 16) >> shift) & 15) | (((u8_lanes(b + 32) >> j) & 1) << 4);
    lo.v = lookup32(t0, t1, il);
    hi.v = lookup32(t0, t1, ih);
#else
    lo = read(row, k), hi = read(row, k + 16);
#endif
  }
};
struct Q6_K : Blocks<256, 210> {  // 128 low-nibble bytes, 64 two-bit bytes, 16 int8 scales, d: (d * sc) * (q - 32)
  static inline Row read(const uint8_t* row, int64_t k) {
    const uint8_t* b = row + (k >> 8) * 210;
    const int v = k & 255, h = v >> 7, m = v & 127;
    const i32x16 lo = nibbles(b + 64 * h + (m & 63), m >= 64);
    const i32x16 hi = (u8_lanes(b + 128 + 32 * h + (m & 31)) >> (2 * (m >> 5))) & 3;
    const i32x16 q = (lo | (hi << 4)) - 32;
    const v16 d = splat16(b + 208) * splat_int(static_cast<int8_t>(b[192 + (v >> 4)]));
    return {d * to_f(q)};
  }
  // 32 values: d read once, two 16-value sub-block scales
  static inline void read2(const uint8_t* row, int64_t k, Row& lo, Row& hi) {
    const uint8_t* b = row + (k >> 8) * 210;
    const int v = k & 255, h = v >> 7, m = v & 127;
    const v16 d = splat16(b + 208);
    const uint8_t* ql = b + 64 * h + (m & 63);
    const uint8_t* qh = b + 128 + 32 * h + (m & 31);
    const int nib = m >= 64 ? 4 : 0, two = 2 * (m >> 5);
    const i32x16 q0 = (((u8_lanes(ql) >> nib) & 15) | (((u8_lanes(qh) >> two) & 3) << 4)) - 32;
    const i32x16 q1 = (((u8_lanes(ql + 16) >> nib) & 15) | (((u8_lanes(qh + 16) >> two) & 3) << 4)) - 32;
    lo.v = d * splat_int(static_cast<int8_t>(b[192 + (v >> 4)])) * to_f(q0);
    hi.v = d * splat_int(static_cast<int8_t>(b[193 + (v >> 4)])) * to_f(q1);
  }
#if EAGLE2_CHUNKS
  // the 16 sub-block scales (d * sc) in one multiply; the 6-bit values assembled 64 at a time in
  // bytes: half h's value m takes ql[m % 64]'s low (m < 64) or high nibble and bits 2 (m / 32)
  // of qh[m % 32]. Bytes of Hx: qh, then qh >> 2, so bits 0-1 of byte m serve m < 64 and bits 4-5
  // the m + 64 (16-bit shifts: the bits they carry across bytes are masked off)
  static constexpr bool CHUNKS = true;
  static inline void chunk(const uint8_t* row, int64_t k0, int64_t, float* out) {
    const uint8_t* b = row + (k0 >> 8) * 210;
    alignas(64) float s[16];
    store(s, splat16(b + 208) * to_f(i8_lanes(b + 192)));
    alignas(64) int8_t q[256];
    const __m512i low = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x33), off = _mm512_set1_epi8(32);
    for (int h = 0; h < 2; ++h) {
      const __m512i L = _mm512_loadu_si512(b + 64 * h);
      const __m256i H = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
      const __m512i Hx = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(H), _mm256_srli_epi16(H, 2), 1), two);
      // (a & low) | (b & ~low): 0xE4
      const __m512i A = _mm512_ternarylogic_epi32(L, _mm512_slli_epi16(Hx, 4), low, 0xE4);
      const __m512i B = _mm512_ternarylogic_epi32(_mm512_srli_epi16(L, 4), Hx, low, 0xE4);
      _mm512_store_si512(q + 128 * h, _mm512_sub_epi8(A, off));
      _mm512_store_si512(q + 128 * h + 64, _mm512_sub_epi8(B, off));
    }
    for (int i = 0; i < 16; ++i) store(out + 16 * i, splat(s[i]) * to_f(i8_lanes(reinterpret_cast<const uint8_t*>(q) + 16 * i)));
  }
#endif
};

// eagle2's weight-only 8-bit (`--load-in-8bit` on a CPU, not a GGML type): a row is one float32
// scale then the row's int8 values, rebuilt as scale * q (one rounding, as torch's `scale * q`);
// the scale is the row's absmax / 127 (quantization.py).
struct RowI8 : F32 {
  static constexpr int NB = 4, RB = 4;
  static constexpr bool BLOCKS = true;
  static inline int64_t row_bytes(int64_t k_len) { return k_len + 4; }
  static inline Row read(const uint8_t* row, int64_t k) {
    float s;
    std::memcpy(&s, row, 4);
    return {to_f(i8_lanes(row + 4 + k)) * splat(s)};
  }
};

// A block type's values k0 .. k0 + len (len: a whole number of blocks, at most CHUNK) into out:
// the type's own `chunk` where it has one, else read2's 32 at a time (rebuild_row).
constexpr int64_t CHUNK = 256;
template <typename K>
inline void rebuild_chunk(const uint8_t* row, int64_t k0, int64_t len, float* out) {
  if constexpr (K::CHUNKS) {
    K::chunk(row, k0, len, out);
  } else {
    for (int64_t k = 0; k < len; k += 2 * K::STEP) {
      typename K::Row lo, hi;
      K::read2(row, k0 + k, lo, hi);
      store(out + k, lo.v);
      store(out + k + K::STEP, hi.v);
    }
  }
}

// The next block of weight rows, fetched into cache a few lines a step while this block's tiles
// compute: memory streams while the arithmetic runs, so a product of many rows costs the larger
// of the two, not their sum (prefetching is what took 16 rows from 2.4x to 1.7-2.1x the read).
struct Prefetch {
  const char* at;
  const char* end;
  int per_step;
};
// `lines` cache lines of the next block fetched, while any are left (`next`: the tile's local cursor)
inline void prefetch_step(const char*& next, const Prefetch& pf, int lines) {
  if (next < pf.end) {
    for (int p = 0; p < lines; ++p) __builtin_prefetch(next + 64 * p, 0, 2);
    next += 64 * lines;
  }
}

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
inline void tile(const uint8_t* w, int64_t k_len, const float* x, int64_t ldx, float* y, int64_t ldy, Prefetch& pf) {
  const int64_t rb = K::row_bytes(k_len);
  constexpr int T = NB * RB;
  v16 acc[T];
  for (int i = 0; i < T; ++i) acc[i] = v16{};
  const char* next = pf.at;  // a local copy: the reference would be written back every step
  if constexpr (K::PAIRS && !K::CHUNKS) {
    // a 32-value block at a time (read2: its scales and lookup table made once), each accumulator
    // taking the block's first 16 products and then its last 16: the order of the step-by-step
    // loop below, so the same bits
    for (int64_t k = 0; k < k_len; k += 2 * K::STEP) {
      prefetch_step(next, pf, 2 * pf.per_step);
      typename K::X xs[RB], xh[RB];
      for (int b = 0; b < RB; ++b) {
        xs[b] = K::read_x(x + b * ldx + k);
        xh[b] = K::read_x(x + b * ldx + k + K::STEP);
      }
      for (int a = 0; a < NB; ++a) {
        typename K::Row lo, hi;
        K::read2(w + a * rb, k, lo, hi);
        in_register(lo);
        in_register(hi);
        for (int b = 0; b < RB; ++b) {
          K::fma(acc[a * RB + b], lo, xs[b]);
          K::fma(acc[a * RB + b], hi, xh[b]);
        }
      }
    }
  } else if constexpr (K::CHUNKS) {
    // K-quants: each weight row's next block (256 values) rebuilt into a buffer in L1,
    // then F32's steps over it: the same floats in the same order as rebuilding 16 at a time in
    // registers, so the same bits, with each block's scales made once (K::chunk)
    alignas(64) float buf[NB][CHUNK];
    for (int64_t k0 = 0; k0 < k_len; k0 += CHUNK) {
      const int64_t len = std::min<int64_t>(CHUNK, k_len - k0);
      for (int a = 0; a < NB; ++a) rebuild_chunk<K>(w + a * rb, k0, len, buf[a]);
      for (int64_t k = 0; k < len; k += F32::STEP) {
        prefetch_step(next, pf, pf.per_step);
        F32::X xs[RB];
        for (int b = 0; b < RB; ++b) {
          xs[b] = F32::read_x(x + b * ldx + k0 + k);
          in_register(xs[b]);
        }
        for (int a = 0; a < NB; ++a) {
          F32::Row wa{load(buf[a] + k)};
          in_register(wa);
          for (int b = 0; b < RB; ++b) F32::fma(acc[a * RB + b], wa, xs[b]);
        }
      }
    }
  } else {
    for (int64_t k = 0; k < k_len; k += K::STEP) {
      prefetch_step(next, pf, pf.per_step);
      typename K::X xs[RB];
      for (int b = 0; b < RB; ++b) {
        xs[b] = K::read_x(x + b * ldx + k);
        in_register(xs[b]);
      }
      for (int a = 0; a < NB; ++a) {
        typename K::Row wa = K::read(w + a * rb, k);
        in_register(wa);
        for (int b = 0; b < RB; ++b) K::fma(acc[a * RB + b], wa, xs[b]);
      }
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
inline void rest(int64_t left, const uint8_t* w, int64_t k_len, const float* x, float* y, int64_t ldy, Prefetch& pf) {
  // the last R % RB input rows in one tile
  if (left == 3) tile<K, NB, 3>(w, k_len, x, k_len, y, ldy, pf);
  if (left == 2) tile<K, NB, 2>(w, k_len, x, k_len, y, ldy, pf);
  if (left == 1) tile<K, NB, 1>(w, k_len, x, k_len, y, ldy, pf);
}

template <typename K>
inline void single(const uint8_t* w, int64_t k_len, const float* x, float* y) {
  v16 acc{};
  for (int64_t k = 0; k < k_len; k += K::STEP) K::fma(acc, K::read(w, k), K::read_x(x + k));
  *y = lane_sum(acc);
}

// One weight row rebuilt into float32, a chunk at a time.
template <typename K>
inline void rebuild_row(const uint8_t* w, int64_t k_len, float* out) {
  if constexpr (K::PAIRS) {
    for (int64_t k0 = 0; k0 < k_len; k0 += CHUNK) rebuild_chunk<K>(w, k0, std::min<int64_t>(CHUNK, k_len - k0), out + k0);
  } else {
    for (int64_t k = 0; k < k_len; k += K::STEP) store(out + k, K::read(w, k).v);
  }
}

// Block weights under many input rows: each block of NB weight rows is rebuilt once into float32
// scratch (a few KB, in L1) and F32's tiles run over it. The same floats in the same fixed order
// per output, so the same bits as rebuilding inside every tile, at a quarter of the rebuilding.
template <typename K>
void run_rebuilt(const uint8_t* W, int64_t N, int64_t k_len, const float* X, int64_t R, float* Y) {
  constexpr int NB = K::NB, RB = F32::RB;
  const int64_t rb = K::row_bytes(k_len), blocks = N / NB;
  at::parallel_for(0, blocks, 4, [&](int64_t t0, int64_t t1) {
    std::vector<float> scratch(NB * k_len);
    const uint8_t* src = scratch.empty() ? nullptr : reinterpret_cast<const uint8_t*>(scratch.data());
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* w = W + t * NB * rb;
      for (int a = 0; a < NB; ++a) rebuild_row<K>(w + a * rb, k_len, scratch.data() + a * k_len);
      const char* next = reinterpret_cast<const char*>(w + NB * rb);
      Prefetch pf{next, t + 1 < t1 ? next + NB * rb : next, 1};
      float* y = Y + t * NB;
      int64_t r = 0;
      for (; r + RB <= R; r += RB) tile<F32, NB, RB>(src, k_len, X + r * k_len, k_len, y + r * N, N, pf);
      rest<F32, NB>(R - r, src, k_len, X + r * k_len, y + r * N, N, pf);
    }
  });
  for (int64_t n = blocks * NB; n < N; ++n)
    for (int64_t r = 0; r < R; ++r) single<K>(W + n * rb, k_len, X + r * k_len, Y + r * N + n);
}

// Y[R, N] = X[R, k] @ W[N, k].T: weight rows in blocks of NB, run by the threads; within a block
// every input row in tiles of RB (the block stays in cache between them), the next block
// prefetched meanwhile; the N % NB last weight rows one dot product at a time.
template <typename K>
void run(const void* W_, int64_t N, int64_t k_len, const float* X, int64_t R, float* Y) {
  constexpr int NB = K::NB, RB = K::RB;
  static_assert(RB <= 4, "rest() covers remainders up to 3");
  const uint8_t* W = static_cast<const uint8_t*>(W_);
  const int64_t rb = K::row_bytes(k_len);
  const int64_t blocks = N / NB;
  const int tiles = static_cast<int>(R / RB + (R % RB != 0));
  const int64_t block_bytes = NB * rb;
  if constexpr (K::BLOCKS) {
    if (R > RB) {  // more rows than one tile: rebuild each block of weight rows once, not once a tile
      run_rebuilt<K>(W, N, k_len, X, R, Y);
      return;
    }
  }
  at::parallel_for(0, blocks, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* w = W + t * block_bytes;
      const char* next = reinterpret_cast<const char*>(w + block_bytes);
      Prefetch pf{next, t + 1 < t1 ? next + block_bytes : next, (NB + tiles - 1) / tiles};  // lines a step
      float* y = Y + t * NB;
      int64_t r = 0;
      for (; r + RB <= R; r += RB) tile<K, NB, RB>(w, k_len, X + r * k_len, k_len, y + r * N, N, pf);
      rest<K, NB>(R - r, w, k_len, X + r * k_len, y + r * N, N, pf);
    }
  });
  for (int64_t n = blocks * NB; n < N; ++n)
    for (int64_t r = 0; r < R; ++r) single<K>(W + n * rb, k_len, X + r * k_len, Y + r * N + n);
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

// GGML's type ids (gguf-py's GGMLQuantizationType) -> the block kernels above; ROW_I8 is ours
static constexpr int64_t ROW_I8 = 100;
static int64_t q_block(int64_t t) {
  switch (t) {
    case 2: case 3: case 6: case 7: case 8: return 32;
    case 12: case 13: case 14: return 256;
    case ROW_I8: return 16;
  }
  return 0;
}
static int64_t q_bytes(int64_t t) {
  switch (t) {
    case 2: return 18; case 3: return 20; case 6: return 22; case 7: return 24; case 8: return 34;
    case 12: return 144; case 13: return 176; case 14: return 210;
  }
  return 0;
}

bool block_type_known(int64_t qtype) { return q_block(qtype) != 0; }
static int64_t q_row_bytes(int64_t t, int64_t k_len) { return t == ROW_I8 ? k_len + 4 : k_len / q_block(t) * q_bytes(t); }

template <typename K>
static void rebuild_rows(const uint8_t* W, int64_t k_len, const int64_t* idx, int64_t n, float* out) {
  const int64_t rb = K::row_bytes(k_len);
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      rebuild_row<K>(W + (idx ? idx[r] : r) * rb, k_len, out + r * k_len);
    }
  });
}

at::Tensor block_rows(const at::Tensor& w, int64_t qtype, int64_t k_len, const c10::optional<at::Tensor>& rows,
                      const c10::optional<at::Tensor>& into) {
  TORCH_CHECK(block_type_known(qtype), "block_rows: unknown GGML type ", qtype);
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kByte && k_len % q_block(qtype) == 0 &&
              w.size(1) == q_row_bytes(qtype, k_len), "block_rows: a [N, blocks x bytes] uint8 weight for this row length");
  at::Tensor idx;
  const int64_t* ip = nullptr;
  int64_t n = w.size(0);
  if (rows) {
    idx = rows->to(at::kLong).contiguous();
    n = idx.numel();
    ip = idx.data_ptr<int64_t>();
    const int64_t N = w.size(0);
    for (int64_t i = 0; i < n; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < N, "block_rows: row ", ip[i], " out of range");
  }
  at::Tensor out;
  if (into) {
    TORCH_CHECK(into->scalar_type() == at::kFloat && into->is_contiguous() && into->numel() == n * k_len, "block_rows: `into` holds ",
                n, " x ", k_len, " contiguous float32 values");
    out = into->view({n, k_len});
  } else {
    out = at::empty({n, k_len}, at::TensorOptions().dtype(at::kFloat));
  }
  if (n == 0) return out;
  const uint8_t* W = w.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  switch (qtype) {
    case 2: rebuild_rows<Q4_0>(W, k_len, ip, n, o); break;
    case 3: rebuild_rows<Q4_1>(W, k_len, ip, n, o); break;
    case 6: rebuild_rows<Q5_0>(W, k_len, ip, n, o); break;
    case 7: rebuild_rows<Q5_1>(W, k_len, ip, n, o); break;
    case 8: rebuild_rows<Q8_0>(W, k_len, ip, n, o); break;
    case 12: rebuild_rows<Q4_K>(W, k_len, ip, n, o); break;
    case 13: rebuild_rows<Q5_K>(W, k_len, ip, n, o); break;
    case 14: rebuild_rows<Q6_K>(W, k_len, ip, n, o); break;
    case ROW_I8: rebuild_rows<RowI8>(W, k_len, ip, n, o); break;
  }
  return out;
}

void block_into(const at::Tensor& x, const at::Tensor& w, int64_t qtype, const at::Tensor* bias, at::Tensor& out) {
  const int64_t k_len = x.size(-1), N = w.size(0);
  TORCH_CHECK(block_type_known(qtype), "block_into: unknown GGML type ", qtype);
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kByte && k_len % q_block(qtype) == 0 &&
              w.size(1) == q_row_bytes(qtype, k_len), "block_into: a [N, blocks x bytes] uint8 weight for this input width");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && out.is_contiguous() && out.scalar_type() == at::kFloat &&
              out.numel() == x.numel() / k_len * N && (!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N)),
              "block_into: contiguous float32 input, bias and output of matching sizes");
  const int64_t R = x.numel() / k_len;
  if (R == 0) return;
  const float* X = x.data_ptr<float>();
  float* y = out.data_ptr<float>();
  const void* W = w.data_ptr<uint8_t>();
  switch (qtype) {
    case 2: run<Q4_0>(W, N, k_len, X, R, y); break;
    case 3: run<Q4_1>(W, N, k_len, X, R, y); break;
    case 6: run<Q5_0>(W, N, k_len, X, R, y); break;
    case 7: run<Q5_1>(W, N, k_len, X, R, y); break;
    case 8: run<Q8_0>(W, N, k_len, X, R, y); break;
    case 12: run<Q4_K>(W, N, k_len, X, R, y); break;
    case 13: run<Q5_K>(W, N, k_len, X, R, y); break;
    case 14: run<Q6_K>(W, N, k_len, X, R, y); break;
    case ROW_I8: run<RowI8>(W, N, k_len, X, R, y); break;
  }
  if (bias) {  // after the sum, as stream_into adds it
    const float* b = bias->data_ptr<float>();
    for (int64_t r = 0; r < R; ++r)
      for (int64_t n = 0; n < N; ++n) y[r * N + n] += b[n];
  }
}

at::Tensor block_linear(const at::Tensor& x, const at::Tensor& w, int64_t qtype, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "block_linear: a float32 input");
  const int64_t k_len = x.size(-1), N = w.size(0);
  auto x2 = x.reshape({-1, k_len}).contiguous();
  auto y = at::empty({x2.size(0), N}, x2.options());
  const at::Tensor b = bias ? bias->contiguous() : at::Tensor();
  block_into(x2, w, qtype, bias ? &b : nullptr, y);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}
