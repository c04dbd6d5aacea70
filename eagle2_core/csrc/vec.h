// 16 floats as one value, by the compiler's vector extensions: the same source becomes AVX-512,
// AVX2 or NEON code for the machine it is built on (native.py builds it there).
#pragma once
#include <cstring>

namespace eagle2 {

typedef float v16 __attribute__((vector_size(64)));
typedef unsigned int u32x16 __attribute__((vector_size(64)));

inline v16 load(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

// The sum of a vector's lanes in one fixed order: l + l+8, then + 4, + 2, + 1.
inline float lane_sum(v16 v) {
  float s[16];
  std::memcpy(s, &v, sizeof s);
  float a[8], b[4];
  for (int i = 0; i < 8; ++i) a[i] = s[i] + s[i + 8];
  for (int i = 0; i < 4; ++i) b[i] = a[i] + a[i + 4];
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// sum over i < len of a[i] * b[i]: 16 lanes, their lane_sum, then the tail past the last 16
inline float dot(const float* a, const float* b, long len) {
  v16 acc{};
  long i = 0;
  for (; i + 16 <= len; i += 16) acc += load(a + i) * load(b + i);
  float s = lane_sum(acc);
  for (; i < len; ++i) s += a[i] * b[i];
  return s;
}

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
// The same for 8 accumulators (a 6 x 4 tile's last 8: reducing them as 16 cost 10% of a 16-row product)
inline void lane_sums8(const v16* acc, float* out) {
  v16 s1[4], s2[2];
  for (int i = 0; i < 4; ++i)
    s1[i] = SHUF(acc[2 * i], acc[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            SHUF(acc[2 * i], acc[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    s2[i] = SHUF(s1[2 * i], s1[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
            SHUF(s1[2 * i], s1[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  v16 s3 = SHUF(s2[0], s2[1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           SHUF(s2[0], s2[1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  // lanes: 2 each of acc 0, 4, 2, 6, 1, 5, 3, 7
  v16 r = SHUF(s3, s3, 0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14) +
          SHUF(s3, s3, 1, 3, 5, 7, 9, 11, 13, 15, 1, 3, 5, 7, 9, 11, 13, 15);
  r = SHUF(r, r, 0, 4, 2, 6, 1, 5, 3, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  std::memcpy(out, &r, 8 * sizeof(float));
}
#else
inline void lane_sums(const v16* acc, float* out) {
  for (int i = 0; i < 16; ++i) out[i] = lane_sum(acc[i]);
}
inline void lane_sums8(const v16* acc, float* out) {
  for (int i = 0; i < 8; ++i) out[i] = lane_sum(acc[i]);
}
#endif


// e^x for 16 floats: x = k ln2 + r (|r| <= ln2/2, ln2 in two parts so r is exact), e^r by its
// Taylor series to r^7 (truncation below 1e-8 relative), times 2^k built in the exponent bits.
// Within 2 ulp of expf from -87 to 88 (0.85 measured); 0 below, e^88 above (silu and softmax
// only need that range).
inline v16 vexp(v16 x) {
  typedef int i32x16 __attribute__((vector_size(64)));
  const v16 lo = v16{} - 87.0f, hi = v16{} + 88.0f;
  const auto tiny = x < lo;  // e^x below 1.7e-38, as good as 0: a masked score's weight must be 0
  x = tiny ? lo : x;
  x = x > hi ? hi : x;
  const v16 shifter = v16{} + 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  v16 k = (x * 1.44269504088896341f + shifter) - shifter;
  v16 r = x - k * 0.693145751953125f - k * 1.42860682030941723e-06f;
  v16 p = v16{} + 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  i32x16 bits = (__builtin_convertvector(k, i32x16) + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return tiny ? v16{} : p * scale;
}

}  // namespace eagle2
