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

}  // namespace eagle2
