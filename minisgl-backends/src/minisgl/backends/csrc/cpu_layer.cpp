// decoder_layer: a whole Llama-family decoder layer of a step (prefill, extend, decode or a mix
// of them) in one call (weights packed by bf16_pack, or by int8_pack with their scales; the
// paged KV pool of cpu_attention.cpp), for the CPU backend's steps, all of a model's layers,
// bound once (bind_layers), in one decoder_layers call (below; minisgl/backends/torch_native.py,
// bind_decoder_layers):
//
//   r = x + residual (x alone in the first layer)        h = RMSNorm_in(r)
//   q, k, v = h @ Wqkv.T (+ bias), RMSNorm per head of q and k (Qwen3's, where given),
//   RoPE on q and k, k and v stored at out_loc (as int8 records in an int8 pool)
//   a = paged attention of q                              r2 = a @ Wo.T (+ bias) + r
//   h2 = RMSNorm_post(r2), [g u] = h2 @ Wgu.T             y = (silu(g) * u) @ Wdown.T
//
// and returns (y, r2), what the model's Python layer returns. Why: a batch-1 SmolLM2 decode step
// spent ~20% of its time outside the weight stream, ~0.9 ms of 8.8 in the compiled graph's Python
// wrapper and Inductor's small kernels (~30 lines per layer around 4 linears, the attention and
// 3 fused kernels) while the memory bus idled; one call per layer leaves the linears and the
// attention as C++ calls back to back (wrapper 0.89 -> 0.33 ms per step; decode 1.04x at batch
// 1, 1.06-1.08x at 16 requests, docs/benchmarks.md). In a prefill, Inductor's norm and RoPE
// kernels and the Python between them left the other thread waiting ~11% of its time: one call
// per layer there made a 1,024-token prefill 1.07x faster. Every intermediate is rounded to bf16
// where the PyTorch layer rounds it (the residual sum, the normalized rows, each RoPE product and
// their sum, silu(g), the product with u), so the result is the eager layer's up to the order of
// float32 sums.

#include <ATen/Config.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <c10/util/BFloat16.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kernels.h"

// Two builds, as the linears and the attention: AVX512-BF16, or AVX2 with FMA.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define MINISGL_LAYER_FAST 1
#define MINISGL_LAYER_AVX2 0
#include <immintrin.h>

#include "vec.h"
#elif defined(__AVX2__) && defined(__FMA__)
#define MINISGL_LAYER_FAST 0
#define MINISGL_LAYER_AVX2 1
#include <immintrin.h>

#include "vec.h"
#else
#define MINISGL_LAYER_FAST 0
#define MINISGL_LAYER_AVX2 0
#endif
#define MINISGL_LAYER_ANY (MINISGL_LAYER_FAST || MINISGL_LAYER_AVX2)

namespace {

using bf16 = c10::BFloat16;

// Rows are independent; a few run on the calling thread (no parallel region at batch 1).
template <class Fn>
void each_row(int64_t M, const Fn& fn) {
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) fn(m);
  });
}

#if MINISGL_LAYER_FAST

// 16 lanes (fewer at the end of n): bf16 <-> float32, rounding to nearest even like c10.
inline __mmask16 tail(int64_t i, int64_t n) {
  return n - i >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
}
inline __m512 load(const bf16* p, __mmask16 k) {
  return _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(k, p));
}
inline __m256i round16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
inline __m512 rounded(__m512 v) { return _mm512_cvtpbh_ps((__m256bh)round16(v)); }
inline void store(bf16* p, __m512 v, __mmask16 k) { _mm256_mask_storeu_epi16(p, k, round16(v)); }

// r = x + res (or x), y = w * (r * rsqrt(mean(r^2) + eps)) for one row of H, rounded as
// RMSNorm rounds them.
void norm_row(const bf16* x, const bf16* res, const bf16* w, double eps, int64_t H, bf16* r,
              bf16* y) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < H; i += 16) {
    const __mmask16 k = tail(i, H);
    __m512 v = load(x + i, k);
    if (res != nullptr) v = rounded(_mm512_add_ps(v, load(res + i, k)));
    store(r + i, v, k);
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const float mean = _mm512_reduce_add_ps(ss) / static_cast<float>(H);
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(mean + static_cast<float>(eps)));
  for (int64_t i = 0; i < H; i += 16) {
    const __mmask16 k = tail(i, H);
    const __m512 normed = rounded(_mm512_mul_ps(load(r + i, k), inv));
    store(y + i, _mm512_mul_ps(load(w + i, k), normed), k);
  }
}

// y[m] += b (a linear layer's bias), rounded to bf16.
void add_bias(bf16* y, const bf16* b, int64_t M, int64_t N) {
  each_row(M, [&](int64_t m) {
    for (int64_t i = 0; i < N; i += 16) {
      const __mmask16 k = tail(i, N);
      store(y + m * N + i, _mm512_add_ps(load(y + m * N + i, k), load(b + i, k)), k);
    }
  });
}

// src rotated by (cos, sin) of its row (NeoX / rotate-half) into dst, each product and the sum
// rounded to bf16 like `q * cos + rotate_half(q) * sin` on bf16 tensors; D % 32 == 0.
inline void rope(const bf16* src, const bf16* c, const bf16* s, int64_t D, bf16* dst) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; d += 16) {
    const __m512 lo = load(src + d, 0xFFFF), hi = load(src + d + half, 0xFFFF);
    const __m512 neg_hi = _mm512_sub_ps(_mm512_setzero_ps(), hi);
    store(dst + d, _mm512_add_ps(rounded(_mm512_mul_ps(lo, load(c + d, 0xFFFF))),
                                 rounded(_mm512_mul_ps(neg_hi, load(s + d, 0xFFFF)))), 0xFFFF);
    store(dst + d + half,
          _mm512_add_ps(rounded(_mm512_mul_ps(hi, load(c + d + half, 0xFFFF))),
                        rounded(_mm512_mul_ps(lo, load(s + d + half, 0xFFFF)))), 0xFFFF);
  }
}

