// products.cpp: the few-row product kernel (rowgemm.py's `stream`).
#pragma once
#include <torch/extension.h>

// Whether `w` is a weight stream_linear takes (2-D, contiguous, float32/bfloat16, rows a whole
// number of its steps: 16 values in float32, 32 in bfloat16).
bool stream_fits(const at::Tensor& w);

// x @ w.T (+ bias), in x's dtype, accumulated in float32.
at::Tensor stream_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
