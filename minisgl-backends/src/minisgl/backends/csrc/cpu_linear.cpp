// Linear layers on CPUs with AVX512-BF16 and AVX512-VNNI, or with AVX2 and FMA (two builds of the
// same kernels, below), built with cpu_attention.cpp into one library by
// minisgl/backends/cpu_kernels.py and registered with minisgl.core.layers.quant:
//
// * bf16_linear: y = x @ w.T for any number of rows, w bf16 in this file's blocked layout
//   (bf16_pack). Every bf16 linear layer on such a CPU uses it.
// * int8_linear: the same for weight-only int8 (--quantization int8): w int8 in the same blocked
//   layout (int8_pack) with a float32 scale per output feature.
// * bf16_linear_silu / int8_linear_silu: silu(x @ gate.T) * (x @ up.T) of a merged gate-up
//   weight [gate; up] packed as above, in one call (on AMX tiles, and in the AVX-512 build's
//   panels for more rows than the GEMV's, without the [M, 2I] linear output; see gated_into).
//
// --- the blocked layout ---------------------------------------------------------------------
// A pack turns w [N, K] (K even) into [ceil(N / 16), K / 2, 16, 2]: block b holds output
// features 16b .. 16b + 15 (zero rows past N), and for each pair of inputs p one line with
// w[16b + j][2p], w[16b + j][2p + 1] for j = 0..15 (64 bytes in bf16, 32 in int8): the operand
// of one instruction that multiplies it with a pair of x broadcast to all lanes and adds 16 dot
// products into 16 32-bit lanes (vdpbf16ps for bf16; vpdpwssd, int16 pairs, for int8 once the
// line is widened to int16 with vpmovsxbw). So the kernels need no horizontal sums and no
// reordering at run time; each block is one contiguous stream.
//
// int8 is weight-only in effect: each row of x is scaled to integers of at most qmax = 8191
// (13 bits + sign; fewer when K > 2,064, so that K products of 127 * qmax still fit an int32),
// which is finer than bf16's 8 significant bits wherever |x| is above 1/32 of the row's largest.
// Integer products are exact; y = (sum) * scale_x[m] * scale_w[n] in float32, rounded to bf16.
// Multiplying int8 weights directly (no conversion to float32, which cost 3 vector ops per 16
// weights in the previous int8 GEMV) streams a decode step's 121 SmolLM2 int8 weights in
// 5.9-6.9 ms against 8.6-10.6 on AMD Zen 4 (2 threads; bf16: 11.2-12.9), and lets one kernel
// serve prefill too: before, more than 32 rows dequantized every weight per call (1024-token
// int8 prefill 913-1,007 -> 1,138-1,161 tok/s).
//
// --- the kernels ----------------------------------------------------------------------------
// The microkernel computes MR rows of x against NR blocks (MR x NR 32-bit accumulators in
// registers, the whole K at once: K is at most a few thousand here). For up to 4 rows (decode)
// a GEMV streams each thread's share of the weight once from DRAM, block after block. For more
// rows a thread keeps a panel of NR blocks in L2 (NR * K * 32 bytes in bf16: 73 KB at K = 576)
// while all of x's rows pass over it, MR at a time (24 multiply-adds per 4 weight loads and 6
// broadcasts), and prefetches the next panel meanwhile. Measured for bf16 against oneDNN on its
// prepacked weights (a decode step's 121 SmolLM2 weights in sequence, 2 threads,
// docs/benchmarks.md): 1 row 8.3-9.7 vs 13.2-14.6 ms (the weights at 93-98% of the machine's
// plain read speed, oneDNN at ~62%), 16 rows 13.8 vs 24.9, 32 rows 25.3 vs 30.8, 1024 rows 725
// vs 732, 4096 rows 2,759 vs 2,848: as fast as oneDNN when compute-bound, faster when memory- or
// call-bound, and one layout for both (oneDNN's packed weights were 1.6-1.9x slower at 4-64 rows
// in the plain layout, so decode and prefill would have needed two copies). The AVX2 build
// converts x to float32 once per call from 3 rows on, and from 64 rows each block of w once
// per thread too (run_f32, below).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <sys/mman.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels.h"

// Two builds of the same kernels: AVX-512 (AVX512-BF16 and AVX512-VNNI: Intel since Cooper
// Lake, AMD since Zen 4) and AVX2 with FMA (x86-64-v3: Intel since Haswell, AMD since Zen; the
// build for every such CPU without AVX512-BF16, most laptops among them); -march=native picks.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && \
    defined(__AVX512VNNI__)
#define MINISGL_LINEAR_FAST 1
#define MINISGL_LINEAR_AVX2 0
#include <immintrin.h>

#include "vec.h"
#elif defined(__AVX2__) && defined(__FMA__)
#define MINISGL_LINEAR_FAST 0
#define MINISGL_LINEAR_AVX2 1
#include <immintrin.h>

#include "vec.h"
#else
#define MINISGL_LINEAR_FAST 0
#define MINISGL_LINEAR_AVX2 0
#endif
#define MINISGL_LINEAR_ANY (MINISGL_LINEAR_FAST || MINISGL_LINEAR_AVX2)
// AMX (Intel since Sapphire Rapids): tile multiplies for many rows, in the AVX-512 build
#if MINISGL_LINEAR_FAST && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define MINISGL_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#else
#define MINISGL_AMX 0
#endif

// --- where packed weights live --------------------------------------------------------------
// A decode step streams every weight once from DRAM. In 4 KiB pages that stream takes a TLB
// miss and a page walk every 4 KiB (a batch-1 SmolLM2 step: ~66,000 pages for 269 MB, against
// 2,048 entries in Zen 3's second-level TLB); in 2 MiB pages, 135. So the packs allocate from
// arenas that Linux backs with transparent huge pages (madvise(MADV_HUGEPAGE): the "madvise"
// THP mode, the usual default, grants them; with THP off they are plain pages, as before).
// An arena is a 64 MiB mapping (more for a larger weight) handed out front to back; it is
// unmapped when the last tensor in it is freed, or, the current one, reused from its start.
namespace minisgl {
namespace {

struct Arena {
  char* map = nullptr;   // what mmap returned (munmap's argument), `size` + 2 MiB long
  char* base = nullptr;  // its first 2 MiB boundary
  size_t size = 0, used = 0;
  int64_t live = 0;      // tensors in it not yet freed
};
constexpr size_t kHugePage = size_t(2) << 20, kArena = size_t(64) << 20;
Arena* arena = nullptr;  // the one new weights go to
std::mutex& arena_mutex() {  // never destroyed: weights may be freed after static destructors
  static auto* m = new std::mutex;
  return *m;
}

void unmap(Arena* a) {
  munmap(a->map, a->size + kHugePage);
  delete a;
}

void release(Arena* a) {
  std::lock_guard<std::mutex> lock(arena_mutex());
  if (--a->live > 0) return;
  if (a == arena)
    a->used = 0;  // empty again: the next weights start at its front
  else
    unmap(a);
}

}  // namespace

at::Tensor weight_zeros(at::IntArrayRef sizes, at::ScalarType dtype) {
  const auto options = at::TensorOptions().dtype(dtype);
  size_t bytes = at::elementSize(dtype);
  for (int64_t n : sizes) bytes *= static_cast<size_t>(n);
  bytes = (bytes + 63) / 64 * 64;
  std::lock_guard<std::mutex> lock(arena_mutex());
  if (arena == nullptr || arena->used + bytes > arena->size) {
    const size_t size = std::max(kArena, (bytes + kHugePage - 1) / kHugePage * kHugePage);
    void* map = mmap(nullptr, size + kHugePage, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) return at::zeros(sizes, options);
    if (arena != nullptr && arena->live == 0) unmap(arena);
    arena = new Arena;
    arena->map = static_cast<char*>(map);
    arena->base = arena->map + (-reinterpret_cast<uintptr_t>(map) & (kHugePage - 1));
    arena->size = size;
#ifdef MADV_HUGEPAGE
    madvise(arena->base, size, MADV_HUGEPAGE);
#endif
  }
  Arena* a = arena;
  char* p = a->base + a->used;
  a->used += bytes;
  ++a->live;
  std::memset(p, 0, bytes);  // also faults the pages in (a reused front holds old weights)
  return at::from_blob(p, sizes, [a](void*) { release(a); }, options);
}

// Linux lends AMX's tile registers to a process that asks once (arch_prctl
// ARCH_REQ_XCOMP_PERM, XTILEDATA); where it refuses, the build has no AMX, or MINISGL_AMX=off,
// false: the vector kernels run.
bool amx_usable() {
#if MINISGL_AMX
  static const bool ok = [] {
    const char* env = std::getenv("MINISGL_AMX");
    if (env != nullptr) {
      const std::string v(env);
      if (v == "0" || v == "off" || v == "false" || v == "no") return false;
    }
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;  // <asm/prctl.h>, the XSAVE feature
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

}  // namespace minisgl

namespace {

constexpr int kLanes = 16;            // output features per block (one vector of 32-bit lanes)
constexpr int kInt8MaxQ = 8191;       // |x| after int8_linear's row scaling (K <= 2,064)

// [N, K] (K even) -> [ceil(N / 16), K / 2, 16, 2]; P is a pair of elements (int32 for bf16,
// int16 for int8), so the reorder moves whole pairs.
template <typename P>
at::Tensor pack_pairs(const at::Tensor& w) {
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(K % 2 == 0, "K must be even, got ", K);
  const int64_t NB = (N + kLanes - 1) / kLanes, K2 = K / 2;
  at::Tensor out = minisgl::weight_zeros({NB, K2, kLanes, 2}, w.scalar_type());
  at::Tensor src = w.contiguous();
  const P* s = static_cast<const P*>(src.const_data_ptr());
  P* d = static_cast<P*>(out.mutable_data_ptr());
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t j = 0; j < kLanes && b * kLanes + j < N; ++j) {
        const P* row = s + (b * kLanes + j) * K2;
        P* dst = d + b * K2 * kLanes + j;
        for (int64_t p = 0; p < K2; ++p) dst[p * kLanes] = row[p];
      }
  });
  return out;
}

at::Tensor bf16_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "w must be [N, K] bf16");
  return pack_pairs<int32_t>(w);
}

at::Tensor int8_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar, "w must be [N, K] int8");
  return pack_pairs<int16_t>(w);
}