#elif MINISGL_LAYER_AVX2

// The same steps 8 lanes at a time (the last n % 8 through a zero-padded copy).
using minisgl_vec::load_bf16;
using minisgl_vec::rounded;
using minisgl_vec::store_bf16;

void norm_row(const bf16* x, const bf16* res, const bf16* w, double eps, int64_t H, bf16* r,
              bf16* y) {
  __m256 ss = _mm256_setzero_ps();
  for (int64_t i = 0; i < H; i += 8) {
    __m256 v = load_bf16(x + i, H - i);
    if (res != nullptr) v = rounded(_mm256_add_ps(v, load_bf16(res + i, H - i)));
    store_bf16(r + i, v, H - i);
    ss = _mm256_fmadd_ps(v, v, ss);
  }
  const float mean = minisgl_vec::hsum8(ss) / static_cast<float>(H);
  const __m256 inv = _mm256_set1_ps(1.f / std::sqrt(mean + static_cast<float>(eps)));
  for (int64_t i = 0; i < H; i += 8) {
    const __m256 normed = rounded(_mm256_mul_ps(load_bf16(r + i, H - i), inv));
    store_bf16(y + i, _mm256_mul_ps(load_bf16(w + i, H - i), normed), H - i);
  }
}

void add_bias(bf16* y, const bf16* b, int64_t M, int64_t N) {
  each_row(M, [&](int64_t m) {
    for (int64_t i = 0; i < N; i += 8)
      store_bf16(y + m * N + i, _mm256_add_ps(load_bf16(y + m * N + i, N - i),
                                               load_bf16(b + i, N - i)), N - i);
  });
}

inline void rope(const bf16* src, const bf16* c, const bf16* s, int64_t D, bf16* dst) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; d += 8) {
    const __m256 lo = load_bf16(src + d), hi = load_bf16(src + d + half);
    const __m256 neg_hi = _mm256_sub_ps(_mm256_setzero_ps(), hi);
    store_bf16(dst + d, _mm256_add_ps(rounded(_mm256_mul_ps(lo, load_bf16(c + d))),
                                      rounded(_mm256_mul_ps(neg_hi, load_bf16(s + d)))));
    store_bf16(dst + d + half,
               _mm256_add_ps(rounded(_mm256_mul_ps(hi, load_bf16(c + d + half))),
                             rounded(_mm256_mul_ps(lo, load_bf16(s + d + half)))));
  }
}

#endif  // the builds

#if MINISGL_LAYER_ANY
void add_rms_norm(const bf16* x, const bf16* res, const bf16* w, double eps, int64_t M,
                  int64_t H, bf16* r, bf16* y) {
  each_row(M, [&](int64_t m) {
    norm_row(x + m * H, res == nullptr ? nullptr : res + m * H, w, eps, H, r + m * H, y + m * H);
  });
}

#endif

void check(bool ok, const char* what) { TORCH_CHECK(ok, "decoder_layer: ", what); }

// A row of D bf16 values as an int8 pool record (KVPool's int8 records): D values round(x *
// inv), inv = 127 / max|x| (0 for a row of zeros), then the float32 scale max|x| x (1 / 127),
// each step in float32 as minisgl.core.kvcache.quantize_kv_rows computes it, so that both write
// the same bytes (tested; -ffast-math would turn max|x| / 127 into that product anyway).
void quantize_row(const bf16* x, int64_t D, int8_t* out) {
#if MINISGL_LAYER_FAST
  // 16 at a time (the compiler's loops took 256-bit steps and a scalar max); the same float32
  // operations: max, one division, products, round to nearest even (|x * inv| <= 127 up to an
  // ulp, which rounds to 127: the saturating pack never saturates)
  __m512 amax16 = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16)
    amax16 = _mm512_max_ps(amax16, _mm512_abs_ps(load(x + d, 0xFFFF)));
  const float amax = _mm512_reduce_max_ps(amax16);
  const float inv = amax > 0.f ? 127.f / amax : 0.f, scale = amax * (1.f / 127.f);
  for (int64_t d = 0; d < D; d += 16)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + d),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(
                         _mm512_mul_ps(load(x + d, 0xFFFF), _mm512_set1_ps(inv)))));
#else
  float v[256], amax = 0.f;
  for (int64_t d = 0; d < D; ++d) {
    v[d] = static_cast<float>(x[d]);
    amax = std::max(amax, std::fabs(v[d]));
  }
  const float inv = amax > 0.f ? 127.f / amax : 0.f, scale = amax * (1.f / 127.f);
  for (int64_t d = 0; d < D; ++d)
    out[d] = static_cast<int8_t>(std::clamp(std::nearbyint(v[d] * inv), -127.f, 127.f));
#endif
  std::memcpy(out + D, &scale, sizeof(scale));
}

