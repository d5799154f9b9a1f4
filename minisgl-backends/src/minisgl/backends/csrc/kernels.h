// What cpu_layer.cpp calls in the other sources of the library (their own entry points are
// torch ops; these skip the dispatcher and the output allocation).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <cstdint>

namespace minisgl {

// y [M, N] = x [M, K] @ w.T (cpu_linear.cpp), x and y contiguous: w packed by bf16_pack
// (scales null), or by int8_pack with w's per-output scales (int8_linear's arithmetic).
void linear_into(const c10::BFloat16* x, int64_t M, int64_t K, const at::Tensor& packed,
                 const at::Tensor* scales, int64_t N, c10::BFloat16* y);

// The paged_attention op (cpu_attention.cpp).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& slots, const at::Tensor& kv_lens,
                           const at::Tensor& q_start, const at::Tensor& q_lens, double scale,
                           int64_t window);

}  // namespace minisgl