// Rows ids [T] of the weight w [N, K] that bf16_pack packed, as [T, K] (row n: block n / 16,
// lane n % 16, its K / 2 pairs 16 pairs apart): a tied embedding reads its rows here instead of
// keeping its own copy of the LM head's weight. In torch ops (advanced indexing of the packed
// view) the same gather took 10-25x F.embedding's time, eager or compiled (4,096 rows of
// SmolLM2's: 3.2-7.4 ms against 0.28).
at::Tensor bf16_rows(const at::Tensor& packed, const at::Tensor& ids) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kLanes && packed.size(3) == 2 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "packed must be a weight packed by bf16_pack");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids must be 1-D int64");
  const int64_t K2 = packed.size(1), T = ids.size(0), rows = packed.size(0) * kLanes;
  const at::Tensor idc = ids.contiguous();
  const int64_t* id = idc.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < rows, "row ", id[t], " is outside [0, ", rows, ")");
  at::Tensor out = at::empty({T, 2 * K2}, packed.options());
  const int32_t* src = static_cast<const int32_t*>(packed.const_data_ptr());
  int32_t* dst = static_cast<int32_t*>(out.mutable_data_ptr());
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int32_t* s = src + (id[t] / kLanes) * K2 * kLanes + id[t] % kLanes;
      int32_t* d = dst + t * K2;
      for (int64_t p = 0; p < K2; ++p) d[p] = s[p * kLanes];
    }
  });
  return out;
}

#if MINISGL_LINEAR_FAST

// The lanes of elements n .. n + 15 that lie below N.
inline __mmask16 lanes16(int64_t n, int64_t N) {
  return n + kLanes <= N ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (N - n)) - 1);
}

// Row m's outputs n .. n + 15 (fewer at the end of N) from an accumulator. sx/sw: int8's scales
// (unused by bf16).
template <class F>
inline void store512(typename F::Acc acc, const float* sx, const float* sw, int64_t n,
                     int64_t N, c10::BFloat16* y) {
  const __mmask16 mask = lanes16(n, N);
  __m256i h = (__m256i)_mm512_cvtneps_pbh(F::finish(acc, sx, sw == nullptr ? nullptr : sw + n, mask));
  if (mask == 0xFFFF)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + n), h);
  else
    _mm256_mask_storeu_epi16(y + n, mask, h);
}

// The gated form's 16 outputs at y: silu(g) * u from the gate's and the up half's float32
// results, each rounded to bf16 first as the linear's output would be.
inline void store_gated(__m512 g, __m512 u, c10::BFloat16* y) {
  auto rounded = [](__m512 v) { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(v)); };
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y),
                      (__m256i)_mm512_cvtneps_pbh(minisgl_vec::silu_mul16(rounded(g), rounded(u))));
}

// The two weight formats: how a line of the packed weight is loaded and multiplied with a
// broadcast pair of x, and how an accumulator becomes float32 outputs.
// Each format also says how the kernels tile (registers): kMR rows of x per microkernel call,
// kNR blocks per call (a panel), kU accumulator chains per row in the GEMV, which serves up to
// kGemvRows rows (one stream per thread).
struct Bf16Format {
  static constexpr int kLineBytes = 64, kMR = 6, kNR = 4, kU = 4, kGemvRows = 4, kAhead = 0;
  static constexpr _mm_hint kAheadHint = _MM_HINT_NTA;
  static constexpr bool kEvenPrefetch = true;  // (micro)
  using Acc = __m512;
  using Line = __m512i;
  using X = __m512i;  // a pair of x broadcast to all lanes
  static X bcast(int32_t pair) { return _mm512_set1_epi32(pair); }
  static Acc zero() { return _mm512_setzero_ps(); }
  static __m512i load(const char* p) { return _mm512_loadu_si512(p); }
  // two lines from p (64-byte aligned) by non-temporal loads (the GEMV's stream, see gemv)
  static void load2_nt(const char* p, __m512i& a, __m512i& b) {
    a = _mm512_stream_load_si512(const_cast<char*>(p));
    b = _mm512_stream_load_si512(const_cast<char*>(p + 64));
  }
  static Acc dot(Acc acc, __m512i x2, __m512i w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)x2, (__m512bh)w);
  }
  static Acc add(Acc a, Acc b) { return _mm512_add_ps(a, b); }
  static __m512 finish(Acc acc, const float*, const float*, __mmask16) { return acc; }
  static void store(Acc acc, const float* sx, const float* sw, int64_t n, int64_t N,
                    c10::BFloat16* y) {
    store512<Bf16Format>(acc, sx, sw, n, N, y);
  }
};

struct Int8Format {
  static constexpr int kLineBytes = 32, kMR = 6, kNR = 4, kU = 4, kGemvRows = 4, kAhead = 4096;
  static constexpr _mm_hint kAheadHint = _MM_HINT_NTA;
  static constexpr bool kEvenPrefetch = false;  // (micro)
  // int32 lanes, held as __m512: with __m512i accumulators GCC 12 spilled most of the
  // microkernel's 24 to the stack on every step (the casts cost no instruction)
  using Acc = __m512;
  using Line = __m512i;
  using X = __m512i;
  static X bcast(int32_t pair) { return _mm512_set1_epi32(pair); }
  static Acc zero() { return _mm512_setzero_ps(); }
  static __m512i load(const char* p) {  // 32 int8 -> 32 int16: 16 lanes of (w[j][2p], w[j][2p+1])
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void load2_nt(const char* p, __m512i& a, __m512i& b) {  // one 64-byte load
    __m512i v = _mm512_stream_load_si512(const_cast<char*>(p));
    a = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(v));
    b = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(v, 1));
  }
  static Acc dot(Acc acc, __m512i x2, __m512i w) {
    return _mm512_castsi512_ps(_mm512_dpwssd_epi32(_mm512_castps_si512(acc), x2, w));
  }
  static Acc add(Acc a, Acc b) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  }
  // sx: this row's scale; sw: the block's 16 output scales
  static __m512 finish(Acc acc, const float* sx, const float* sw, __mmask16 mask) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_castps_si512(acc)),
                         _mm512_mul_ps(_mm512_set1_ps(*sx), _mm512_maskz_loadu_ps(mask, sw)));
  }
  static void store(Acc acc, const float* sx, const float* sw, int64_t n, int64_t N,
                    c10::BFloat16* y) {
    store512<Int8Format>(acc, sx, sw, n, N, y);
  }
};

#elif MINISGL_LINEAR_AVX2

// The same formats with 256-bit vectors: a block's 16 lanes are two halves (lanes 0-7, 8-15).
// bf16: AVX2 has no bf16 dot product, so a line's 16 pairs become float32 (a bf16 is the top
// half of a float32: the even element of a pair shifted up, the odd one masked) and two FMAs
// per half add the odd, then the even product, in vdpbf16ps's order (bf16 products are exact
// in float32, so each FMA rounds once, as vdpbf16ps does: the sums of the AVX-512 build but
// for its flushing of subnormals). int8: pairs widened to int16 and vpmaddwd, exact integer
// sums as vpdpwssd's. Fewer registers (16) than AVX-512 (32): smaller tiles.
using Half = __m256;

// Row m's outputs n .. n + 15 (fewer at the end of N) from two float32 halves, rounded to bf16
// (nearest even, as c10 rounds; NaN stays NaN).
inline void store_halves(__m256 lo, __m256 hi, int64_t n, int64_t N, c10::BFloat16* y) {
  minisgl_vec::store_bf16(y + n, lo, N - n);
  if (N - n > 8) minisgl_vec::store_bf16(y + n + 8, hi, N - n - 8);
}

// kMR, kNR: micro<>'s tile, which this build's bf16 no longer runs (beyond the GEMV's 2 rows
// run_f32, below, takes over); the comparisons there are against it.
struct Bf16Format {
  static constexpr int kLineBytes = 64, kMR = 4, kNR = 1, kU = 2, kGemvRows = 2, kAhead = 1024;
  static constexpr _mm_hint kAheadHint = _MM_HINT_T0;
  static constexpr bool kEvenPrefetch = false;  // (micro)
  struct Acc { Half lo, hi; };
  struct Line { Half elo, olo, ehi, ohi; };  // even and odd elements of lanes 0-7, 8-15
  struct X { Half e, o; };
  static Half even(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
  static Half odd(__m256i v) {
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    return _mm256_castsi256_ps(_mm256_and_si256(v, high));
  }
  static X bcast(int32_t pair) {
    const __m256i b = _mm256_set1_epi32(pair);
    return {even(b), odd(b)};
  }
  static Acc zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Line line(__m256i lo, __m256i hi) { return {even(lo), odd(lo), even(hi), odd(hi)}; }
  static Line load(const char* p) {
    return line(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
  }
  static void load2_nt(const char* p, Line& a, Line& b) {
    auto nt = [&](int off) {
      return _mm256_stream_load_si256(reinterpret_cast<const __m256i*>(p + off));
    };
    a = line(nt(0), nt(32));
    b = line(nt(64), nt(96));
  }
  static Acc dot(Acc acc, const X& x, const Line& w) {
    acc.lo = _mm256_fmadd_ps(w.elo, x.e, _mm256_fmadd_ps(w.olo, x.o, acc.lo));
    acc.hi = _mm256_fmadd_ps(w.ehi, x.e, _mm256_fmadd_ps(w.ohi, x.o, acc.hi));
    return acc;
  }
  static Acc add(Acc a, Acc b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
  static void store(Acc acc, const float*, const float*, int64_t n, int64_t N, c10::BFloat16* y) {
    store_halves(acc.lo, acc.hi, n, N, y);
  }
};

struct Int8Format {
  static constexpr int kLineBytes = 32, kMR = 6, kNR = 1, kU = 2, kGemvRows = 2, kAhead = 1024;
  static constexpr _mm_hint kAheadHint = _MM_HINT_T0;
  static constexpr bool kEvenPrefetch = false;  // (micro; true: 4-32 rows 1.3-1.8x the time)
  struct Acc { __m256i lo, hi; };  // int32 sums
  struct Line { __m256i lo, hi; };  // int16 pairs of lanes 0-7, 8-15
  using X = __m256i;
  static X bcast(int32_t pair) { return _mm256_set1_epi32(pair); }
  static Acc zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
  static Line line(__m128i lo, __m128i hi) {
    return {_mm256_cvtepi8_epi16(lo), _mm256_cvtepi8_epi16(hi)};
  }
  static Line load(const char* p) {
    return line(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)),
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  }
  static void load2_nt(const char* p, Line& a, Line& b) {
    const __m256i u = _mm256_stream_load_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i v = _mm256_stream_load_si256(reinterpret_cast<const __m256i*>(p + 32));
    a = line(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
    b = line(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  }
  static Acc dot(Acc acc, X x, const Line& w) {
    return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(w.lo, x)),
            _mm256_add_epi32(acc.hi, _mm256_madd_epi16(w.hi, x))};
  }
  static Acc add(Acc a, Acc b) {
    return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)};
  }
  static void store(Acc acc, const float* sx, const float* sw, int64_t n, int64_t N,
                    c10::BFloat16* y) {
    alignas(32) float s[kLanes] = {};
    std::memcpy(s, sw + n, std::min<int64_t>(kLanes, N - n) * sizeof(float));
    const __m256 x = _mm256_set1_ps(*sx);
    store_halves(_mm256_mul_ps(_mm256_cvtepi32_ps(acc.lo), _mm256_mul_ps(x, _mm256_load_ps(s))),
                 _mm256_mul_ps(_mm256_cvtepi32_ps(acc.hi), _mm256_mul_ps(x, _mm256_load_ps(s + 8))),
                 n, N, y);
  }
};

