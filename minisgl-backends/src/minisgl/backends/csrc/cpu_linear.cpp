// Linear layers on CPUs with AVX512, built with cpu_attention.cpp into one library by
// minisgl/backends/cpu_kernels.py and registered with minisgl.core.layers.quant:
//
// * bf16_linear (AVX512-BF16): y = x @ w.T for any number of rows, w in this file's own blocked
//   layout (bf16_pack). Every bf16 linear layer on such a CPU uses it.
// * int8_linear (AVX512): weight-only int8 for up to a few rows (decode).
//
// --- bf16_linear ----------------------------------------------------------------------------
// bf16_pack turns w [N, K] (K even) into [ceil(N / 16), K / 2, 16, 2]: block b holds output
// features 16b .. 16b + 15 (zero rows past N), and for each pair of inputs p one 64-byte line with
// w[16b + j][2p], w[16b + j][2p + 1] for j = 0..15: exactly the operand of vdpbf16ps, which
// multiplies it with one pair of x broadcast to all lanes and adds 16 float32 dot products.
// So the kernel needs no horizontal sums and no reordering at run time; each block is one
// contiguous stream of K * 32 bytes.
//
// The microkernel computes MR rows of x against NR blocks (MR x NR float32 accumulators in
// registers, the whole K at once: K is at most a few thousand here). For up to 4 rows (decode)
// a GEMV streams each thread's share of the weight once from DRAM, block after block. For more
// rows a thread keeps a panel of NR blocks in L2 (NR * K * 32 bytes: 73 KB at K = 576) while
// all of x's rows pass over it, MR at a time (24 vdpbf16ps per 4 weight loads and 6
// broadcasts), and prefetches the next panel meanwhile. Measured against oneDNN on its prepacked weights
// (a decode step's 121 SmolLM2 weights in sequence, 2 threads, docs/benchmarks.md): 1 row
// 8.3-9.7 vs 13.2-14.6 ms (the weights at 93-98% of the machine's plain read speed, oneDNN at
// ~62%), 16 rows 13.8 vs 24.9, 32 rows 25.3 vs 30.8, 1024 rows 725 vs 732, 4096 rows 2,759 vs
// 2,848: as fast as oneDNN when compute-bound, faster when memory- or call-bound, and one
// layout for both (oneDNN's packed weights were 1.6-1.9x slower at 4-64 rows in the plain
// layout, so decode and prefill would have needed two copies).
//
// --- int8_linear ----------------------------------------------------------------------------
// y = x @ (w * s[:, None]).T with x [M, K] bf16, w [N, K] int8 (one row per output feature),
// s [N] bf16 (the row's scale);
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

#include <ATen/ops/zeros.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define MINISGL_LINEAR_FAST 1
#include <immintrin.h>
#else
#define MINISGL_LINEAR_FAST 0
#endif
#if MINISGL_LINEAR_FAST && defined(__AVX512BF16__)
#define MINISGL_BF16_FAST 1
#else
#define MINISGL_BF16_FAST 0
#endif

namespace {

// ---- bf16_linear ----

constexpr int kLanes = 16;            // output features per block (one float32 vector)
constexpr int kMR = 6;                // rows of x per microkernel call
constexpr int kNR = 4;                // blocks per microkernel call (a panel)
constexpr int kGemvRows = 4;          // up to this many rows: bf16_gemv (one stream per thread)

at::Tensor bf16_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "w must be [N, K] bf16");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(K % 2 == 0, "K must be even, got ", K);
  const int64_t NB = (N + kLanes - 1) / kLanes, K2 = K / 2;
  at::Tensor out = at::zeros({NB, K2, kLanes, 2}, w.options());
  at::Tensor src = w.contiguous();
  // as 32-bit pairs: block b, pair p, lane j <- row 16b + j, pair p
  const int32_t* s = reinterpret_cast<const int32_t*>(src.const_data_ptr<c10::BFloat16>());
  int32_t* d = reinterpret_cast<int32_t*>(out.mutable_data_ptr<c10::BFloat16>());
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t j = 0; j < kLanes && b * kLanes + j < N; ++j) {
        const int32_t* row = s + (b * kLanes + j) * K2;
        int32_t* dst = d + b * K2 * kLanes + j;
        for (int64_t p = 0; p < K2; ++p) dst[p * kLanes] = row[p];
      }
  });
  return out;
}

#if MINISGL_BF16_FAST