// decoder_layer's (y, r2), written to y and r2 [M, hidden]: these may be x's and residual's
// memory (both are read, into scratch, before either is written), so that a run of layers
// updates one pair in place instead of allocating two tensors per layer.
// keep (MK rows of x, or null for all M): the rows whose (y, r2) the caller reads, the only ones
// written, to the first MK rows of y and r2 in keep's order. Every row's K and V are stored; the
// attention, O and the MLP run for the kept rows alone (the last layer of a step that samples
// from a prefill's last tokens: for a 1,024-token prompt all but 1/1,024 of that layer's work
// after its K/V). Where the kept rows are each request's last (suffixes of their rows, as the
// engine samples), only their queries attend; else every row's do, and the kept are picked after.
void layer_into(
    const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& in_norm,
    const at::Tensor& post_norm, at::TensorList weights, at::TensorList scales,
    const std::optional<at::Tensor>& qkv_bias, const std::optional<at::Tensor>& o_bias,
    const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
    const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_pool,
    const at::Tensor& v_pool, const at::Tensor& out_loc, const at::Tensor& slots,
    const at::Tensor& kv_lens, const at::Tensor& q_start, const at::Tensor& q_lens, double scale,
    double eps, int64_t heads, int64_t kv_heads, int64_t window, bf16* y, bf16* r2,
    const int64_t* keep = nullptr, int64_t MK = 0, int64_t split_threads = 0) {
  TORCH_CHECK(MINISGL_LAYER_ANY, "decoder_layer needs AVX2 with FMA (or AVX512-BF16)");
  // an int8 pool: rows of D values and a float32 scale (see quantize_row)
  const bool q8 = k_pool.scalar_type() == at::kChar;
  const int64_t M = x.size(0), H = x.size(1), S = k_pool.size(1);
  const int64_t D = q8 ? k_pool.size(2) - 4 : k_pool.size(2);
  const int64_t row_bytes = k_pool.size(2) * (q8 ? 1 : 2);
  const int64_t NQ = heads * D, NKV = kv_heads * D, NQKV = NQ + 2 * NKV;
  check(weights.size() == 4 && (scales.empty() || scales.size() == 4),
        "weights: qkv, o, gate_up, down (packed); scales: none (bf16) or theirs (int8)");
  // y [rows, N] = x [rows, K] @ weights[i].T
  auto linear = [&](int i, const bf16* in, int64_t rows, int64_t K, bf16* out, int64_t N) {
    minisgl::linear_into(in, rows, K, weights[i], scales.empty() ? nullptr : &scales[i], N, out);
  };
  const int64_t I = weights[3].size(1) * 2;  // intermediate size: the down projection's inputs
  check(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
        "x must be contiguous bf16 [M, hidden]");
  check(!residual || (residual->sizes() == x.sizes() && residual->is_contiguous() &&
                      residual->scalar_type() == at::kBFloat16), "residual must be like x");
  for (const at::Tensor* t : {&in_norm, &post_norm})
    check(t->numel() == H && t->is_contiguous() && t->scalar_type() == at::kBFloat16,
          "norm weights: bf16 [hidden]");
  for (const at::Tensor* t : {&cos, &sin})  // ([M, 1, head_dim]: RotaryEmbedding.lookup's)
    check((t->dim() == 2 || (t->dim() == 3 && t->size(1) == 1)) && t->size(0) == M &&
              t->size(-1) == D && t->is_contiguous() && t->scalar_type() == at::kBFloat16,
          "cos, sin: contiguous bf16 [M, head_dim] (or [M, 1, head_dim])");
  check(k_pool.dim() == 3 && k_pool.size(0) == kv_heads && k_pool.sizes() == v_pool.sizes() &&
            k_pool.is_contiguous() && v_pool.is_contiguous() &&
            (k_pool.scalar_type() == at::kBFloat16 || q8) &&
            v_pool.scalar_type() == k_pool.scalar_type(),
        "k_pool, v_pool: contiguous bf16 [kv_heads, slots, head_dim] (or int8 [.., head_dim + 4])");
  check(out_loc.numel() == M && out_loc.scalar_type() == at::kLong && out_loc.is_contiguous(),
        "out_loc: int64 [M]");
  const int64_t* loc = out_loc.const_data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) check(loc[m] >= 0 && loc[m] < S, "out_loc outside the pool");
  // x's rows are the requests' new tokens back to back (paged_attention checks the rest)
  check(q_start.scalar_type() == at::kLong && q_lens.scalar_type() == at::kLong &&
            q_start.is_contiguous() && q_lens.is_contiguous() && q_start.numel() == q_lens.numel(),
        "q_start, q_lens: contiguous int64 [B]");
  const int64_t* qs = q_start.const_data_ptr<int64_t>();
  const int64_t* ql = q_lens.const_data_ptr<int64_t>();
  int64_t rows = 0;
  for (int64_t b = 0; b < q_lens.numel(); rows += ql[b++])
    check(qs[b] == rows && ql[b] >= 1, "requests' rows must follow each other: q_start[b] = "
                                       "q_start[b - 1] + q_lens[b - 1], from 0, q_lens >= 1");
  check(rows == M, "the requests' q_lens must add up to x's rows");
  if (keep == nullptr) MK = M;
  for (int64_t i = 0; keep != nullptr && i < MK; ++i)
    check(keep[i] >= 0 && keep[i] < M, "rows: outside x's rows");

  check(D % 32 == 0 && D <= 256, "head_dim must be a multiple of 32, at most 256");
  auto vec = [&](const std::optional<at::Tensor>& t, int64_t n) {
    check(!t || (t->numel() == n && t->is_contiguous() && t->scalar_type() == at::kBFloat16),
          "biases and q/k norm weights: contiguous bf16 of their layer's outputs / head_dim");
    return t ? t->const_data_ptr<bf16>() : nullptr;
  };
  const bf16* qkv_b = vec(qkv_bias, NQKV);
  const bf16* o_b = vec(o_bias, H);
  const bf16* qn = vec(q_norm, D);
  const bf16* kn = vec(k_norm, D);
  check((qn == nullptr) == (kn == nullptr), "q_norm and k_norm: both or neither");