#endif  // the formats

#if MINISGL_LINEAR_ANY

// What one call computes: x as pairs (bf16 pairs, or int16 pairs for int8) [M, K2], the packed
// weight, y [M, N] bf16, and int8's scales (sx [M], sw [N]; null for bf16). `up` > 0 (the AMX
// kernel, and the AVX-512 panels' gated form): the weight is [gate; up] with up's first block at
// block `up`, and y [M, N] is silu(x @ gate.T) * (x @ up.T) (N = 16 up).
struct Args {
  const int32_t* x;
  int64_t K2;
  const char* w;
  c10::BFloat16* y;
  int64_t N;
  const float* sx;
  const float* sw;
  int64_t up = 0;
  const int32_t* row_x(int64_t m) const { return x + m * K2; }
  const float* row_sx(int64_t m) const { return sx == nullptr ? nullptr : sx + m; }
};

// y[0..MR) x [16 b0, 16 (b0 + NR)) for rows m .. m + MR. Also prefetches the pf_lines 64-byte lines
// at pf: where F::kEvenPrefetch, spread evenly over the K2 pairs of inputs (each pair asks for the
// lines below an address that moves 64 pf_lines / K2 bytes per pair), else pf_per (rounded up) per
// pair from the first. Why evenly: a prefetch waits for a free miss buffer, so lines asked for
// faster than memory delivers them hold up the multiply-adds behind them, and pairs that ask for
// none leave the bus idle; rounded up, a chunk's share went out in the first 2/3 of its pairs
// wherever K2 did not divide it (a panel's 4 blocks in 3 chunks, 13-18 rows; the gated form's 2 + 2
// in 3 or more). Measured on AMD Zen 5 (2 threads, SmolLM2, the two alternating in one process): a
// decode step's 121 bf16 weights from DRAM, 14 rows 0.88x the time, 16 rows 0.87x; bf16 decode
// steps of 6 requests 0.99x, 8 0.98x, 14 0.93x, 16 0.89x, 20 0.93x, 32 0.95x, 64 0.98x (on AMD
// Zen 4, where 16-32 rows are bound by the multiply-adds, 8 0.99x, 16 1.01x, 32 1.00x). The int8
// kernel keeps the count per pair: with the address's two registers in its loop, GCC 12 moved
// accumulators to the stack and back on every pair (its panels 1.5x the time), and its panels,
// bound by widening the values, gained nothing from the even schedule (0.99-1.01x).
// With prefetcht2 (into L2). A prefetcht0 (into L1) holds one of the L1's few miss buffers
// until its line comes from DRAM, so few rows, whose panel is short work, waited on the stream:
// the two builds alternating in one process (AMD Zen 4, a decode step's 121 SmolLM2 weights, 11
// pairs) t2 against t0: 5 rows 1.25x, 6 1.35x, 8 1.49x, 12 1.28x, 16 1.18x, 20 1.03x, 24 to 128
// rows 1.0x. (An earlier host state had t0 4-12% ahead of prefetcht1 from 16 to 1,024 rows; on
// AMD Zen 5, t0 0.98-0.99x of t2's decode steps at 6-16 requests: not worth Zen 4's loss.)
// Gated (a.up > 0, AVX-512 only): NR / 2 output blocks from b0, each from the gate's block and
// the up half's (a.up blocks on, where pf's lines are prefetched too), y = silu(g) * u with g
// and u rounded to bf16 first, as the linear's output would be (gated_into's two passes, fused).
template <class F, int MR, int NR, bool Gated = false>
void micro(const Args& a, int64_t m, int64_t b0, const char* pf, int64_t pf_lines,
           int64_t pf_per) {
  typename F::Acc acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = F::zero();
  const int64_t K2 = a.K2, bb = K2 * F::kLineBytes;
  constexpr int H = Gated ? NR / 2 : NR;  // blocks before the up half's
  const int64_t up = Gated ? (a.up - H) * bb : 0;  // from block H on: the up half's
  const char* wp = a.w + b0 * bb;  // one pointer (an array of NR spilled in int8, GCC 12)
  const int32_t* x = a.row_x(m);
  // (F::kEvenPrefetch) the lines asked for so far end at due >> 16, an address with 16 bits of
  // fraction, which moves 64 pf_lines / K2 bytes per pair (user-space addresses lie below 2^48;
  // above, due would wrap and stay below pf: no prefetches, never a runaway loop); else pf_per
  // lines per pair up to pf_end
  uint64_t due = reinterpret_cast<uintptr_t>(pf) << 16;
  const uint64_t rate = F::kEvenPrefetch ? (static_cast<uint64_t>(pf_lines) << 22) / K2 : 0;
  const char* pf_end = pf + pf_lines * 64;
  auto ask = [&](const char* line) {
    _mm_prefetch(line, _MM_HINT_T2);
    if constexpr (Gated) _mm_prefetch(line + a.up * bb, _MM_HINT_T2);
  };
  for (int64_t p = 0; p < K2; ++p, wp += F::kLineBytes) {
    typename F::Line wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = F::load(wp + r * bb + (r < H ? 0 : up));
    if constexpr (F::kEvenPrefetch) {
      due += rate;
      for (; reinterpret_cast<uintptr_t>(pf) < (due >> 16); pf += 64) ask(pf);
    } else {
      for (int64_t i = 0; i < pf_per && pf < pf_end; ++i, pf += 64) ask(pf);
    }
    for (int i = 0; i < MR; ++i) {
      const typename F::X xv = F::bcast(x[i * K2 + p]);
      for (int r = 0; r < NR; ++r) acc[i][r] = F::dot(acc[i][r], xv, wv[r]);
    }
  }
#if MINISGL_LINEAR_FAST
  if constexpr (Gated) {
    for (int i = 0; i < MR; ++i)
      for (int r = 0; r < H; ++r) {
        const int64_t n = (b0 + r) * kLanes;
        const float* sw = a.sw == nullptr ? nullptr : a.sw + n;
        store_gated(F::finish(acc[i][r], a.row_sx(m + i), sw, 0xFFFF),
                    F::finish(acc[i][H + r], a.row_sx(m + i),
                              sw == nullptr ? nullptr : sw + a.up * kLanes, 0xFFFF),
                    a.y + (m + i) * a.N + n);
      }
    return;
  }
#endif
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r)
      F::store(acc[i][r], a.row_sx(m + i), a.sw, (b0 + r) * kLanes, a.N, a.y + (m + i) * a.N);
}

// The sum of U accumulator chains, in pairs ((a0 + a1) + (a2 + a3) for 4).
template <class F, int U>
typename F::Acc sum_chains(const typename F::Acc* acc) {
  if constexpr (U == 1)
    return acc[0];
  else
    return F::add(sum_chains<F, U / 2>(acc), sum_chains<F, U / 2>(acc + U / 2));
}

// Few rows (M <= F::kGemvRows, decode): blocks b0 .. b1 one after the other, so that a thread reads
// its share of the weight as one sequential stream, each block's K in steps of 4 pairs with 4
// accumulators per row (the latency of the multiply-add), summed at the end. The panel order
// reads 4 streams 18 KB apart (K = 576); measured in bf16, medians of 15 alternating passes over
// a decode step's 121 SmolLM2 weights (a plain read of as many bytes: 8.2 ms): 1 row 9.6 vs
// 12.1 ms, 2 rows 9.6 vs 11.7, 4 rows 10.2 vs 11.9, 6 rows 13.0 vs 12.4 (4 x 6 broadcasts per 4
// weight lines: from there the panel order wins). Software prefetch made bf16 slower there (on
// AMD Zen 5 too: 4 KB ahead 1.014x the step's time with prefetcht0, 0.998x with prefetchnta).
// The AVX-512 int8 stream, half the bytes per product, prefetches each line 4 KB ahead
// (prefetchnta): AMD Zen 5, SmolLM2 int8 decode steps, with and without alternating step by step
// in one process (8 rounds each): 1 row 0.955-0.965x the time, 2 rows 0.94x, 4 rows 0.87-0.90x
// (2 KB ahead 0.986x, 8 KB 0.971x at 1 row; prefetcht0 as good as prefetchnta). On AMD Zen 4
// (reads ~35 GB/s, where the hardware's prefetch alone keeps one row's stream at the bus) the
// same A/B gave 1 row 1.03-1.06x the time, 2 rows 0.99x, 3 rows 0.95x, 4 rows 0.92x (8 KB ahead
// 1.01x at 1 row, prefetcht1 1.06-1.07x at 1 and 4 rows): kept, a CPU's gain at 1 row being the
// other's loss. The AVX2 build prefetches each line F::kAhead = 1 KB ahead (prefetcht0): on AMD
// Zen 3 (2 threads, the same 121 weights, the two builds alternating in one process, 15 pairs)
// bf16 0.92x and int8 0.90x the time (11.05 -> 10.54 ms, 6.64 -> 5.94); 2 KB ahead was no
// better, and 4 accumulator chains per row instead of 2 no faster in int8.
// The stream is read with non-temporal loads (vmovntdqa) where they are aligned. A plain read of
// a decode step's 270 MB evicts the whole L3 (32 MB on the host measured), so the code and data
// of every small op between two GEMVs came back cold from DRAM: a [1, 49152] argmax took 22 us
// warm, 240-270 us right after a 256 MB read. Measured on AMD Zen 4 (a shared VM), SmolLM2
// batch-1 decode, the two loads alternating in one process: in one hour bf16 0.94x time per
// token (twice, 10 pairs each: 13.24 -> 12.64 ms) and int8 0.94x (8.19 -> 7.78), the sampler's
// argmax after the LM head ~190 -> ~140 us; an hour later, the host's memory behaving otherwise
// (its plain-read ceiling 52-56 instead of 32-34 GB/s, a C++ stream no longer keeping the L3
// with either load), bf16 0.98x and int8 1.03x (8 pairs): a gain or a wash, never a clear loss.
// (prefetchnta ahead of plain loads kept the L3 too, without the speed-up.)
template <class F, int MR, bool NT>
void gemv_stream(const Args& a, int64_t m, int64_t b0, int64_t b1) {
  constexpr int U = F::kU;
  const int32_t* x = a.row_x(m);
  const int64_t K2 = a.K2;
  for (int64_t b = b0; b < b1; ++b) {
    const char* wb = a.w + b * K2 * F::kLineBytes;
    typename F::Acc acc[MR][U];
    for (int i = 0; i < MR; ++i)
      for (int u = 0; u < U; ++u) acc[i][u] = F::zero();
    int64_t p = 0;
    for (; p + U <= K2; p += U) {
      if constexpr (F::kAhead > 0)  // every 64-byte line of this step, kAhead bytes ahead
        for (int j = 0; j < U * F::kLineBytes; j += 64)
          _mm_prefetch(wb + p * F::kLineBytes + j + F::kAhead, F::kAheadHint);
      typename F::Line wv[U];
      if (NT) {
        for (int u = 0; u < U; u += 2) F::load2_nt(wb + (p + u) * F::kLineBytes, wv[u], wv[u + 1]);
      } else {
        for (int u = 0; u < U; ++u) wv[u] = F::load(wb + (p + u) * F::kLineBytes);
      }
      for (int i = 0; i < MR; ++i)
        for (int u = 0; u < U; ++u)
          acc[i][u] = F::dot(acc[i][u], F::bcast(x[i * K2 + p + u]), wv[u]);
    }
    for (; p < K2; ++p) {
      const typename F::Line wv = F::load(wb + p * F::kLineBytes);
      for (int i = 0; i < MR; ++i)
        acc[i][0] = F::dot(acc[i][0], F::bcast(x[i * K2 + p]), wv);
    }
    for (int i = 0; i < MR; ++i)
      F::store(sum_chains<F, U>(acc[i]), a.row_sx(m + i), a.sw, b * kLanes, a.N,
               a.y + (m + i) * a.N);
  }
}