// y[0..MR) x [16 b0, 16 (b0 + NR)) = x[0..MR) @ blocks b0 .. b0 + NR; x rows are ldx apart.
// Also prefetches the pf_lines 64-byte lines at pf into L2, pf_per of them per pair of inputs.
template <int MR, int NR>
void bf16_micro(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w, int64_t K2,
                int64_t b0, c10::BFloat16* y, int64_t ldy, int64_t N, const char* pf,
                int64_t pf_lines, int64_t pf_per) {
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  const char* wb[NR];
  for (int r = 0; r < NR; ++r) wb[r] = reinterpret_cast<const char*>(w + (b0 + r) * K2 * 32);
  const int32_t* xp = reinterpret_cast<const int32_t*>(x);  // pairs of x
  const int64_t ldp = ldx / 2;
  for (int64_t p = 0; p < K2; ++p) {
    __m512bh wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(wb[r] + p * 64);
    for (int64_t i = p * pf_per; i < std::min(pf_lines, (p + 1) * pf_per); ++i)
      _mm_prefetch(pf + i * 64, _MM_HINT_T1);
    for (int m = 0; m < MR; ++m) {
      __m512bh xv = (__m512bh)_mm512_set1_epi32(xp[m * ldp + p]);
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) {
      const int64_t n = (b0 + r) * kLanes;
      __m256i h = (__m256i)_mm512_cvtneps_pbh(acc[m][r]);
      if (n + kLanes <= N)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ldy + n), h);
      else
        _mm256_mask_storeu_epi16(y + m * ldy + n, static_cast<__mmask16>((1u << (N - n)) - 1), h);
    }
}

// Few rows (M <= kGemvRows, decode): blocks b0 .. b1 one after the other, so that a thread reads
// its share of the weight as one sequential stream, each block's K in steps of 4 pairs with 4
// accumulators per row (the latency of vdpbf16ps), summed at the end. The panel order reads 4
// streams 18 KB apart (K = 576); measured, medians of 15 alternating passes over a decode
// step's 121 SmolLM2 weights (a plain read of as many bytes: 8.2 ms): 1 row 9.6 vs 12.1 ms,
// 2 rows 9.6 vs 11.7, 4 rows 10.2 vs 11.9, 6 rows 13.0 vs 12.4 (4 x 6 broadcasts per 4 weight
// lines: from there the panel order wins). Software prefetch made it slower.
template <int MR>
void bf16_gemv(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w, int64_t K2,
               int64_t b0, int64_t b1, c10::BFloat16* y, int64_t ldy, int64_t N) {
  constexpr int U = 4;
  const int32_t* xp = reinterpret_cast<const int32_t*>(x);
  const int64_t ldp = ldx / 2;
  for (int64_t b = b0; b < b1; ++b) {
    const char* wb = reinterpret_cast<const char*>(w + b * K2 * 32);
    __m512 acc[MR][U];
    for (int m = 0; m < MR; ++m)
      for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
    int64_t p = 0;
    for (; p + U <= K2; p += U) {
      __m512bh wv[U];
      for (int u = 0; u < U; ++u) wv[u] = (__m512bh)_mm512_loadu_si512(wb + (p + u) * 64);
      for (int m = 0; m < MR; ++m)
        for (int u = 0; u < U; ++u)
          acc[m][u] = _mm512_dpbf16_ps(acc[m][u], (__m512bh)_mm512_set1_epi32(xp[m * ldp + p + u]),
                                       wv[u]);
    }
    for (; p < K2; ++p) {
      __m512bh wv = (__m512bh)_mm512_loadu_si512(wb + p * 64);
      for (int m = 0; m < MR; ++m)
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], (__m512bh)_mm512_set1_epi32(xp[m * ldp + p]), wv);
    }
    const int64_t n = b * kLanes;
    for (int m = 0; m < MR; ++m) {
      __m512 s = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]),
                               _mm512_add_ps(acc[m][2], acc[m][3]));
      __m256i h = (__m256i)_mm512_cvtneps_pbh(s);
      if (n + kLanes <= N)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ldy + n), h);
      else
        _mm256_mask_storeu_epi16(y + m * ldy + n, static_cast<__mmask16>((1u << (N - n)) - 1), h);
    }
  }
}

using Bf16Gemv = void (*)(const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t, int64_t,
                          int64_t, c10::BFloat16*, int64_t, int64_t);

template <int... I>
constexpr std::array<Bf16Gemv, sizeof...(I)> gemv_table(std::integer_sequence<int, I...>) {
  return {&bf16_gemv<I + 1>...};
}

constexpr auto kGemv = gemv_table(std::make_integer_sequence<int, kGemvRows>{});

using Bf16Micro = void (*)(const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t, int64_t,
                           c10::BFloat16*, int64_t, int64_t, const char*, int64_t, int64_t);

