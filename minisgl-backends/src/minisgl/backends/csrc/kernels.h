// What cpu_layer.cpp calls in the other sources of the library (their own entry points are
// torch ops; these skip the dispatcher and the output allocation).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <cstdint>

namespace minisgl {

// y [M, N] = x [M, K] @ w.T, w packed by bf16_pack; x and y contiguous (cpu_linear.cpp).
void bf16_linear_into(const c10::BFloat16* x, int64_t M, int64_t K, const at::Tensor& packed,
                      int64_t N, c10::BFloat16* y);

// The paged_attention op (cpu_attention.cpp).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& slots, const at::Tensor& kv_lens,
                           const at::Tensor& q_start, const at::Tensor& q_lens, double scale,
                           int64_t window);

}  // namespace minisgl