template <class F, int MR>
void gemv(const Args& a, int64_t m, int64_t b0, int64_t b1) {
  // every load of the stream 64-byte aligned (torch allocates at 64 bytes; int8 also needs an
  // even K2): else plain loads
  if (reinterpret_cast<uintptr_t>(a.w) % 64 == 0 && a.K2 * F::kLineBytes % 64 == 0)
    gemv_stream<F, MR, true>(a, m, b0, b1);
  else
    gemv_stream<F, MR, false>(a, m, b0, b1);
}

template <class F>
using GemvFn = void (*)(const Args&, int64_t, int64_t, int64_t);
template <class F>
using MicroFn = void (*)(const Args&, int64_t, int64_t, const char*, int64_t, int64_t);

template <class F, int... I>
constexpr std::array<GemvFn<F>, sizeof...(I)> gemv_table(std::integer_sequence<int, I...>) {
  return {&gemv<F, I + 1>...};
}

// micro_table<F>()[(mr - 1) * F::kNR + nr - 1] = micro<F, mr, nr>: the tails of M and of a thread's
// blocks
template <class F, int... I>
constexpr std::array<MicroFn<F>, sizeof...(I)> micro_table(std::integer_sequence<int, I...>) {
  return {&micro<F, I / F::kNR + 1, I % F::kNR + 1>...};
}

// gated_table<F>()[(mr - 1) * 2 + no - 1] = micro<F, mr, 2 no, true>: no = 1, 2 output blocks
// (kNR = 4 weight blocks at most, half of them the up half's)
template <class F, int... I>
constexpr std::array<MicroFn<F>, sizeof...(I)> gated_table(std::integer_sequence<int, I...>) {
  static_assert(F::kNR == 4);
  return {&micro<F, I / 2 + 1, 2 * (I % 2 + 1), true>...};
}

// The chunks of rows m0 .. m1 for one panel: at most MR rows each, split evenly (21 = 6 + 5 + 5
// + 5, not 6 + 6 + 6 + 3: a short last chunk does few multiply-adds per weight load; measured in
// bf16 on a decode step's 121 SmolLM2 weights, 9 alternating passes: 8 rows 8.29 -> 7.81 ms, 21
// rows 9.03 -> 8.49, 32 rows 12.49 -> 11.85, 64 rows 21.94 -> 21.91), each with its share of
// the `lines` 64-byte lines at `next` to prefetch, pf_per of them per pair of inputs (rounded up;
// the kernels with F::kEvenPrefetch spread them instead): fn(m, mr, pf, pf_lines, pf_per).
template <class Fn>
void chunks(const Args& a, int64_t m0, int64_t m1, int64_t MR, const char* next, int64_t lines,
            const Fn& fn) {
  const int64_t n = (m1 - m0 + MR - 1) / MR, base = (m1 - m0) / n, extra = (m1 - m0) % n;
  const int64_t share = (lines + n - 1) / n;         // lines per chunk
  const int64_t per = (share + a.K2 - 1) / a.K2;     // per pair of inputs
  for (int64_t m = m0, c = 0; c < n; m += base + (c < extra), ++c) {
    const int64_t first = std::min(lines, c * share);
    fn(m, base + (c < extra), next + first * 64, std::min(share, lines - first), per);
  }
}

// Where this thread's blocks go on after the b1 of its rows<> or rows_f32 call (0: b1 is the
// end): in a team, a share's grains run one after the other (cpu_layer.cpp), so the next panel
// to prefetch at a grain's end is the next grain's first. Without it, 8-row steps ran ~5% slower;
// outside a team (one chunk per thread) a prefetch past b1 made 8-32 rows 2-6% slower.
thread_local int64_t t_pf_to = 0;

// rows m0 .. m1 of x against blocks b0 .. b1: panels of F::kNR blocks outer (kept in L2),
// F::kMR rows of x inner. The chunks also prefetch the next panel (contiguous: blocks follow
// each other), a share each, so that its first chunk does not wait for DRAM: measured in bf16
// (AVX-512) on a decode step's 121 SmolLM2 weights, 8 rows 14.6 -> 10.4 ms, 16 rows 19.3 ->
// 13.8, 32 rows 30.2 -> 25.3, 64 and 128 rows -7-8%; and for a single chunk (5 or 6 rows),
// which did not prefetch until 2026-12-02: 5 rows 8.47 -> 7.94 ms, 6 rows 8.56 -> 7.66 (9
// alternating passes). Prefetching 2 or 3 panels ahead instead: 3-10% slower from 8 to 32 rows.
template <class F>
void rows(const Args& a, int64_t m0, int64_t m1, int64_t b0, int64_t b1) {
  constexpr int kMR = F::kMR, kNR = F::kNR;
  static constexpr auto kGemv = gemv_table<F>(std::make_integer_sequence<int, F::kGemvRows>{});
  static constexpr auto kMicro = micro_table<F>(std::make_integer_sequence<int, kMR * kNR>{});
  if (m1 - m0 <= F::kGemvRows && a.up == 0) {
    kGemv[m1 - m0 - 1](a, m0, b0, b1);
    return;
  }
  // gated (a.up > 0): blocks b0 .. b1 of y, panels of kNR / 2 of them and as many of the up half
  const int64_t step = a.up > 0 ? kNR / 2 : kNR;
  const int64_t nb = std::max(b1, t_pf_to);  // the next panel's prefetch goes past b1 to there
  const int64_t block_lines = (a.K2 * F::kLineBytes + 63) / 64;
  for (int64_t b = b0; b < b1; b += step) {
    const int64_t nr = std::min<int64_t>(step, b1 - b);
    const char* next = a.w + (b + nr) * a.K2 * F::kLineBytes;
    const int64_t lines = std::min<int64_t>(step, nb - b - nr) * block_lines;
    chunks(a, m0, m1, kMR, next, lines,
           [&](int64_t m, int64_t mr, const char* pf, int64_t pf_lines, int64_t pf_per) {
#if MINISGL_LINEAR_FAST
             static constexpr auto kGated =
                 gated_table<F>(std::make_integer_sequence<int, kMR * 2>{});
             if (a.up > 0) return kGated[(mr - 1) * 2 + (nr - 1)](a, m, b, pf, pf_lines, pf_per);
#endif
             kMicro[(mr - 1) * kNR + (nr - 1)](a, m, b, pf, pf_lines, pf_per);
           });
  }
}

// The threads' shares of M rows x NB blocks: fn(m0, m1, b0, b1) on each thread. From
// rows_each rows per thread on (0: never) the rows are split whatever NB (see run_amx). Shares
// of blocks are cut at multiples of `align` blocks (the caller's panel width).
template <class Fn>
void split(int64_t M, int64_t NB, int64_t MR, const Fn& fn, int64_t rows_each = 0,
           int64_t align = 1) {
  const int64_t threads = at::get_num_threads();
  const bool many_rows = rows_each > 0 && M >= rows_each * threads;
  if ((NB >= 2 * threads || M <= MR) && !many_rows) {
    // each thread streams its own share of the weight once (whole blocks; x is shared)
    minisgl::parallel_chunks(NB, [&](int64_t b0, int64_t b1) {
      t_pf_to = minisgl::run_end(b1);
      fn(0, M, b0, b1);
      t_pf_to = 0;
    }, align);
  } else {  // few output blocks, many rows: split the rows instead
    minisgl::parallel_chunks((M + MR - 1) / MR, [&](int64_t c0, int64_t c1) {
      fn(c0 * MR, std::min(c1 * MR, M), 0, NB);
    });
  }
}

#if MINISGL_LINEAR_AVX2

// bf16 with more rows than the GEMV's on AVX2. The microkernel above converts every line it
// loads (4 ops) and every pair of x it broadcasts (2 ops per row) to float32 next to its 16 FMAs
// per pair of 4 rows. Here x is converted to float32 once per call, so that the microkernel
// (micro_f32) is broadcasts from memory and 24 FMAs per pair of 6 rows, in the same order per
// accumulator (odd, then even product): the same sums as the microkernel above. Its weights:
// - up to 63 rows, each line of the bf16 block converted as it is loaded (4 ops per pair for
//   all the chunk's rows). Measured on AMD Zen 3 (2 threads; the 121 decode weights, the two
//   kernels alternating in one process, 6-20 pairs, medians and best passes): 3 rows 0.94-0.97x
//   the time of the microkernel above, 4 rows 0.90-0.96x, 5 rows 0.69-0.72x, 6 rows 0.77-0.80x,
//   16 rows 0.90-0.96x, 32 rows 0.82-0.96x, 48 rows 0.84-0.98x; against the widened panel below
//   0.92-1.04x from 48 to 256 rows, 1.0-1.1x at 512 and 1,024;
// - from kWideRows on, each block widened once per thread into a float32 panel (per pair of
//   inputs: odd lanes 0-7, 8-15, even lanes 0-7, 8-15, 128 bytes): no conversion in the
//   microkernel at all. Against the microkernel above: 64 rows 0.85-0.92x the time, 128 rows
//   0.90x, 512 rows 0.98x, 1024 rows 0.89x. From 48 rows on it ran at 125-170 GFLOP/s, as fast
//   as a register-only FMA loop beside it (138-194 GFLOP/s on the host's 2 threads within the
//   hour: its neighbours' load).
constexpr int kF32MR = 6;
constexpr int64_t kWideRows = 64;  // from this many rows on

// the K2 lines of a bf16 block (64-byte lines) as float32 (128 bytes per line)
void widen_block(const char* w, int64_t K2, float* out) {
  for (int64_t p = 0; p < K2; ++p, w += 64, out += 32) {
    const Bf16Format::Line l = Bf16Format::load(w);
    _mm256_storeu_ps(out, l.olo);
    _mm256_storeu_ps(out + 8, l.ohi);
    _mm256_storeu_ps(out + 16, l.elo);
    _mm256_storeu_ps(out + 24, l.ehi);
  }
}