#if MINISGL_LAYER_ANY
  // the intermediates in one piece of scratch memory; y and r2 are the outputs
  thread_local std::vector<char> memory;
  const size_t row = M * sizeof(bf16);
  const auto p = minisgl::scratch(
      memory, {row * H, row * H, row * NQKV, row * H, row * I, row * NQ, row * NQ});
  auto* r = reinterpret_cast<bf16*>(p[0]);
  auto* h = reinterpret_cast<bf16*>(p[1]);
  auto* qkv = reinterpret_cast<bf16*>(p[2]);
  auto* o = reinterpret_cast<bf16*>(p[3]);
  auto* act = reinterpret_cast<bf16*>(p[4]);
  auto* q = reinterpret_cast<bf16*>(p[5]);  // the attention's input [M, heads, D]
  auto* a = reinterpret_cast<bf16*>(p[6]);  // and output
  add_rms_norm(x.const_data_ptr<bf16>(), residual ? residual->const_data_ptr<bf16>() : nullptr,
               in_norm.const_data_ptr<bf16>(), eps, M, H, r, h);
  linear(0, h, M, H, qkv, NQKV);
  if (qkv_b != nullptr) add_bias(qkv, qkv_b, M, NQKV);

  auto* kp = static_cast<char*>(k_pool.mutable_data_ptr());
  auto* vp = static_cast<char*>(v_pool.mutable_data_ptr());
  each_row(M, [&](int64_t m) {
    const bf16* row = qkv + m * NQKV;
    const bf16* c = cos.const_data_ptr<bf16>() + m * D;
    const bf16* s = sin.const_data_ptr<bf16>() + m * D;
    bf16 copy[256], normed[256], roped[256];  // a head of q or k, after its RMSNorm (Qwen3),
                                              // k after RoPE (int8 pools)
    auto head = [&](const bf16* src, const bf16* w) {
      if (w == nullptr) return src;
      norm_row(src, nullptr, w, eps, D, copy, normed);
      return static_cast<const bf16*>(normed);
    };
    for (int64_t hd = 0; hd < heads; ++hd)
      rope(head(row + hd * D, qn), c, s, D, q + (m * heads + hd) * D);
    for (int64_t hd = 0; hd < kv_heads; ++hd) {
      char* kdst = kp + (hd * S + loc[m]) * row_bytes;
      char* vdst = vp + (hd * S + loc[m]) * row_bytes;
      const bf16* vsrc = row + NQ + NKV + hd * D;
      if (q8) {
        rope(head(row + NQ + hd * D, kn), c, s, D, roped);
        quantize_row(roped, D, reinterpret_cast<int8_t*>(kdst));
        quantize_row(vsrc, D, reinterpret_cast<int8_t*>(vdst));
      } else {
        rope(head(row + NQ + hd * D, kn), c, s, D, reinterpret_cast<bf16*>(kdst));
        std::memcpy(vdst, vsrc, D * sizeof(bf16));
      }
    }
  });

  if (MK == 0) return;
  // the kept rows: each request's last ones? then its attention has those queries only
  const int64_t B = q_lens.numel();
  thread_local std::vector<int64_t> kept_start, kept_lens;
  bool suffixes = keep != nullptr;
  if (suffixes) {
    kept_start.resize(B);
    kept_lens.resize(B);
    int64_t i = 0;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t end = qs[b] + ql[b];
      int64_t c = 0;
      while (i + c < MK && keep[i + c] >= qs[b] && keep[i + c] < end) ++c;
      for (int64_t j = 0; j < c; ++j) suffixes = suffixes && keep[i + j] == end - c + j;
      kept_start[b] = end - c;
      kept_lens[b] = c;
      i += c;
    }
    suffixes = suffixes && i == MK;
  }
  const auto index = at::TensorOptions().dtype(at::kLong);
  minisgl::paged_attention_into(
      q, M, heads, D, k_pool, v_pool, slots, kv_lens,
      suffixes ? at::from_blob(kept_start.data(), {B}, index) : q_start,
      suffixes ? at::from_blob(kept_lens.data(), {B}, index) : q_lens, scale, window, a,
      split_threads);
  const bf16* ak = a;  // the kept rows' attention outputs and residuals, in keep's order
  const bf16* rk = r;
  if (keep != nullptr) {  // (into q's scratch, no longer read, and act's, not yet written)
    for (int64_t i = 0; i < MK; ++i) {
      std::memcpy(q + i * NQ, a + keep[i] * NQ, NQ * sizeof(bf16));
      std::memcpy(act + i * H, r + keep[i] * H, H * sizeof(bf16));
    }
    ak = q;
    rk = act;
  }
  linear(1, ak, MK, NQ, o, H);
  if (o_b != nullptr) add_bias(o, o_b, MK, H);
  add_rms_norm(o, rk, post_norm.const_data_ptr<bf16>(), eps, MK, H, r2, h);

  minisgl::gated_into(h, MK, H, weights[2], scales.empty() ? nullptr : &scales[2], I, act);
  linear(3, act, MK, I, y, H);
#endif
}

std::tuple<at::Tensor, at::Tensor> decoder_layer(
    const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& in_norm,
    const at::Tensor& post_norm, at::TensorList weights, at::TensorList scales,
    const std::optional<at::Tensor>& qkv_bias, const std::optional<at::Tensor>& o_bias,
    const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
    const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_pool,
    const at::Tensor& v_pool, const at::Tensor& out_loc, const at::Tensor& slots,
    const at::Tensor& kv_lens, const at::Tensor& q_start, const at::Tensor& q_lens, double scale,
    double eps, int64_t heads, int64_t kv_heads, int64_t window) {
  const auto opt = x.options().dtype(at::kBFloat16);
  at::Tensor y = at::empty(x.sizes(), opt), r2 = at::empty(x.sizes(), opt);
  layer_into(x, residual, in_norm, post_norm, weights, scales, qkv_bias, o_bias, q_norm, k_norm,
             cos, sin, k_pool, v_pool, out_loc, slots, kv_lens, q_start, q_lens, scale, eps, heads,
             kv_heads, window, y.mutable_data_ptr<bf16>(), r2.mutable_data_ptr<bf16>());
  return {y, r2};
}

