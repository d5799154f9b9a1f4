// What cpu_layer.cpp calls in the other sources of the library (their own entry points are
// torch ops; these skip the dispatcher and the output allocation), and their scratch memory.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <array>
#include <cstdint>
#include <vector>

namespace minisgl {

// Scratch memory for one call's intermediates: pieces of bytes[0], bytes[1], ... bytes, each
// 64-byte aligned, from `keep`, a buffer the call site holds per thread (`thread_local`, one per
// site, so that a kernel calling another does not share it), grown to the largest call's need
// and kept: no allocation per call (a batch-1 SmolLM2 decode step made ~300 of them in bf16,
// ~560 in int8, ~1 us each) and no page faults. A fresh tensor per call beyond 1 MiB (as before)
// cost a 4,096-token prefill step ~256,000 page faults, 0.55 s of kernel time in 1.4 s: its 30
// fused layers' ~35 MB each passed glibc's 32 MiB ceiling for reusing freed memory, so each
// came fresh from the kernel. What stays is the largest step's: SmolLM2's layer 8.4 KB per
// token, 35 MB at the default 4,096-token prefill steps.
template <size_t N>
std::array<char*, N> scratch(std::vector<char>& keep, const size_t (&bytes)[N]) {
  auto aligned = [](size_t n) { return (n + 63) / 64 * 64; };
  size_t total = 0;
  for (size_t n : bytes) total += aligned(n);
  if (keep.size() < total + 64) keep.resize(total + 64);
  char* p = keep.data() + (-reinterpret_cast<uintptr_t>(keep.data()) & 63);
  std::array<char*, N> pieces;
  for (size_t i = 0; i < N; p += aligned(bytes[i]), ++i) pieces[i] = p;
  return pieces;
}

// p, hidden from the optimizer. For the address of a thread_local: in a shared library each use
// of one by name is a call (__tls_get_addr), and the compiler repeats it at uses in loops rather
// than keep its result in a register (44 such calls in the prefill's tile kernel).
template <class T>
inline T* opaque(T* p) {
  asm("" : "+r"(p));
  return p;
}

// Whether AMX tiles may run here (cpu_linear.cpp): built with them, granted by Linux, and
// MINISGL_AMX not off. Decided once per process.
bool amx_usable();

// ldtilecfg's operand (palette 1): tile t has rows[t] rows of colsb[t] bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// A zero-filled tensor for packed weights, in 2 MiB pages where Linux grants them (cpu_linear.cpp).
at::Tensor weight_zeros(at::IntArrayRef sizes, at::ScalarType dtype);

// y [M, N] = x [M, K] @ w.T (cpu_linear.cpp), x and y contiguous: w packed by bf16_pack
// (scales null), or by int8_pack with w's per-output scales (int8_linear's arithmetic).
void linear_into(const c10::BFloat16* x, int64_t M, int64_t K, const at::Tensor& packed,
                 const at::Tensor* scales, int64_t N, c10::BFloat16* y);

// act [M, I] = silu(x @ gate.T) * (x @ up.T) (cpu_linear.cpp) for a weight [gate; up] [2I, K]
// packed as linear_into's; silu(g) rounded to bf16 before the product, like F.silu on bf16.
void gated_into(const c10::BFloat16* x, int64_t M, int64_t K, const at::Tensor& packed,
                const at::Tensor* scales, int64_t I, c10::BFloat16* act);

// A reference to a callable fn(lo, hi), not owning it (no allocation, unlike std::function).
class ChunkFn {
 public:
  template <class F>
  ChunkFn(const F& f)  // NOLINT: converts from any such callable
      : obj_(&f), call_([](const void* o, int64_t lo, int64_t hi) {
          (*static_cast<const F*>(o))(lo, hi);
        }) {}
  void operator()(int64_t lo, int64_t hi) const { call_(obj_, lo, hi); }

 private:
  const void* obj_;
  void (*call_)(const void*, int64_t, int64_t);
};

// fn(lo, hi) over 0 .. count: elsewhere in contiguous chunks, one per thread, as
// at::parallel_for(0, count, 1, fn) splits them (one OpenMP region); inside cpu_layer.cpp's team
// (a few-row step's layers) in grains of whole multiples of `align` items (but the last), a few
// per thread, which a thread done with its own takes from the others' (cpu_layer.cpp, work).
void parallel_chunks(int64_t count, ChunkFn fn, int64_t align = 1);

// Inside parallel_chunks' fn(lo, hi): where the items this thread runs next, after hi, end (hi
// itself where it goes on elsewhere or outside a team), for prefetching across the grains' ends.
int64_t run_end(int64_t hi);

// The paged_attention op (cpu_attention.cpp) on rows: q [T, H, D] bf16 back to back, the output
// likewise into `out` (the pools and index tensors checked there).
void paged_attention_into(const c10::BFloat16* q, int64_t T, int64_t H, int64_t D,
                          const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                          const at::Tensor& kv_lens, const at::Tensor& q_start,
                          const at::Tensor& q_lens, double scale, int64_t window,
                          c10::BFloat16* out, int64_t split_threads = 0);

}  // namespace minisgl