// y[m .. m + MR) x one block (16 outputs from n); x as float32 [M, K]. The block is either
// widened (kPanel: wf, 128 bytes per pair) or still bf16 (the packed block at wb, converted as
// it is loaded: 4 ops per pair for all MR rows, against 4 + 2 MR in micro<Bf16Format>). Also
// prefetches pf_lines (at most K2) 64-byte lines at pf, one per pair (a chunk's share of the
// next block, into L2 as micro does: this build on the Zen 4 host, t2 against t0, 5 rows 1.28x,
// 8 1.29x, 16 1.18x, 24 1.09x, 64 1.0x), without a branch: with one, GCC 12 kept two copies of
// the loop and stored all 12 accumulators to the stack on every pair of the prefetching one.
template <int MR, bool kPanel>
void micro_f32(const Args& a, const float* xf, int64_t m, const void* w, int64_t n,
               const char* pf, int64_t pf_lines) {
  Bf16Format::Acc acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = Bf16Format::zero();
  const int64_t K2 = a.K2, K = 2 * K2;
  const float* x = xf + m * K;
  const float* wf = static_cast<const float*>(w);
  const char* wb = static_cast<const char*>(w);
  auto bf16x8 = [&](int64_t p, int half) {  // 8 pairs of lanes: 16 bf16 of line p
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + p * 64 + half * 32));
  };
  const int64_t pf_last = std::max<int64_t>(pf_lines - 1, 0);  // then the last line again
  for (int64_t p = 0; p < K2; ++p) {
    _mm_prefetch(pf + std::min(p, pf_last) * 64, _MM_HINT_T2);
    __m256 olo, ohi;
    if constexpr (kPanel) {
      olo = _mm256_loadu_ps(wf + p * 32), ohi = _mm256_loadu_ps(wf + p * 32 + 8);
    } else {
      olo = Bf16Format::odd(bf16x8(p, 0)), ohi = Bf16Format::odd(bf16x8(p, 1));
    }
    // in registers: else GCC folds the loads into every FMA (36 loads per 24 FMAs, beyond
    // Zen 3's load ports: 1.6x the time at 1,024 rows)
    asm("" : "+x"(olo), "+x"(ohi));
    for (int i = 0; i < MR; ++i) {
      const __m256 xo = _mm256_broadcast_ss(x + i * K + 2 * p + 1);
      acc[i].lo = _mm256_fmadd_ps(olo, xo, acc[i].lo);
      acc[i].hi = _mm256_fmadd_ps(ohi, xo, acc[i].hi);
    }
    __m256 elo, ehi;
    if constexpr (kPanel) {
      elo = _mm256_loadu_ps(wf + p * 32 + 16), ehi = _mm256_loadu_ps(wf + p * 32 + 24);
    } else {  // the line loaded again (from L1): no registers to keep it in
      elo = Bf16Format::even(bf16x8(p, 0)), ehi = Bf16Format::even(bf16x8(p, 1));
    }
    asm("" : "+x"(elo), "+x"(ehi));
    for (int i = 0; i < MR; ++i) {
      const __m256 xe = _mm256_broadcast_ss(x + i * K + 2 * p);
      acc[i].lo = _mm256_fmadd_ps(elo, xe, acc[i].lo);
      acc[i].hi = _mm256_fmadd_ps(ehi, xe, acc[i].hi);
    }
  }
#pragma GCC unroll 8  // else the array lives on the stack, stored to on every pair (GCC 12)
  for (int i = 0; i < MR; ++i) store_halves(acc[i].lo, acc[i].hi, n, a.N, a.y + (m + i) * a.N);
}

using F32Fn = void (*)(const Args&, const float*, int64_t, const void*, int64_t, const char*,
                       int64_t);
template <bool kPanel, int... I>
constexpr std::array<F32Fn, sizeof...(I)> f32_table(std::integer_sequence<int, I...>) {
  return {&micro_f32<I + 1, kPanel>...};
}

// rows m0 .. m1 against blocks b0 .. b1 as rows<> with one-block panels: each block (kPanel:
// widened once into this thread's panel) against the rows in chunks of at most kF32MR, the
// next block prefetched meanwhile
template <bool kPanel>
void rows_f32(const Args& a, const float* xf, int64_t m0, int64_t m1, int64_t b0, int64_t b1) {
  static constexpr auto kMicro = f32_table<kPanel>(std::make_integer_sequence<int, kF32MR>{});
  thread_local std::vector<char> keep;
  float* panel = nullptr;
  if constexpr (kPanel) {
    const size_t panel_bytes = a.K2 * 32 * sizeof(float);  // widen_block's output
    panel = reinterpret_cast<float*>(minisgl::scratch(keep, {panel_bytes})[0]);
  }
  const int64_t bb = a.K2 * Bf16Format::kLineBytes;
  const int64_t nb = std::max(b1, t_pf_to);  // the next block's prefetch goes past b1 to there
  for (int64_t b = b0; b < b1; ++b) {
    const char* wb = a.w + b * bb;
    const void* block = wb;
    if constexpr (kPanel) {
      widen_block(wb, a.K2, panel);
      block = panel;
    }
    chunks(a, m0, m1, kF32MR, a.w + (b + 1) * bb, b + 1 < nb ? bb / 64 : 0,
           [&](int64_t m, int64_t mr, const char* pf, int64_t pf_lines, int64_t) {
             kMicro[mr - 1](a, xf, m, block, b * kLanes, pf, pf_lines);
           });
  }
}

// x converted to float32 once, then rows_f32 on each thread's share
void run_f32(const Args& a, int64_t M, int64_t NB) {
  const int64_t K = 2 * a.K2;
  thread_local std::vector<char> keep;
  auto* xf = reinterpret_cast<float*>(minisgl::scratch(keep, {M * K * sizeof(float)})[0]);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    const auto* x = reinterpret_cast<const c10::BFloat16*>(a.x);
    for (int64_t i = m0 * K; i < m1 * K; ++i) xf[i] = static_cast<float>(x[i]);
  });
  split(M, NB, kF32MR, [&](int64_t m0, int64_t m1, int64_t b0, int64_t b1) {
    if (M >= kWideRows)
      rows_f32<true>(a, xf, m0, m1, b0, b1);
    else
      rows_f32<false>(a, xf, m0, m1, b0, b1);
  });
}

#endif  // MINISGL_LINEAR_AVX2

#if MINISGL_AMX

// --- AMX: tile multiplies -------------------------------------------------------------------
// A tile holds up to 16 rows of 64 bytes; eight of them. bf16: tdpbf16ps multiplies a tile of
// x (16 rows x 32 inputs) with a tile of w (16 pairs of inputs x 16 output features, as pairs:
// exactly 16 consecutive lines of a packed block, 64 bytes apart, read in place) into 16 x 16
// float32 sums: 8,192 multiply-adds per instruction against 32 for a 512-bit vdpbf16ps. Four
// sums at a time (32 rows x 2 blocks), two tiles of x and two of w per step of 32 inputs.
// int8: the same integer sums as the VNNI kernels, exactly. The int16 x of a row (|q| <= 8191)
// is split into a signed high byte and an unsigned low byte, q = 256 hi + lo; tdpbssd (signed
// x signed) and tdpbusd (unsigned x signed) multiply 64 inputs at a time with w's int8 in
// quads (4 consecutive inputs per output feature: two lines of a packed block interleaved, one
// permute per 64 bytes, into a panel per thread), and 256 sum_hi + sum_lo is sum q w in int32.
// Four sums (16 rows x 2 blocks x high, low), x's two bytes and two tiles of w per 64 inputs.
// Where minisgl::amx_usable() is false the vector kernels run.
constexpr int64_t kTileRows = 16;

// From how many rows of x on the tiles run, measured on a decode step's 120 SmolLM2 layer
// weights (2 threads of an Intel CPU with AMX, ~40 GB/s plain read; medians, two or three
// alternating runs). bf16 (212 MB): always; 1 row 6.1-6.3 ms against 8.1-8.4 in the GEMV, 5
// rows 5.6-6.0 vs 7.7-7.8 (the microkernel), 16 rows 7.0-9.4 vs 19.5-20.3, 1,024 rows 120-126
// ms (~1.8 TFLOP/s) vs 1,080 (~200). int8 (106 MB): from 12 rows, where the quads (~1.3 ms a
// step) stop costing more than the VNNI kernels save: 1 row 5.2-5.3 vs 3.8-4.3, 8 rows
// 5.4-5.6 vs 4.8-4.9, 12 rows 5.6-5.8 vs 6.1-6.2, 16 rows 5.9-6.2 vs 7.8-7.9, 64 rows 11.1-12.2
// vs 26.0-26.2, 1,024 rows 139-140 vs 388-389.
template <class F>
constexpr int64_t amx_rows_from() {
  return std::is_same_v<F, Int8Format> ? 12 : 1;
}


// inputs per tile step: 32 bf16 (16 pairs) or 64 int8 (16 quads)
template <class F>
constexpr int64_t amx_step() {
  return std::is_same_v<F, Int8Format> ? 64 : 32;
}

template <class F>
bool amx_applies(int64_t M, int64_t K) {
  return M >= amx_rows_from<F>() && K % amx_step<F>() == 0 && minisgl::amx_usable();
}

// every tile 16 rows x 64 bytes. The configuration is per thread: each thread loads it, and
// releases the tiles after.
inline void amx_begin() {
  minisgl::TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = kTileRows, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

// Row i of 16 x 16 sums stored from a tile (int8: lo at c and hi, 256 hi + lo, times sx and sw
// as Int8Format::finish) as float32: y's row m + i, outputs n .. n + 15 of the weight.
inline __m512 amx_row(const Args& a, int64_t m, int64_t i, int64_t n, const float* c,
                      const int32_t* hi, __mmask16 mask) {
  const __m512 v = _mm512_load_ps(c + i * 16);
  if (hi == nullptr) return v;
  const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(hi + i * 16), 8),
                                       _mm512_castps_si512(v));
  return Int8Format::finish(_mm512_castsi512_ps(sum), a.sx + m + i, a.sw + n, mask);
}

// y's row m + i, outputs n .. n + 15 (fewer at N), from a tile's sums (see amx_row). (The tile
// intrinsics take their tile's number as a literal: GCC's are macros that paste it into the
// instruction.)
inline void amx_store_row(const Args& a, int64_t m, int64_t i, int64_t n, const float* c,
                          const int32_t* hi) {
  const __mmask16 mask = lanes16(n, a.N);
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(amx_row(a, m, i, n, c, hi, mask));
  _mm256_mask_storeu_epi16(a.y + (m + i) * a.N + n, mask, h);
}

