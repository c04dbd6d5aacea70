// products.cpp: the few-row product kernel (rowgemm.py's `stream`).
#pragma once
#include <torch/extension.h>

// Whether `w` is a weight stream_linear takes (2-D, contiguous, float32/bfloat16, rows a whole
// number of its steps: 16 values in float32, 32 in bfloat16).
bool stream_fits(const at::Tensor& w);

// x @ w.T (+ bias), in x's dtype, accumulated in float32.
at::Tensor stream_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);

// The same product, float32 only, into `out` (contiguous, [rows, w.size(0)]): the native layer
// loop's work buffers, so a forward allocates no fresh pages (a first touch cost more than the
// arithmetic it holds on some VMs).
void stream_into(const at::Tensor& x, const at::Tensor& w, const at::Tensor* bias, at::Tensor& out);

// GGUF block weights (GGML type ids 2, 3, 6, 7, 8, 12, 13, 14: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K
// Q6_K), w a [N, row bytes] uint8 tensor of the file's blocks: bitwise the float32 stream product
// over gguf-py's dequantization of w, from the blocks' bytes.
bool block_type_known(int64_t qtype);
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& w, int64_t qtype, const c10::optional<at::Tensor>& bias);
void block_into(const at::Tensor& x, const at::Tensor& w, int64_t qtype, const at::Tensor* bias, at::Tensor& out);
// Type 100 (not GGML's): eagle2's weight-only 8-bit, a row = float32 scale + int8 values, scale * q.
// The float32 rows `rows` (all where None) of a block weight whose rows are k_len long, rebuilt as
// the products read them [n, k_len]: an embedding lookup, or a float32 copy for `generate`.
at::Tensor block_rows(const at::Tensor& w, int64_t qtype, int64_t k_len, const c10::optional<at::Tensor>& rows,
                      const c10::optional<at::Tensor>& into);

// int8.cpp: the same block weights (types above and ROW_I8) in integer arithmetic. Each activation
// row is quantized once per product to 8 bits (blocks of 32, or 256 for the K-quants, scale
// amax / 127), every (weight block, activation block) pair is dotted exactly in int32, and each
// output combines the integers in one fixed float32 order: bitwise the same at every row count and
// on every SIMD path (int8.cpp's head comment defines it; tests/int8_reference.py is it in numpy).
// Paths: 1 generic C++, 2 AVX2, 3 AVX512-VNNI, 4 256-bit VNNI; 0 is the best built here.
bool int8_type_known(int64_t qtype);
// qtype | 256: the weight interleaved for the AVX-512 kernel (int8.cpp: the interleaved layout)
bool int8_interleaves(int64_t qtype);
at::Tensor int8_interleave(const at::Tensor& w, int64_t qtype, bool forward);
std::vector<int64_t> int8_paths();
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, int64_t qtype, const c10::optional<at::Tensor>& bias,
                       int64_t path);
void int8_into(const at::Tensor& x, const at::Tensor& w, int64_t qtype, const at::Tensor* bias, at::Tensor& out,
               int64_t path = 0);
// The activation blocks as the kernel makes them: per block a float32 scale, the int8 values, and
// the int16 sums per 16 values ([R, K / block x (4 + block + block / 8)] bytes).
at::Tensor int8_quantize(const at::Tensor& x, int64_t qtype);

namespace eagle2 {
// Q4_K / Q5_K: the 6-bit scale and minimum of sub-block j (0-7) from the 12 packed bytes (both
// the float32 block kernel and the int8 one read them)
inline void scale_min_k4(const uint8_t* q, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = q[j] & 63;
    mn = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}
}  // namespace eagle2