// A team: a few-row step's layers (a decode step of up to 15 requests) run inside one OpenMP
// region, the calling thread working through them while the others wait (Word) for the
// parallel_chunks calls of its linears and attention, whose grains they share (work). Why: ~150
// parallel regions per batch-1 step, each ~1.3 us from the call to the threads' start (ATen's
// parallel_for, libgomp waking the team with a futex call) and ~0.75 us of end barrier (another)
// by rdtsc around the GEMVs (docs/benchmarks.md); a flag each way costs a cache line's transfer.
// Measured, the 30 layers of a batch-1 SmolLM2 step replayed, the two builds alternating call by
// call: 1.01x at this host's slow reads, 1.03x at its fast ones; 4 requests 1.006x.

// A 32-bit word that threads wait on: spinning a few microseconds, then asleep in the kernel
// (futex) until a writer wakes them. Why not spin on: with more runnable threads than cores (a
// laptop's browser, the server's own processes, a slower core of a hybrid CPU) a spinning thread
// takes the time slices of the thread it waits for; see work() below for the measurements.
struct alignas(64) Word {
  std::atomic<uint32_t> v{0};
  std::atomic<uint32_t> sleepers{0};
  // Waits until v != seen, or ready() (checked in between; true ends the wait), whichever first.
  template <class Ready>
  uint32_t wait_while(uint32_t seen, const Ready& ready) {
    for (int64_t spins = 0;; ++spins) {
      const uint32_t now = v.load(std::memory_order_acquire);
      if (now != seen || ready()) return now;
      if (spins < kSpins) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
        continue;
      }
      sleepers.fetch_add(1, std::memory_order_seq_cst);
      if (v.load(std::memory_order_seq_cst) == seen && !ready()) {
        const timespec limit{0, 2000000};  // 2 ms: a missed wake costs time, never a hang
        syscall(SYS_futex, reinterpret_cast<uint32_t*>(&v), FUTEX_WAIT_PRIVATE, seen, &limit,
                nullptr, 0);
      }
      sleepers.fetch_sub(1, std::memory_order_seq_cst);
    }
  }
  void set(uint32_t value) {
    v.store(value, std::memory_order_seq_cst);
    wake();
  }
  void bump() {
    v.fetch_add(1, std::memory_order_seq_cst);
    wake();
  }
  void wake() {
    if (sleepers.load(std::memory_order_seq_cst) > 0)
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&v), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr,
              nullptr, 0);
  }
  static constexpr int64_t kSpins = 256;  // ~7 us of pause on AMD Zen 5 (~27 ns each)
};

// A thread's share of a job's grains and how many grains it has finished (all jobs so far),
// each on its own line: the owner claims its grains front to back with an uncontended CAS; a
// thread whose share is done takes grains from the back of another's (below).
struct alignas(64) Share {
  std::atomic<uint64_t> w{0};  // job tag (32 bits) | end (16) | next (16), in grains
  std::atomic<uint64_t> done{0};
};
constexpr int64_t kMaxTeam = 64;
constexpr int64_t kGrains = 4;  // grains per thread and job (fewer where the job has fewer)
// A job of at least kTaperFrom items per thread is tapered instead: each share in 5 grains of
// 8/16, 4/16, 2/16, 1/16 and 1/16 of it, so that the grains a thread finishes last, or takes
// from another's share, are small. Why: with 4 equal grains the caller, which starts each job
// first, waited for the other thread's last grain at the end of most jobs: 6-11% of a 6-15-row
// bf16 decode step's layers (2-3 us a job), 2-5% at 1-4 rows. Share boundaries and a share's
// first two cuts stay at multiples of the job's `align` (the linears' panel width); the small
// grains at the end need not. Measured on AMD Zen 5 (2 threads, SmolLM2, the two schemes
// alternating step by step in one process, 6-8 rounds; docs/benchmarks.md): the caller's wait
// 8.0 -> 2.9% of the layers' time at 12 rows, 10.6 -> 2.1% at 15; decode steps 0.94-0.98x the
// time at 6-15 rows, 0.99x at 1-4; int8 (bound by reading the weights) unchanged. On AMD Zen 4
// (fifty-fifth sitting): 1 row 0.97x, 8 rows 0.93x.
constexpr int64_t kTaperFrom = 16;
constexpr int64_t kTaperGrains = 5;
constexpr int64_t kTaper[kTaperGrains] = {0, 8, 12, 14, 15};  // where they begin, in 16ths
struct Team {
  int64_t n = 0;                 // threads
  Word posted;                   // generation of the job below (or of the exit)
  Word finished;                 // bumped after a grain while the caller waits for the last ones
  std::atomic<bool> waiting{false};
  Share share[kMaxTeam];
  const minisgl::ChunkFn* job = nullptr;
  int64_t count = 0, align = 1, grains = 0;  // the job's items (in grains of `align` items)
  bool tapered = false;                      // in grains of kTaper's sizes
  bool exit = false;
  std::exception_ptr error[kMaxTeam];
};
thread_local Team* my_team = nullptr;  // the calling thread's, while it runs a team's body