// The gated form (a.up > 0): y's row m + i, outputs n .. n + 15 = silu(g) * u from the gate's
// sums (c, hi) and the up half's (cu, hu; its outputs n + 16 a.up ..), as store_gated.
inline void amx_gated_row(const Args& a, int64_t m, int64_t i, int64_t n, const float* c,
                          const int32_t* hi, const float* cu, const int32_t* hu) {
  store_gated(amx_row(a, m, i, n, c, hi, 0xFFFF),
              amx_row(a, m, i, n + kLanes * a.up, cu, hu, 0xFFFF), a.y + (m + i) * a.N + n);
}

// bf16: x rows m .. m + 16 RT (RT = 1, 2 tiles of rows; `x` the first row of the group, `ld`
// bytes between rows) against NT = 1, 2 blocks (`w0`, `w1`: their first lines), the whole K;
// the sums into c (Sums). After each step of 32 inputs, fin(step) (Finisher) if Stepped.
template <int RT, int NT, bool Stepped, class Fin>
void amx_bf16(const char* x, int64_t ld, const char* w0, const char* w1, int64_t K2, float* c,
              Fin& fin) {
  _tile_zero(0);
  if constexpr (NT == 2) _tile_zero(1);
  if constexpr (RT == 2) _tile_zero(2);
  if constexpr (RT == 2 && NT == 2) _tile_zero(3);
  for (int64_t p = 0; p < K2; p += 16) {
    _tile_loadd(4, x + p * 4, ld);
    _tile_loadd(6, w0 + p * 64, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT == 2) {
      _tile_loadd(7, w1 + p * 64, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (RT == 2) {
      _tile_loadd(5, x + kTileRows * ld + p * 4, ld);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NT == 2) _tile_dpbf16ps(3, 5, 7);
    }
    if constexpr (Stepped) fin(p / 16 + 1);
  }
  _tile_stored(0, c, 64);
  if constexpr (NT == 2) _tile_stored(1, c + 256, 64);
  if constexpr (RT == 2) _tile_stored(2, c + 512, 64);
  if constexpr (RT == 2 && NT == 2) _tile_stored(3, c + 768, 64);
}

// int8: x's low and high bytes of rows m .. m + 16 (`lo`, `hi`: the group's first row, `ld`
// bytes between rows) against NT = 1, 2 blocks in quads (`w0`, `w1`), the whole K; the sums
// into c (Sums), fin as amx_bf16's (steps of 64 inputs).
template <int NT, bool Stepped, class Fin>
void amx_int8(const char* lo, const char* hi, int64_t ld, const char* w0, const char* w1,
              int64_t K2, float* c, Fin& fin) {
  _tile_zero(0);
  _tile_zero(2);
  if constexpr (NT == 2) {
    _tile_zero(1);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < 2 * K2; k += 64) {
    _tile_loadd(4, lo + k, ld);
    _tile_loadd(5, hi + k, ld);
    _tile_loadd(6, w0 + k * 16, 64);
    _tile_dpbusd(0, 4, 6);
    _tile_dpbssd(2, 5, 6);
    if constexpr (NT == 2) {
      _tile_loadd(7, w1 + k * 16, 64);
      _tile_dpbusd(1, 4, 7);
      _tile_dpbssd(3, 5, 7);
    }
    if constexpr (Stepped) fin(k / 64 + 1);
  }
  _tile_stored(0, c, 64);
  _tile_stored(2, c + 512, 64);
  if constexpr (NT == 2) {
    _tile_stored(1, c + 256, 64);
    _tile_stored(3, c + 768, 64);
  }
}

// A group's sums, stored from the tiles (1,024 floats at c), waiting to be written to y: rows
// m .. m + rows against the blocks of outputs n .. n + 16 nt (gated: y's block n, from the
// gate's and the up half's sums). bf16: tile (r, j) of rows 16 r .. and block j at c + 256 (2 r
// + j); int8 (16 rows): block j's low-byte sums at c + 256 j, high-byte sums at c + 512 + 256 j.
struct Sums {
  int64_t m, rows, n;
  int nt;
  const float* c;
};

// Writes a group's sums (Sums) to y, a share of its rows after each tile step of the next
// group (fin(step)), or all at once (fin.all()).
// It also prefetches the next pair of blocks of w into L2, a share of its lines per step
// (ahead()). Below kSteppedRows rows per thread neither pays (a batch-1 decode step's 121 weights
// 2-3% slower with them): each group's rows are written right after it, and the hardware's
// prefetch keeps up with the tiles' stream.
constexpr int64_t kSteppedRows = 8;
template <class F>
struct Finisher {
  const Args& a;
  int64_t steps;  // tile steps per group
  Sums s{0, 0, 0, 0, nullptr};
  int64_t done = 0, per = 0;  // rows written, rows per step
  const char* pf[2] = {nullptr, nullptr};  // the next blocks' lines still to prefetch
  int64_t pf_left[2] = {0, 0}, pf_per = 0;

  void operator()(int64_t step) {
    if (done < s.rows) upto(std::min(s.rows, per * step));
    for (int j = 0; j < 2; ++j)
      for (int64_t i = 0; i < pf_per && pf_left[j] > 0; ++i, --pf_left[j], pf[j] += 64)
        _mm_prefetch(pf[j], _MM_HINT_T1);
  }
  // the blocks at w0 and w1 (`bytes` each; w1 null: none) over the next `groups` groups' steps
  void ahead(const char* w0, const char* w1, int64_t bytes, int64_t groups) {
    pf[0] = w0;
    pf[1] = w1;
    pf_left[0] = w0 ? bytes / 64 : 0;
    pf_left[1] = w1 ? bytes / 64 : 0;
    pf_per = (bytes / 64 + groups * steps - 1) / (groups * steps);
  }
  void all() { upto(s.rows); }
  void upto(int64_t end) {
    constexpr bool kInt8 = std::is_same_v<F, Int8Format>;
    for (; done < end; ++done) {
      const int64_t r = done / kTileRows, i = done % kTileRows, m = s.m + r * kTileRows;
      auto lo = [&](int j) { return s.c + 256 * (kInt8 ? j : 2 * r + j); };
      auto hi = [&](int j) {
        return kInt8 ? reinterpret_cast<const int32_t*>(s.c + 512 + 256 * j) : nullptr;
      };
      if (a.up > 0)
        amx_gated_row(a, m, i, s.n, lo(0), hi(0), lo(1), hi(1));
      else
        for (int j = 0; j < s.nt; ++j) amx_store_row(a, m, i, s.n + j * kLanes, lo(j), hi(j));
    }
  }
  void next(const Sums& group) {
    all();
    s = group;
    done = 0;
    per = (s.rows + steps - 1) / steps;
  }
};

// a block of int8 pairs (K2 lines of 32 bytes) as quads: line t of the output (64 bytes) holds,
// for each of the 16 outputs j, its inputs 4t .. 4t + 3 (input lines 2t and 2t + 1, words j)
void quads(const char* w, int64_t K2, char* out) {
  alignas(64) static constexpr int16_t kIdx[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                                   21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                                   11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512(kIdx);
  for (int64_t t = 0; t < K2 / 2; ++t)
    _mm512_store_si512(out + t * 64, _mm512_permutexvar_epi16(idx, _mm512_loadu_si512(w + t * 64)));
}

// rows m0 .. m1 x blocks b0 .. b1 on this thread: block pairs outer (in L1 or L2), groups of
// rows inner (32 in bf16, 16 in int8), over chunks of rows that fit L2 beside them. x: bf16
// rows (a.x), or for int8 the low bytes of the rows then (at lo + M * K) their high bytes.
// Gated (a.up > 0): blocks b0 .. b1 of y, each from a pair of the gate's block b and the up
// half's block b + a.up.
// A group's sums are written to y while the tiles multiply the next group: its rows' stores and
// conversions (and the gated form's SiLU) go between that group's tile steps (Finisher), which
// the core runs side by side, so that neither waits for the other. Measured on a 4,096 x 576 x
// 1,536-per-half gated bf16 layer (2 threads): the epilogue after its own group took ~31% of
// the kernel's samples; after the next group's whole loop, no faster (the tile loads fill the
// core's reorder window); between its steps, the plain linears at K = 1,536 5% faster, the
// others within noise. From kSteppedRows rows per thread (see Finisher).
template <class F>
void amx_rows(const Args& a, const char* lo, int64_t M, int64_t m0, int64_t m1, int64_t b0,
              int64_t b1) {
  constexpr bool kInt8 = std::is_same_v<F, Int8Format>;
  constexpr int64_t kGroup = kInt8 ? kTileRows : 2 * kTileRows;
  const int64_t K = 2 * a.K2, ld = kInt8 ? K : 2 * K, bb = a.K2 * F::kLineBytes;
  const char* x = kInt8 ? lo : reinterpret_cast<const char*>(a.x);
  const char* hi = lo + M * K;  // int8 only
  const int64_t chunk = std::max<int64_t>(kGroup, (size_t(1) << 20) / ld / kGroup * kGroup);
  thread_local std::vector<char> keep;
  const auto s = minisgl::scratch(keep, {size_t(2 * kGroup * ld),
                                              size_t(kInt8 ? 2 * bb : 0), size_t(8 * 1024)});
  char* pad = s[0];  // (int8: then the high bytes' pad at pad + kGroup * ld)
  char* panel = s[1];
  auto* sums = reinterpret_cast<float*>(s[2]);  // two groups' sums: this one's, the pending one's
  Finisher<F> fin{a, kInt8 ? a.K2 / 32 : a.K2 / 16};
  const bool gated = a.up > 0, stepped = m1 - m0 >= kSteppedRows;
  int64_t group = 0;
  amx_begin();
  for (int64_t mc = m0; mc < m1; mc += chunk) {
    const int64_t mc1 = std::min(m1, mc + chunk);
    // the last group of fewer than 16 (or 32) rows: its rows, then zeros (a tile load reads
    // all 16), once for all blocks
    const int64_t last = mc + (mc1 - mc - 1) / kGroup * kGroup, last_rows = mc1 - last;
    const int64_t padded = (last_rows + kTileRows - 1) / kTileRows * kTileRows;
    if (last_rows % kTileRows != 0)
      for (int part = 0; part < (kInt8 ? 2 : 1); ++part) {
        char* to = pad + part * kGroup * ld;
        std::memcpy(to, (part == 0 ? x : hi) + last * ld, last_rows * ld);
        std::memset(to + last_rows * ld, 0, (padded - last_rows) * ld);
      }
    const int64_t groups = (mc1 - mc + kGroup - 1) / kGroup;
    for (int64_t b = b0; b < b1; b += gated ? 1 : 2) {
      const int nt = gated || b + 1 < b1 ? 2 : 1;
      const char* w0 = a.w + b * bb;
      const char* w1 = gated ? a.w + (b + a.up) * bb : w0 + bb;
      // the next pair's blocks (none past the last: the next chunk starts cold)
      const int64_t nb = b + (gated ? 1 : 2);
      if (nb < b1 && stepped) {
        const char* second = gated ? a.w + (nb + a.up) * bb
                                   : nb + 1 < b1 ? a.w + (nb + 1) * bb : nullptr;
        fin.ahead(a.w + nb * bb, second, bb, groups);
      } else {
        fin.ahead(nullptr, nullptr, 0, 1);
      }
      if constexpr (kInt8) {
        // (the pending group's sums stay where they are: only the panel changes)
        quads(w0, a.K2, panel);
        if (nt == 2) quads(w1, a.K2, panel + bb);
        w0 = panel;
        w1 = panel + bb;
      }
      for (int64_t m = mc; m < mc1; m += kGroup, ++group) {
        const int64_t rows = std::min(kGroup, mc1 - m);
        const bool padded_group = rows % kTileRows != 0;
        const char* xg = padded_group ? pad : x + m * ld;
        float* c = sums + 1024 * (group & 1);
        if constexpr (kInt8) {
          const char* hg = padded_group ? pad + kGroup * ld : hi + m * ld;
          using Fn = void (*)(const char*, const char*, int64_t, const char*, const char*,
                              int64_t, float*, Finisher<F>&);
          constexpr Fn kFn[2][2] = {
              {&amx_int8<1, false, Finisher<F>>, &amx_int8<2, false, Finisher<F>>},
              {&amx_int8<1, true, Finisher<F>>, &amx_int8<2, true, Finisher<F>>}};
          kFn[stepped][nt - 1](xg, hg, ld, w0, w1, a.K2, c, fin);
        } else {
          using Fn = void (*)(const char*, int64_t, const char*, const char*, int64_t, float*,
                              Finisher<F>&);
          constexpr Fn kFn[2][2][2] = {
              {{&amx_bf16<1, 1, false, Finisher<F>>, &amx_bf16<1, 2, false, Finisher<F>>},
               {&amx_bf16<2, 1, false, Finisher<F>>, &amx_bf16<2, 2, false, Finisher<F>>}},
              {{&amx_bf16<1, 1, true, Finisher<F>>, &amx_bf16<1, 2, true, Finisher<F>>},
               {&amx_bf16<2, 1, true, Finisher<F>>, &amx_bf16<2, 2, true, Finisher<F>>}}};
          kFn[stepped][rows > kTileRows][nt - 1](xg, ld, w0, w1, a.K2, c, fin);
        }
        fin.next({m, rows, b * kLanes, nt, c});
        if (!stepped) fin.all();
      }
    }
  }
  fin.all();
  _tile_release();
}

// all M rows on the tiles, over the threads as split() shares them. int8: `lo` as amx_rows.
// bf16 from 256 rows per thread on: the rows split, each thread reading all of the weight, not
// its half of the blocks against all rows. A thread's x (576 inputs: 0.3 MB per 256 rows) then
// stays in its L2 beside the weight's stream and its y, and in the engine it is what that
// thread's share of the previous kernel wrote (Inductor's loops split rows alike), y what it
// reads next. Measured (2 threads): the 120 SmolLM2 layer weights at 1,024 rows 120-125 ->
// 107-108 ms, 512 rows 56-61 -> 55-56, 256 rows 31-33 -> 33-38 (worse, so not there); a
// 1,024-token prefill in the engine 224-231 -> 194-205 ms. (int8, whose threads would each
// make every block's quads, measured within noise: left as it was.)
constexpr int64_t kRowsEach = 256;
template <class F>
void run_amx(const Args& a, int64_t M, int64_t NB, const char* lo = nullptr) {
  constexpr int64_t kGroup = std::is_same_v<F, Int8Format> ? kTileRows : 2 * kTileRows;
  split(M, NB, kGroup, [&](int64_t m0, int64_t m1, int64_t b0, int64_t b1) {
    amx_rows<F>(a, lo, M, m0, m1, b0, b1);
  }, std::is_same_v<F, Bf16Format> ? kRowsEach : 0);
}

// int16 x (|q| <= 8191) -> its low bytes (unsigned) and high bytes (signed): q = 256 hi + lo
void split_bytes(const int16_t* q, int64_t n, uint8_t* lo, int8_t* hi) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512i v = _mm512_loadu_si512(q + i);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + i), _mm512_cvtepi16_epi8(v));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + i),
                        _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
  }
  for (; i < n; ++i) {
    lo[i] = static_cast<uint8_t>(q[i] & 0xFF);
    hi[i] = static_cast<int8_t>(q[i] >> 8);
  }
}

