// Weight-only int8 matmul for a few rows (decode) on CPUs with AVX512: y = x @ (w * s[:, None]).T
// Built with cpu_attention.cpp into one library by minisgl/backends/cpu_kernels.py; used by
// minisgl.core.layers.quant.int8_linear for up to a few rows when loaded.
//
// x [M, K] bf16, w [N, K] int8 (one row per output feature), s [N] bf16 (the row's scale);
// y [M, N] bf16. K must be a multiple of 16.
//
// A decode step streams every weight once from DRAM, so the kernel is about memory: each thread
// walks its share of w in blocks of 4 rows (4 K contiguous bytes), converts 16 int8 weights at a
// time to float32 in registers and multiplies them with up to 4 rows of x (float32, converted
// once per call into a per-thread buffer). While it works on one block it prefetches the
// block 8 ahead, one cache line per step, the pace at which it consumes them: on one thread the
// hardware prefetcher alone streamed a 28 MB weight (49152 x 576) at ~16 GB/s, this at ~50; on
// 2 threads a decode step's 121 SmolLM2 weights (134 MB) take 2.3 ms (~58 GB/s), ATen's 4.5.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define MINISGL_LINEAR_FAST 1
#include <immintrin.h>
#else
#define MINISGL_LINEAR_FAST 0
#endif

namespace {

constexpr int64_t kMaxRows = 4;        // rows of x per pass over w
constexpr int kBlock = 4;              // rows of w per block (the unit of work and of prefetch)
constexpr int64_t kPrefetchBlocks = 8; // how far ahead (in blocks) to prefetch

#if MINISGL_LINEAR_FAST

// Rows n0 .. n1 of w (n1 - n0 a multiple of R) against M rows of x (float32 [M, K]).
template <int M, int R>
void dot_rows(const float* x, int64_t K, const int8_t* w, const c10::BFloat16* s,
              c10::BFloat16* y, int64_t ldy, int64_t n0, int64_t n1) {
  const char* end = reinterpret_cast<const char*>(w + n1 * K);
  for (int64_t n = n0; n < n1; n += R) {
    const int8_t* wn = w + n * K;
    const char* ahead = reinterpret_cast<const char*>(wn + kPrefetchBlocks * kBlock * K);
    __m512 acc[M][R];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      // a block's 4 rows x 16 bytes consumed per step: one 64-byte line of the block 8 ahead
      if (ahead + kBlock * k < end) _mm_prefetch(ahead + kBlock * k, _MM_HINT_T0);
      __m512 wf[R];
      for (int r = 0; r < R; ++r)
        wf[r] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(wn + r * K + k))));
      for (int m = 0; m < M; ++m) {
        __m512 xv = _mm512_loadu_ps(x + m * K + k);
        for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wf[r], acc[m][r]);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r)
        y[m * ldy + n + r] =
            c10::BFloat16(_mm512_reduce_add_ps(acc[m][r]) * static_cast<float>(s[n + r]));
  }
}

template <int M>
void rows_of_x(const float* x, int64_t K, const int8_t* w, const c10::BFloat16* s,
               c10::BFloat16* y, int64_t ldy, int64_t n0, int64_t n1) {
  int64_t body = n0 + (n1 - n0) / kBlock * kBlock;
  dot_rows<M, kBlock>(x, K, w, s, y, ldy, n0, body);
  dot_rows<M, 1>(x, K, w, s, y, ldy, body, n1);
}

void to_float(const c10::BFloat16* src, float* dst, int64_t n) {  // n a multiple of 16
  for (int64_t i = 0; i < n; i += 16) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
}

#endif

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s) {
  TORCH_CHECK(MINISGL_LINEAR_FAST, "int8_linear needs AVX512");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && s.dim() == 1, "x [M, K], w [N, K], s [N]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && s.scalar_type() == at::kBFloat16 &&
                  w.scalar_type() == at::kChar, "x and s bf16, w int8");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && s.size(0) == N, "shapes: x [M, K], w [N, K], s [N]");
  TORCH_CHECK(K % 16 == 0, "K must be a multiple of 16");
  at::Tensor xc = x.contiguous(), wc = w.contiguous(), sc = s.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
#if MINISGL_LINEAR_FAST
  const c10::BFloat16* xp = xc.const_data_ptr<c10::BFloat16>();
  const int8_t* wp = wc.const_data_ptr<int8_t>();
  const c10::BFloat16* sp = sc.const_data_ptr<c10::BFloat16>();
  c10::BFloat16* yp = y.mutable_data_ptr<c10::BFloat16>();
  // work in blocks of output rows; grain 16 blocks keeps a 576-row weight on both threads
  at::parallel_for(0, (N + kBlock - 1) / kBlock, 16, [&](int64_t b0, int64_t b1) {
    int64_t n0 = b0 * kBlock, n1 = std::min(b1 * kBlock, N);
    thread_local std::vector<float> buffer;
    buffer.resize(kMaxRows * K);
    float* xf = buffer.data();
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      int64_t rows = std::min(kMaxRows, M - m0);
      to_float(xp + m0 * K, xf, rows * K);
      c10::BFloat16* ym = yp + m0 * N;
      switch (rows) {
        case 1: rows_of_x<1>(xf, K, wp, sp, ym, N, n0, n1); break;
        case 2: rows_of_x<2>(xf, K, wp, sp, ym, N, n0, n1); break;
        case 3: rows_of_x<3>(xf, K, wp, sp, ym, N, n0, n1); break;
        default: rows_of_x<4>(xf, K, wp, sp, ym, N, n0, n1); break;
      }
    }
  });
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minisgl_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor w, Tensor s) -> Tensor");
}

TORCH_LIBRARY_IMPL(minisgl_cpu, CPU, m) { m.impl("int8_linear", &int8_linear); }