// Grain g of a job (of `grains`) from share s, the owner's next one or another's last one,
// while the share holds the job's tag (a stale thread's claim on a newer job's share fails).
inline bool claim(Share& s, uint32_t tag, bool own, int64_t& g) {
  uint64_t w = s.w.load(std::memory_order_acquire);
  for (;;) {
    const int64_t next = w & 0xFFFF, end = (w >> 16) & 0xFFFF;
    if ((w >> 32) != tag || next >= end) return false;
    const uint64_t v = own ? w + 1 : w - (uint64_t(1) << 16);
    if (s.w.compare_exchange_weak(w, v, std::memory_order_acq_rel, std::memory_order_acquire)) {
      g = own ? next : end - 1;
      return true;
    }
  }
}

// Thread t's part of job `tag`: its own grains, then any left in the others' shares. Why grains
// and not one contiguous chunk per thread: a thread the OS has descheduled (more runnable threads
// than cores: a laptop's browser, the server's own processes; or a slower core of a hybrid CPU)
// held up every job of a step at its end; now the others finish its share. Measured on AMD Zen 5
// (2 cores, SmolLM2, the two schemes alternating in one process; docs/benchmarks.md): with one
// busy process beside the engine, batch-1 decode 24.4 -> 21.1 ms/token (median pair 1.18x) and
// 8 requests 210 -> 276 tok/s (1.27x), where one chunk per thread and spinning waits had made
// batch 1 ~3x slower than on an idle machine; idle, 0.995x and 0.976x. (The rest of the loss is
// libgomp's own spinning between steps and time slices: the engine then runs its steps on fewer
// threads where that is faster, minisgl/core/threads.py.)
thread_local int64_t run_to = 0;  // minisgl::run_end's answer while a grain runs (0: none)
void work(Team& team, int64_t t, uint32_t tag) {
  int64_t g;
  for (int64_t u = t; u < t + team.n;) {
    if (!claim(team.share[u % team.n], tag, u == t, g)) {
      ++u;
      continue;
    }
    // (the job's fields are read after a claim: they stay until the job's grains are all done)
    const int64_t units = (team.count + team.align - 1) / team.align;
    auto item = [&](int64_t grain) {  // where a grain's items begin
      if (!team.tapered) return std::min(team.count, grain * units / team.grains * team.align);
      const int64_t share = grain / kTaperGrains, cut = grain % kTaperGrains;
      const int64_t lo = std::min(team.count, share * units / team.n * team.align);
      const int64_t hi = std::min(team.count, (share + 1) * units / team.n * team.align);
      const int64_t at = (hi - lo) * kTaper[cut] / 16;
      return lo + (cut <= 2 ? at / team.align * team.align : at);
    };
    const int64_t lo = item(g), hi = item(g + 1);
    // its own grains go on after this one, up to its share's end; another's do not
    run_to = u == t ? item((t + 1) * team.grains / team.n) : hi;
    try {
      if (lo < hi) (*team.job)(lo, hi);
    } catch (...) {
      if (!team.error[t]) team.error[t] = std::current_exception();
    }
    run_to = 0;
    team.share[t].done.fetch_add(1, std::memory_order_seq_cst);
    if (team.waiting.load(std::memory_order_seq_cst)) team.finished.bump();
  }
}

// body() on this thread with the other threads of at::get_num_threads() as its team (or alone,
// inside another parallel region or where OpenMP gives fewer threads).
// (OpenMP's parallel_for only: its team starts every thread, so each one waits for work that
// comes; a pool of tasks might never start a helper this thread then waits for.)
template <class Body>
void team_run(const Body& body) {
  const int64_t n = at::get_num_threads();
  if (!AT_PARALLEL_OPENMP || n == 1 || n > kMaxTeam || at::in_parallel_region()) {
    body();
    return;
  }
  Team team;
  team.n = n;
  at::parallel_for(0, n, 1, [&](int64_t t, int64_t end) {
    if (t == 0) {
      // exactly one index each: then all n threads are here (else a thread has two)
      struct Release {  // even if body throws: the others must not wait forever
        Team& team;
        ~Release() {
          my_team = nullptr;
          team.exit = true;
          team.posted.bump();
        }
      } release{team};
      if (end == 1) my_team = &team;
      body();
      return;
    }
    for (uint32_t seen = 0;;) {
      seen = team.posted.wait_while(seen, [] { return false; });
      if (team.exit) return;
      work(team, t, seen);
    }
  });
}

// A run of consecutive decoder layers (a model's, all of them) bound once: per layer l
// norms[2l], norms[2l + 1] (input, post-attention), weights[4l .. 4l + 3] (qkv, o, gate_up, down),
// their scales likewise (int8) or none, its qkv and o biases (one per layer, or none where the
// layers have none), its q and k norms (qk_norms[2l], [2l + 1], or none), k_pools[l],
// v_pools[l], windows[l]; scale, eps and head counts shared. bind_layers keeps them here and
// returns the run's id in an int64 tensor [1]; decoder_layers(x, residual, run, ...) then runs the
// layers, each computed as decoder_layer computes it, the output and residual of one the input of
// the next. Why bound: a step passing the ~240 weight, norm and pool tensors of SmolLM2's 30
// layers in lists to one call spent ~0.67 us per tensor on them every step (Dynamo gathering
// them as graph inputs, the wrapper passing them on, the op parsing its lists) while the memory
// bus idled; the graph now takes one small tensor. An id in a tensor, not a constant, so that a
// graph compiled in one process (the compile worker, its own run) is the graph of another.
struct LayerRun {
  std::vector<at::Tensor> norms, weights, scales, qkv_biases, o_biases, qk_norms, k_pools, v_pools;
  std::vector<int64_t> windows;
  double scale, eps;
  int64_t heads, kv_heads;
  int64_t threads;  // the attention's split_threads (paged_attention_into; 0: each call's)
};