#endif  // MINISGL_AMX

template <class F>
void run(const Args& a, int64_t M, int64_t NB) {
  if (M == 0) return;
#if MINISGL_AMX
  if constexpr (std::is_same_v<F, Bf16Format>) {
    if (amx_applies<F>(M, 2 * a.K2)) return run_amx<F>(a, M, NB);
  }
#endif
#if MINISGL_LINEAR_AVX2
  if constexpr (std::is_same_v<F, Bf16Format>) {
    if (M > Bf16Format::kGemvRows) return run_f32(a, M, NB);
  }
#endif
  split(M, NB, F::kMR, [&](int64_t m0, int64_t m1, int64_t b0, int64_t b1) {
    rows<F>(a, m0, m1, b0, b1);
  }, 0, M > F::kGemvRows ? F::kNR : 1);
}

// Row m of x (bf16) -> int16 with |q| <= qmax and q * sx[m] ~= x, rounded to nearest even
// (explicitly: whatever rounding mode the thread has set).
#if MINISGL_LINEAR_FAST
void quantize_row(const c10::BFloat16* x, int64_t K, int32_t qmax, int16_t* q, float* sx) {
  auto mask = [&](int64_t k) {
    return lanes16(k, K);
  };
  auto load16 = [&](int64_t k) {  // 16 bf16 (fewer at the end, zeros past K) as float32
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask(k), x + k)), 16));
  };
  __m512 vmax = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16)
    vmax = _mm512_max_ps(vmax, _mm512_andnot_ps(_mm512_set1_ps(-0.0f), load16(k)));
  const float amax = _mm512_reduce_max_ps(vmax);
  // an all-zero (or non-finite) row: zeros, scale 0 (a non-finite x gives no finite y anyway)
  const float inv = amax > 0 && std::isfinite(amax) ? static_cast<float>(qmax) / amax : 0.0f;
  *sx = inv > 0 ? amax / static_cast<float>(qmax) : 0.0f;
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int64_t k = 0; k < K; k += 16) {
    __m512i v = _mm512_cvt_roundps_epi32(_mm512_mul_ps(load16(k), vinv),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_mask_storeu_epi16(q + k, mask(k), _mm512_cvtsepi32_epi16(v));
  }
}
#else  // AVX2: the same steps 8 lanes at a time
void quantize_row(const c10::BFloat16* x, int64_t K, int32_t qmax, int16_t* q, float* sx) {
  // 8 bf16 (fewer at the end, zeros past K) as float32
  auto load8 = [&](int64_t k) { return minisgl_vec::load_bf16(x + k, K - k); };
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 vmax = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, load8(k)));
  const float amax = minisgl_vec::hmax8(vmax);
  const float inv = amax > 0 && std::isfinite(amax) ? static_cast<float>(qmax) / amax : 0.0f;
  *sx = inv > 0 ? amax / static_cast<float>(qmax) : 0.0f;
  const __m256 vinv = _mm256_set1_ps(inv);
  for (int64_t k = 0; k < K; k += 8) {
    const __m256i v = _mm256_cvtps_epi32(_mm256_round_ps(
        _mm256_mul_ps(load8(k), vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    // int32 -> int16 with saturation; packs works per 128-bit lane, so take lanes 0 and 2
    const __m128i h = _mm256_castsi256_si128(
        _mm256_permute4x64_epi64(_mm256_packs_epi32(v, v), 0x08));
    if (K - k >= 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), h);
    } else {
      alignas(16) int16_t t[8];
      _mm_store_si128(reinterpret_cast<__m128i*>(t), h);
      std::memcpy(q + k, t, (K - k) * sizeof(int16_t));
    }
  }
}
#endif

#endif  // MINISGL_LINEAR_ANY

void check_packed(const at::Tensor& x, const at::Tensor& wp, int64_t N, const char* name) {
  TORCH_CHECK(x.dim() == 2 && wp.dim() == 4 && wp.size(2) == kLanes && wp.size(3) == 2,
              "x [M, K], w packed by ", name);
  TORCH_CHECK(wp.size(1) * 2 == x.size(1), "x has ", x.size(1), " columns, the packed weight ",
              wp.size(1) * 2);
  const int64_t NB = wp.size(0);
  TORCH_CHECK(N > (NB - 1) * kLanes && N <= NB * kLanes, "N = ", N, " does not match the "
              "packed weight's ", NB, " blocks");
}

// y [M, N] = x [M, K] @ w.T, w packed by bf16_pack; x contiguous. up > 0: the gated form
// (Args), on the tiles or in the AVX-512 panels (the caller checked gated_fused).
void bf16_into(const c10::BFloat16* x, int64_t M, int64_t K, const at::Tensor& wp, int64_t N,
               c10::BFloat16* y, int64_t up = 0) {
#if MINISGL_LINEAR_ANY
  const Args a{reinterpret_cast<const int32_t*>(x), K / 2,
               static_cast<const char*>(wp.const_data_ptr()), y, N, nullptr, nullptr, up};
  run<Bf16Format>(a, M, up > 0 ? up : wp.size(0));  // (gated: N = 16 up, up blocks of y)
#endif
}

// The linears' bf16 result y as out_dtype: bf16 (y itself) or float32, each value y's, widened
// on the calling thread in the same call. For the LM head, whose float32 logits the sampler
// takes: `.float()` after it was a parallel op of its own, ~50-100 us of a batch-1 decode step
// (its code and data back from DRAM after the weights' stream, a parallel region to wake).
at::Tensor as_out(const at::Tensor& y, const std::optional<at::ScalarType>& out_dtype) {
  if (!out_dtype.has_value() || *out_dtype == at::kBFloat16) return y;
  TORCH_CHECK(*out_dtype == at::kFloat, "out_dtype must be bf16 or float32");
  at::Tensor f = at::empty(y.sizes(), y.options().dtype(at::kFloat));
  const auto* src = reinterpret_cast<const uint16_t*>(y.const_data_ptr<c10::BFloat16>());
  auto* dst = reinterpret_cast<uint32_t*>(f.mutable_data_ptr<float>());
  // (one row of logits on this thread; 32 rows, 6 MB written, on all of them)
  at::parallel_for(0, y.numel(), 1 << 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) dst[i] = static_cast<uint32_t>(src[i]) << 16;  // exact
  });
  return f;
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& wp, int64_t N,
                       std::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(MINISGL_LINEAR_ANY, "bf16_linear needs AVX2 and FMA (or AVX-512)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && wp.scalar_type() == at::kBFloat16,
              "x and w must be bf16");
  check_packed(x, wp, N, "bf16_pack");
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor xc = x.contiguous(), wc = wp.contiguous();
  bf16_into(xc.const_data_ptr<c10::BFloat16>(), M, x.size(1), wc, N,
            y.mutable_data_ptr<c10::BFloat16>());
  return as_out(y, out_dtype);
}