// kMicro[(mr - 1) * kNR + nr - 1] = bf16_micro<mr, nr>: the tails of M and of a thread's blocks
template <int... I>
constexpr std::array<Bf16Micro, sizeof...(I)> micro_table(std::integer_sequence<int, I...>) {
  return {&bf16_micro<I / kNR + 1, I % kNR + 1>...};
}

constexpr auto kMicro = micro_table(std::make_integer_sequence<int, kMR * kNR>{});

// rows m0 .. m1 of x against blocks b0 .. b1: panels of kNR blocks outer (kept in L2), kMR rows
// of x inner. With several chunks of rows per panel, the chunks also prefetch the next panel
// (contiguous: blocks follow each other) into L2, a share each, so that its first chunk does not
// wait for DRAM: measured on a decode step's 121 SmolLM2 weights, 8 rows 14.6 -> 10.4 ms, 16 rows
// 19.3 -> 13.8, 32 rows 30.2 -> 25.3, 64 and 128 rows -7-8%.
void bf16_rows(const c10::BFloat16* x, int64_t K, const c10::BFloat16* w, c10::BFloat16* y,
               int64_t N, int64_t m0, int64_t m1, int64_t b0, int64_t b1) {
  const int64_t K2 = K / 2;
  const int64_t chunks = (m1 - m0 + kMR - 1) / kMR;
  if (m1 - m0 <= kGemvRows) {
    kGemv[m1 - m0 - 1](x + m0 * K, K, w, K2, b0, b1, y + m0 * N, N, N);
    return;
  }
  for (int64_t b = b0; b < b1; b += kNR) {
    const int64_t nr = std::min<int64_t>(kNR, b1 - b);
    const char* next = reinterpret_cast<const char*>(w + (b + nr) * K2 * 32);
    const int64_t lines = chunks > 1 ? std::min<int64_t>(kNR, b1 - b - nr) * K2 : 0;
    const int64_t share = (lines + chunks - 1) / chunks;  // lines per chunk
    const int64_t per = (share + K2 - 1) / K2;             // per pair of inputs
    for (int64_t m = m0, c = 0; m < m1; m += kMR, ++c) {
      const int64_t mr = std::min<int64_t>(kMR, m1 - m);
      const int64_t first = std::min(lines, c * share);
      kMicro[(mr - 1) * kNR + (nr - 1)](x + m * K, K, w, K2, b, y + m * N, N, N,
                                        next + first * 64, std::min(share, lines - first), per);
    }
  }
}

#endif

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& wp, int64_t N) {
  TORCH_CHECK(MINISGL_BF16_FAST, "bf16_linear needs AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && wp.dim() == 4 && wp.size(2) == kLanes && wp.size(3) == 2,
              "x [M, K], w packed by bf16_pack");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && wp.scalar_type() == at::kBFloat16,
              "x and w must be bf16");
  const int64_t M = x.size(0), K = x.size(1), NB = wp.size(0);
  TORCH_CHECK(wp.size(1) * 2 == K, "x has ", K, " columns, the packed weight ", wp.size(1) * 2);
  TORCH_CHECK(N > (NB - 1) * kLanes && N <= NB * kLanes, "N = ", N, " does not match the "
              "packed weight's ", NB, " blocks");
  at::Tensor y = at::empty({M, N}, x.options());
#if MINISGL_BF16_FAST
  if (M == 0) return y;
  at::Tensor xc = x.contiguous(), wc = wp.contiguous();
  const c10::BFloat16* xp = xc.const_data_ptr<c10::BFloat16>();
  const c10::BFloat16* w = wc.const_data_ptr<c10::BFloat16>();
  c10::BFloat16* yp = y.mutable_data_ptr<c10::BFloat16>();
  const int64_t threads = at::get_num_threads();
  if (NB >= 2 * threads || M <= kMR) {
    // each thread streams its own share of the weight once (whole blocks; x is shared)
    at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
      bf16_rows(xp, K, w, yp, N, 0, M, b0, b1);
    });
  } else {  // few output blocks, many rows: split the rows instead
    at::parallel_for(0, (M + kMR - 1) / kMR, 1, [&](int64_t c0, int64_t c1) {
      bf16_rows(xp, K, w, yp, N, c0 * kMR, std::min(c1 * kMR, M), 0, NB);
    });
  }
#endif
  return y;
}

// ---- int8_linear ----

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
  m.def("bf16_pack(Tensor w) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor w, int n) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor w, Tensor s) -> Tensor");
}

TORCH_LIBRARY_IMPL(minisgl_cpu, CPU, m) {
  m.impl("bf16_pack", &bf16_pack);
  m.impl("bf16_linear", &bf16_linear);
  m.impl("int8_linear", &int8_linear);
}