std::mutex runs_lock;
std::unordered_map<int64_t, std::shared_ptr<const LayerRun>> runs;
int64_t next_run_id = 1;

int64_t run_id(const at::Tensor& run) {
  TORCH_CHECK(run.numel() == 1 && run.scalar_type() == at::kLong && run.device().is_cpu(),
              "decoder_layers: run must be the int64 tensor [1] bind_layers returned");
  return *run.const_data_ptr<int64_t>();
}

at::Tensor bind_layers(at::TensorList norms, at::TensorList weights, at::TensorList scales,
                       at::TensorList qkv_biases, at::TensorList o_biases, at::TensorList qk_norms,
                       at::TensorList k_pools, at::TensorList v_pools, at::IntArrayRef windows,
                       double scale, double eps, int64_t heads, int64_t kv_heads,
                       int64_t threads) {
  const size_t L = k_pools.size();
  TORCH_CHECK(threads >= 0, "bind_layers: threads must be >= 0 (0: each call's), got ", threads);
  auto per_layer = [&](at::TensorList t, size_t n) { return t.empty() || t.size() == n * L; };
  TORCH_CHECK(L >= 1 && v_pools.size() == L && windows.size() == L && norms.size() == 2 * L &&
                  weights.size() == 4 * L && per_layer(scales, 4) && per_layer(qkv_biases, 1) &&
                  per_layer(o_biases, 1) && per_layer(qk_norms, 2),
              "bind_layers: per layer 2 norms, 4 weights (4 scales or none), 1 qkv bias, 1 o "
              "bias and 2 q/k norms (or none of each), its K and V pools and window");
  auto run = std::make_shared<const LayerRun>(LayerRun{
      norms.vec(), weights.vec(), scales.vec(), qkv_biases.vec(), o_biases.vec(), qk_norms.vec(),
      k_pools.vec(), v_pools.vec(), windows.vec(), scale, eps, heads, kv_heads, threads});
  std::lock_guard<std::mutex> guard(runs_lock);
  const int64_t id = next_run_id++;
  runs.emplace(id, std::move(run));
  return at::full({1}, id, at::TensorOptions().dtype(at::kLong));
}

// Drops the run's references to its tensors; a later decoder_layers call with it is refused.
// A plain C function, called by LayerRun's finalizer through its address (unbind_layers_address):
// the garbage collector runs finalizers in whatever state it finds the thread, e.g. tracing a
// graph under the fake-tensor mode, where an op call was refused (seen in the tests) and the
// run's weights and pools stayed held.
extern "C" void minisgl_unbind_layers(int64_t id) {
  std::lock_guard<std::mutex> guard(runs_lock);
  runs.erase(id);
}

int64_t unbind_layers_address() { return reinterpret_cast<int64_t>(&minisgl_unbind_layers); }

std::tuple<at::Tensor, at::Tensor> decoder_layers(
    const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& run,
    const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& out_loc,
    const at::Tensor& slots, const at::Tensor& kv_lens, const at::Tensor& q_start,
    const at::Tensor& q_lens, const std::optional<at::Tensor>& rows) {
  const int64_t id = run_id(run);
  TORCH_CHECK(!rows || (rows->dim() == 1 && rows->scalar_type() == at::kLong &&
                        rows->is_contiguous()),
              "decoder_layers: rows must be contiguous int64 [N]");
  std::shared_ptr<const LayerRun> p;  // kept alive through the call, whatever unbinds meanwhile
  {
    std::lock_guard<std::mutex> guard(runs_lock);
    auto it = runs.find(id);
    TORCH_CHECK(it != runs.end(), "decoder_layers: no bound run ", id,
                " (unbound, or bound in another process)");
    p = it->second;
  }
  const LayerRun& r = *p;
  auto opt = [](const std::vector<at::Tensor>& t, size_t i) {
    return t.empty() ? std::optional<at::Tensor>() : std::optional<at::Tensor>(t[i]);
  };
  const at::TensorList weights(r.weights), scales(r.scales);
  // the first layer reads x and residual, every later one the pair before it, updated in place
  const auto bf = x.options().dtype(at::kBFloat16);
  at::Tensor y = at::empty(x.sizes(), bf), r2 = at::empty(x.sizes(), bf);
  // the last layer computes the rows the caller reads (rows) alone: see layer_into
  const int64_t n = r.k_pools.size(), kept = rows ? rows->numel() : x.size(0);
  auto layers = [&] {
    for (int64_t l = 0; l < n; ++l)
      layer_into(l == 0 ? x : y, l == 0 ? residual : std::optional<at::Tensor>(r2), r.norms[2 * l],
               r.norms[2 * l + 1], weights.slice(4 * l, 4),
               scales.empty() ? scales : scales.slice(4 * l, 4), opt(r.qkv_biases, l),
               opt(r.o_biases, l), opt(r.qk_norms, 2 * l), opt(r.qk_norms, 2 * l + 1), cos, sin,
               r.k_pools[l], r.v_pools[l], out_loc, slots, kv_lens, q_start, q_lens, r.scale,
               r.eps, r.heads, r.kv_heads, r.windows[l], y.mutable_data_ptr<bf16>(),
               r2.mutable_data_ptr<bf16>(),
               rows && l == n - 1 ? rows->const_data_ptr<int64_t>() : nullptr, kept, r.threads);
  };
  // a few rows: one region for all the layers (their row work runs on this thread anyway)
  if (x.dim() == 2 && x.size(0) < 16)
    team_run(layers);
  else
    layers();
  if (rows) return {y.narrow(0, 0, kept), r2.narrow(0, 0, kept)};  // (bind_layers: n >= 1)
  return {y, r2};
}