// y [M, N] = x [M, K] @ (w * scales[:, None]).T, w packed by int8_pack; x contiguous. up > 0:
// as bf16_into's.
void int8_into(const c10::BFloat16* x, int64_t M, int64_t K, const at::Tensor& wp,
               const float* scales, int64_t N, c10::BFloat16* y, int64_t up = 0) {
#if MINISGL_LINEAR_ANY
  // K products of 127 * qmax must fit an int32
  const int32_t qmax = static_cast<int32_t>(
      std::min<int64_t>(kInt8MaxQ, INT32_MAX / (127 * std::max<int64_t>(K, 1))));
  thread_local std::vector<char> keep;
#if MINISGL_AMX
  const bool amx = amx_applies<Int8Format>(M, K);
#else
  constexpr bool amx = false;
#endif
  // x as int16, and on the tiles also as its low and high bytes [M, K] each
  const auto p = minisgl::scratch(keep, {M * K * sizeof(int16_t), M * sizeof(float),
                                              amx ? size_t(2 * M * K) : 0});
  int16_t* qp = reinterpret_cast<int16_t*>(p[0]);
  float* sxp = reinterpret_cast<float*>(p[1]);
  at::parallel_for(0, M, std::max<int64_t>(1, 32768 / std::max<int64_t>(K, 1)),
                   [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      quantize_row(x + m * K, K, qmax, qp + m * K, sxp + m);
#if MINISGL_AMX
      if (amx)
        split_bytes(qp + m * K, K, reinterpret_cast<uint8_t*>(p[2]) + m * K,
                    reinterpret_cast<int8_t*>(p[2]) + (M + m) * K);
#endif
    }
  });
  const Args a{reinterpret_cast<const int32_t*>(qp), K / 2,
               static_cast<const char*>(wp.const_data_ptr()), y, N, sxp, scales, up};
#if MINISGL_AMX
  if (amx) return run_amx<Int8Format>(a, M, up > 0 ? up : wp.size(0), p[2]);
#endif
  run<Int8Format>(a, M, up > 0 ? up : wp.size(0));
#endif
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& scales,
                       int64_t N, std::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(MINISGL_LINEAR_ANY, "int8_linear needs AVX2 and FMA (or AVX-512)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && wp.scalar_type() == at::kChar &&
                  scales.scalar_type() == at::kFloat,
              "x must be bf16, w int8 (int8_pack), scales float32");
  check_packed(x, wp, N, "int8_pack");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == N, "scales must be [N] = [", N, "]");
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor xc = x.contiguous(), sc = scales.contiguous(), wc = wp.contiguous();
  int8_into(xc.const_data_ptr<c10::BFloat16>(), M, K, wc, sc.const_data_ptr<float>(), N,
            y.mutable_data_ptr<c10::BFloat16>());
  return as_out(y, out_dtype);
}

// act [M, I] = silu(g) * u from a linear's output gu [M, 2I] = [g u], each row as
// amx_gated_row computes it.
void silu_mul_rows(const c10::BFloat16* gu, int64_t M, int64_t I, c10::BFloat16* act) {
#if MINISGL_LINEAR_ANY
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const c10::BFloat16 *g = gu + m * 2 * I, *u = g + I;
      c10::BFloat16* y = act + m * I;
#if MINISGL_LINEAR_FAST
      for (int64_t i = 0; i < I; i += kLanes) {
        const __mmask16 k = lanes16(i, I);
        const __m512 gv = _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(k, g + i));
        const __m512 uv = _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(k, u + i));
        _mm256_mask_storeu_epi16(y + i, k,
                                 (__m256i)_mm512_cvtneps_pbh(minisgl_vec::silu_mul16(gv, uv)));
      }
#else
      for (int64_t i = 0; i < I; i += 8)
        minisgl_vec::store_bf16(y + i, minisgl_vec::silu_mul8(minisgl_vec::load_bf16(g + i, I - i),
                                                              minisgl_vec::load_bf16(u + i, I - i)),
                                I - i);
#endif
    }
  });
#endif
}

// Whether gated_into's product is made in one pass (whole blocks of each half): on the tiles
// (AMX for M rows), or in the AVX-512 build's panels (more rows than the GEMV takes: micro<>'s
// gated form, each panel 2 blocks of the gate and their 2 of the up half). Against the linear
// then silu_mul_rows (the same arithmetic: equal outputs), SmolLM2's gate-up [3072, 576] on AMD
// Zen 4, 2 threads, the builds alternating in one process (11 pairs): bf16 8 rows 1.065x, 64
// 1.035x, 1,024 1.071x, 4,096 1.092x; int8 1.07x, 0.98x, 1.04x, 1.06x.
bool gated_fused(int64_t M, int64_t K, int64_t I, bool int8) {
  if (I % kLanes != 0) return false;
#if MINISGL_AMX
  if (int8 ? amx_applies<Int8Format>(M, K) : amx_applies<Bf16Format>(M, K)) return true;
#endif
#if MINISGL_LINEAR_FAST
  return M > (int8 ? Int8Format::kGemvRows : Bf16Format::kGemvRows);
#else
  return false;
#endif
}

// a weight packed for K inputs and N outputs, and its scales for int8 (scales not null)
void check_weight(int64_t K, const at::Tensor& packed, const at::Tensor* scales, int64_t N) {
  TORCH_CHECK(MINISGL_LINEAR_ANY, "the linear kernels need AVX2 and FMA (or AVX-512)");
  const bool int8 = scales != nullptr;
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) * 2 == K && packed.size(0) * kLanes >= N &&
                  packed.is_contiguous() &&
                  packed.scalar_type() == (int8 ? at::kChar : at::kBFloat16),
              "a weight packed by ", int8 ? "int8_pack" : "bf16_pack", " with K = ", K,
              " inputs and N = ", N, " outputs");
  TORCH_CHECK(!int8 || (scales->numel() == N && scales->is_contiguous() &&
                        scales->scalar_type() == at::kFloat), "scales: float32 [", N, "]");
}

}  // namespace

namespace minisgl {

void linear_into(const c10::BFloat16* x, int64_t M, int64_t K, const at::Tensor& packed,
                 const at::Tensor* scales, int64_t N, c10::BFloat16* y) {
  check_weight(K, packed, scales, N);
  if (scales != nullptr)
    int8_into(x, M, K, packed, scales->const_data_ptr<float>(), N, y);
  else
    bf16_into(x, M, K, packed, N, y);
}

void gated_into(const c10::BFloat16* x, int64_t M, int64_t K, const at::Tensor& packed,
                const at::Tensor* scales, int64_t I, c10::BFloat16* act) {
  const bool int8 = scales != nullptr;
  if (gated_fused(M, K, I, int8)) {
    check_weight(K, packed, scales, 2 * I);
    if (int8)
      int8_into(x, M, K, packed, scales->const_data_ptr<float>(), I, act, I / kLanes);
    else
      bf16_into(x, M, K, packed, I, act, I / kLanes);
    return;
  }
  thread_local std::vector<char> keep;
  auto* gu = reinterpret_cast<c10::BFloat16*>(
      minisgl::scratch(keep, {size_t(M * 2 * I) * sizeof(c10::BFloat16)})[0]);
  linear_into(x, M, K, packed, scales, 2 * I, gu);
  silu_mul_rows(gu, M, I, act);
}

}  // namespace minisgl

// silu(x @ gate.T) * (x @ up.T) for w = [gate; up] [n, K] packed by bf16_pack (int8_pack with
// its scales): [M, n / 2], without the [M, n] linear output where the tiles run.
static at::Tensor linear_silu(const at::Tensor& x, const at::Tensor& wp,
                              const std::optional<at::Tensor>& scales, int64_t n) {
  TORCH_CHECK(MINISGL_LINEAR_ANY, "the linear kernels need AVX2 and FMA (or AVX-512)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "x must be bf16");
  check_packed(x, wp, n, scales ? "int8_pack" : "bf16_pack");
  TORCH_CHECK(n % 2 == 0, "n (the gate's and the up half's outputs) must be even, not ", n);
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor y = at::empty({M, n / 2}, x.options());
  at::Tensor xc = x.contiguous();
  std::optional<at::Tensor> sc;
  if (scales) {
    TORCH_CHECK(scales->scalar_type() == at::kFloat && scales->dim() == 1 &&
                    scales->size(0) == n, "scales must be float32 [n] = [", n, "]");
    sc = scales->contiguous();
  }
  minisgl::gated_into(xc.const_data_ptr<c10::BFloat16>(), M, K, wp.contiguous(),
                      sc ? &*sc : nullptr, n / 2, y.mutable_data_ptr<c10::BFloat16>());
  return y;
}

static at::Tensor bf16_linear_silu(const at::Tensor& x, const at::Tensor& wp, int64_t n) {
  return linear_silu(x, wp, std::nullopt, n);
}

static at::Tensor int8_linear_silu(const at::Tensor& x, const at::Tensor& wp,
                                   const at::Tensor& scales, int64_t n) {
  return linear_silu(x, wp, scales, n);
}

// Which build of the linear kernels runs here: "avx512+amx" (with tiles), "avx512", "avx2", or
// "" (neither: the ops refuse)
static std::string linear_isa() {
#if MINISGL_AMX
  if (minisgl::amx_usable()) return "avx512+amx";
#endif
  return MINISGL_LINEAR_FAST ? "avx512" : MINISGL_LINEAR_AVX2 ? "avx2" : "";
}

TORCH_LIBRARY_FRAGMENT(minisgl_cpu, m) {
  m.def("linear_isa() -> str", &linear_isa);
  m.def("weight_zeros(int[] size, ScalarType dtype) -> Tensor", &minisgl::weight_zeros);
  m.def("bf16_pack(Tensor w) -> Tensor");
  m.def("bf16_rows(Tensor packed, Tensor ids) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor w, int n, ScalarType? out_dtype=None) -> Tensor");
  m.def("int8_pack(Tensor w) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor w, Tensor scales, int n, ScalarType? out_dtype=None) "
        "-> Tensor");
  m.def("bf16_linear_silu(Tensor x, Tensor w, int n) -> Tensor");
  m.def("int8_linear_silu(Tensor x, Tensor w, Tensor scales, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(minisgl_cpu, CPU, m) {
  m.impl("bf16_pack", &bf16_pack);
  m.impl("bf16_rows", &bf16_rows);
  m.impl("bf16_linear", &bf16_linear);
  m.impl("int8_pack", &int8_pack);
  m.impl("int8_linear", &int8_linear);
  m.impl("bf16_linear_silu", &bf16_linear_silu);
  m.impl("int8_linear_silu", &int8_linear_silu);
}