// RMSNorm of rows [M, H] on its own, as the layers take it (norm_row): (y, r) with r = x +
// residual (x where residual is None, a copy) and y = weight * norm(r), every value rounded where
// RMSNorm rounds it. The model's final norm between the layers' one call and the LM head: in
// PyTorch 8 small ops (~100-140 us of a batch-1 decode step, each op's code and data back from
// DRAM after the weights' stream), here one.
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x,
                                            const std::optional<at::Tensor>& residual,
                                            const at::Tensor& weight, double eps) {
  TORCH_CHECK(MINISGL_LAYER_ANY, "rms_norm needs AVX2 and FMA (or AVX-512)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
                  x.dim() >= 1 && weight.dim() == 1 && x.size(-1) == weight.size(0),
              "rms_norm: x [..., H] and weight [H], bf16");
  const int64_t H = x.size(-1), M = H == 0 ? 0 : x.numel() / H;
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor rc;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == at::kBFloat16,
                "rms_norm: residual must be bf16 and shaped as x");
    rc = residual->contiguous();
  }
  at::Tensor y = at::empty(x.sizes(), xc.options()), r = at::empty(x.sizes(), xc.options());
#if MINISGL_LAYER_ANY
  add_rms_norm(xc.const_data_ptr<bf16>(), rc.defined() ? rc.const_data_ptr<bf16>() : nullptr,
               wc.const_data_ptr<bf16>(), eps, M, H, r.mutable_data_ptr<bf16>(),
               y.mutable_data_ptr<bf16>());
#endif
  return {y, r};
}

}  // namespace

int64_t minisgl::run_end(int64_t hi) { return std::max(hi, run_to); }

void minisgl::parallel_chunks(int64_t count, ChunkFn fn, int64_t align) {
  Team* team = my_team;
  if (team == nullptr) {
    at::parallel_for(0, count, 1, [&](int64_t lo, int64_t hi) { fn(lo, hi); });
    return;
  }
  if (count <= 0) return;
  const int64_t n = team->n, units = (count + align - 1) / align;
  const bool tapered = count >= n * kTaperFrom;
  const int64_t grains = tapered ? n * kTaperGrains : std::min(units, n * kGrains);
  uint64_t base = 0;  // grains finished before this job (every earlier job's are)
  for (int64_t t = 0; t < n; ++t) base += team->share[t].done.load(std::memory_order_relaxed);
  team->job = &fn;
  team->count = count;
  team->align = align;
  team->grains = grains;
  team->tapered = tapered;
  const uint32_t gen = team->posted.v.load(std::memory_order_relaxed) + 1;
  for (int64_t t = 0; t < n; ++t)  // thread t's grains: t * grains / n .. (t + 1) * grains / n
    team->share[t].w.store(uint64_t(gen) << 32 | uint64_t((t + 1) * grains / n) << 16 |
                               uint64_t(t * grains / n),
                           std::memory_order_relaxed);
  team->posted.set(gen);
  work(*team, 0, gen);
  auto all_done = [&] {  // the grains others claimed and still run
    uint64_t done = 0;
    for (int64_t t = 0; t < n; ++t) done += team->share[t].done.load(std::memory_order_seq_cst);
    return done == base + static_cast<uint64_t>(grains);
  };
  if (!all_done()) {
    team->waiting.store(true, std::memory_order_seq_cst);
    for (uint32_t seen = team->finished.v.load(std::memory_order_seq_cst); !all_done();)
      seen = team->finished.wait_while(seen, all_done);
    team->waiting.store(false, std::memory_order_seq_cst);
  }
  for (int64_t t = 0; t < n; ++t)
    if (team->error[t]) std::rethrow_exception(std::exchange(team->error[t], nullptr));
}

TORCH_LIBRARY_FRAGMENT(minisgl_cpu, m) {
  m.def("decoder_layer(Tensor x, Tensor? residual, Tensor in_norm, Tensor post_norm, "
        "Tensor[] weights, Tensor[] scales, Tensor? qkv_bias, Tensor? o_bias, Tensor? q_norm, "
        "Tensor? k_norm, Tensor cos, Tensor sin, "
        "Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor out_loc, Tensor slots, Tensor kv_lens, "
        "Tensor q_start, Tensor q_lens, float scale, float eps, int heads, int kv_heads, "
        "int window) -> (Tensor, Tensor)");
  m.def("bind_layers(Tensor[] norms, Tensor[] weights, Tensor[] scales, Tensor[] qkv_biases, "
        "Tensor[] o_biases, Tensor[] qk_norms, Tensor[] k_pools, Tensor[] v_pools, int[] windows, "
        "float scale, float eps, int heads, int kv_heads, int threads=0) -> Tensor");
  m.def("unbind_layers_address() -> int", &unbind_layers_address);
  // run: written as far as the compiler knows, standing for the K/V pools the layers store to
  m.def("decoder_layers(Tensor x, Tensor? residual, Tensor(a!) run, Tensor cos, Tensor sin, "
        "Tensor out_loc, Tensor slots, Tensor kv_lens, Tensor q_start, Tensor q_lens, "
        "Tensor? rows=None) -> (Tensor, Tensor)");
  m.def("rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(minisgl_cpu, CPU, m) {
  m.impl("decoder_layer", &decoder_layer);
  m.impl("bind_layers", &bind_layers);
  m.impl("decoder_layers", &decoder_layers);
  m.impl("rms_norm", &rms_norm);
}
