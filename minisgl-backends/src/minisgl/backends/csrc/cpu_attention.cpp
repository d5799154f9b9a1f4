// Paged attention on x86 CPUs (prefill, extend and decode in one kernel), for AVX512-BF16 or,
// in float32, AVX2 with FMA. Built on first use by minisgl/backends/cpu_kernels.py; see there
// for when it is used.
//
// Inputs: q [T, H, D] bf16 (the batch's new tokens, request after request); the KV pool k, v
// [KVH, S, D] bf16 (minisgl.core.kvcache.KVPool, already holding the new tokens' K/V), read in
// place, or int8 [KVH, S, D + 4] (a row's D values, then its float32 scale: KVPool's int8
// records; see load_block, and dequant_rows in the AVX2 build); slots [B, Lk] int64 (row b:
// request b's pool slots in position order); kv_lens [B];
// q_start, q_lens [B] (request b's queries are rows q_start[b] ... of q, the last q_lens[b]
// positions of its kv_lens[b]; none where q_lens[b] = 0: the request is skipped, and rows of q
// that no request names are neither read nor written). Causal: query i of b (at position p = kv_lens[b] - q_lens[b] + i)
// sees keys 0 .. p, or with a sliding window W > 0 only the last W of them, p - W + 1 .. p.
//
// Work items are (request, kv head, block of up to 16 queries, key split); a query block's rows
// are its queries x the G query heads that share the kv head. Per item, keys go by in blocks of
// 16: the block's K is transposed into bf16 pairs so that one vdpbf16ps per pair of dims gives
// a row's 16 scores (no horizontal sums), the softmax is online (a reference max and a sum per
// row, float32, in base 2), and P (rounded to bf16) times V uses vdpbf16ps over pairs of keys;
// a decode item of up to 4 rows keeps its running state in registers (run_decode).
// Decode batches with fewer items than threads split each request's keys (split-K) and merge
// the parts.
// Decode requests whose slot rows begin with the same slots (a prefix the radix cache shares)
// form groups: items run the shared keys for the queries of up to 16 of them (split into pieces
// only as far as the threads need), each request runs its own keys after, and the parts merge
// as in split-K (not with a window: every request sees keys of its own range). Threads claim
// runs of consecutive items of about equal work; in a decode step each prefetches the first
// keys of its next item while it runs the current one (Ahead). The AVX2 build (no bf16 dot
// product) runs the same items and blocks in float32: K widened once per block, P not rounded
// (see run_item there), except that an item of one decode query runs two passes over its keys
// instead (run_decode). Where AMX tiles run (cpu_linear.cpp), items of 16 rows or more multiply on
// them (run_item_amx), with both products transposed (S^T = K Q^T: key blocks are tile rows
// as they lie in the pool's pages, the softmax runs lane-wise; O^T = V^T P^T, P^T as the
// softmax makes it), and a prefill or extend batch builds each distinct key block's V^T once
// for all its items (Blocks).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numbers>
#include <span>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "kernels.h"

// Two builds of the per-item kernel (run_item, write_row): AVX512-BF16, or AVX2 with FMA
// (float32 arithmetic, below); the work items, split-K and the merge are shared.
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__AVX512VNNI__)
#define MINISGL_FAST 1
#define MINISGL_ATTN_AVX2 0
#include <immintrin.h>

#include "vec.h"
#elif defined(__AVX2__) && defined(__FMA__)
#define MINISGL_FAST 0
#define MINISGL_ATTN_AVX2 1
#include <immintrin.h>

#include "vec.h"
#else
#define MINISGL_FAST 0
#define MINISGL_ATTN_AVX2 0
#endif
#define MINISGL_ATTN_ANY (MINISGL_FAST || MINISGL_ATTN_AVX2)
// AMX tiles for items of many rows (prefill, extend, shared-prefix decode) in the AVX-512 build
#if MINISGL_FAST && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define MINISGL_ATTN_AMX 1
#else
#define MINISGL_ATTN_AMX 0
#endif

namespace {

#if MINISGL_ATTN_ANY

constexpr int KB = 16;    // keys per block
constexpr int QB = 16;    // queries per work item
constexpr int MAXD = 256;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// A pool row's length in uint16 (both pools are read through uint16 pointers): D bf16 values,
// or an int8 record's D values and float32 scale, (D + 4) / 2.
inline int64_t pool_row(int64_t D, bool q8) { return q8 ? (D + 4) / 2 : D; }

// An int8 record's scale: the float32 after its D values.
inline float record_scale(const uint16_t* row, int64_t D) {
  float s;
  std::memcpy(&s, reinterpret_cast<const char*>(row) + D, sizeof(s));
  return s;
}

struct Item {
  int64_t b, h, q0, nq, k0, k1;  // request, kv head, first query, queries, key range
  int64_t part;                   // index into the split-K buffer, -1: write the output directly
  // Decode over a shared prefix: the item's rows are the queries of requests members[m0 ..
  // m0 + mn) (b is the first), keys [k0, k1) common to all; parts part .. part + mn - 1.
  int64_t m0 = 0, mn = 0;
};

// Row r of an item (query r / G of the item, head r % G of the kv head's group): its query's
// offset in q, and the keys it sees, [low, lim) (all of a shared prefix to a decode query; from
// the window's first key on); its running max m and sum l start empty.
void item_rows(const Item& it, int64_t prefix, int64_t qrow0, const int64_t* members,
               const int64_t* q_start, int64_t H, int64_t G, int64_t D, int64_t window,
               int64_t* qoff, int64_t* lim, int64_t* low, float* m, float* l) {
  for (int64_t r = 0; r < it.nq * G; ++r) {
    const int64_t i = it.q0 + r / G, g = r % G;
    const int64_t row = it.mn > 0 ? q_start[members[it.m0 + r / G]] : qrow0 + i;
    qoff[r] = (row * H + it.h * G + g) * D;
    lim[r] = it.mn > 0 ? it.k1 : std::min(it.k1, prefix + i + 1);
    low[r] = window > 0 ? std::max<int64_t>(0, prefix + i + 1 - window) : 0;
    m[r] = NEG_INF;
    l[r] = 0.f;
  }
}

// The lanes [hidden, visible) of the block of nk keys from kb that a row seeing keys [low, lim)
// sees (hidden: before its window); false when it sees none of them.
inline bool row_lanes(int64_t low, int64_t lim, int64_t kb, int nk, int64_t& hidden,
                      int64_t& visible) {
  visible = std::clamp<int64_t>(lim - kb, 0, nk);
  hidden = std::clamp<int64_t>(low - kb, 0, nk);
  return hidden < visible;
}

// Prefetch a K or V row (D bf16); Locality 3: into L1, 1: L2. Always inlined, as prefetch_rows:
// GCC 12 at -O3 deletes a call to a function whose only effect is __builtin_prefetch (it counts
// as having none), and decode attention from memory runs ~2x slower without them.
template <int Locality = 3>
__attribute__((always_inline)) inline void prefetch_row(const uint16_t* row, int64_t D) {
  for (int64_t off = 0; off < D; off += 32) __builtin_prefetch(row + off, 0, Locality);
}

// ... the K and V rows of keys [j0, j1) (their slots in srow). runs: where the keys' slots are
// consecutive, the rows' span at once, a line at a time: an int8 pool's rows (D + 4 bytes, two
// lines' prefetches each) lie ~2 to a line pair, and a row at a time asked for lines twice
// (decode over int8 pools, 30 layers: in cache 8 x 450 keys 72-82 -> 65-66 us per layer, from
// DRAM 32 x 450 9.75 -> 8.38 ms per step; for bf16 rows, a line each anyway, 0.98-1.01x).
template <int Locality>
__attribute__((always_inline)) inline void prefetch_rows(const uint16_t* kh, const uint16_t* vh,
                                                         const int64_t* srow, int64_t j0,
                                                         int64_t j1, int64_t D,
                                                         bool runs = false) {
  if (runs && j1 > j0 && srow[j1 - 1] - srow[j0] == j1 - j0 - 1) {
    prefetch_row<Locality>(kh + srow[j0] * D, (j1 - j0) * D);
    prefetch_row<Locality>(vh + srow[j0] * D, (j1 - j0) * D);
    return;
  }
  for (int64_t j = j0; j < j1; ++j) {
    prefetch_row<Locality>(kh + srow[j] * D, D);
    prefetch_row<Locality>(vh + srow[j] * D, D);
  }
}

// The K and V rows of the block of keys kb .. kb + nk - 1 (null past nk).
inline void row_ptrs(const uint16_t* kh, const uint16_t* vh, const int64_t* srow, int64_t kb,
                     int nk, int64_t D, const uint16_t** krow, const uint16_t** vrow) {
  for (int j = 0; j < KB; ++j) {
    krow[j] = j < nk ? kh + srow[kb + j] * D : nullptr;
    vrow[j] = j < nk ? vh + srow[kb + j] * D : nullptr;
  }
}

// row_ptrs, and prefetches. Pages are scattered in the pool: ask for the rows kL1Ahead blocks
// ahead of use into L1, then the rows kL2Ahead blocks ahead into L2 (prefetcht2). Measured for
// 64 decode requests x 1,104 keys on scattered pages (K/V from DRAM, AVX-512): L1 alone two
// ahead 5.9 ms, three ahead 6.0, L2 alone 6.3-7.1, both (2 and 3 ahead) 3.2-3.4 ms per layer
// (4.1 with the L2 loop first); from cache (16 x 600 keys) unchanged. Then 3 and 5 ahead (with
// Ahead's kL2Ahead blocks), against 2 and 3 (Ahead 2): decode over 30 layers' pools in turn (K/V
// from DRAM, 2 threads, the builds alternating in one process, 9 pairs) 64 x 80 keys 1.21x, 64
// x 400 1.11x, 64 x 1,100 1.09x, 16 x 300 1.06x, 64 in 8 groups on a shared 1,024-key prefix
// 1.07x, 1 x 500 1.0x; from cache, a 1,024-token prefill 0.98x, 16 extends of 64 1.03x.
constexpr int kL1Ahead = 3, kL2Ahead = 5;
inline void block_rows(const uint16_t* kh, const uint16_t* vh, const int64_t* srow, int64_t kb,
                       int nk, int64_t k1, int64_t D, const uint16_t** krow,
                       const uint16_t** vrow, bool runs = false) {
  row_ptrs(kh, vh, srow, kb, nk, D, krow, vrow);
  prefetch_rows<3>(kh, vh, srow, kb + kL1Ahead * KB, std::min(kb + (kL1Ahead + 1) * KB, k1), D,
                   runs);
  prefetch_rows<1>(kh, vh, srow, kb + kL2Ahead * KB, std::min(kb + (kL2Ahead + 1) * KB, k1), D,
                   runs);
}

// The first keys of the item a thread runs next (its first kL2Ahead blocks): their K and V rows
// prefetched into L2 a few at a time while it runs this one (an item's own prefetch asks only
// for blocks kL1Ahead and kL2Ahead ahead of the one it loads, so its first blocks would wait on
// memory). 64 decode requests (8 groups of a 1,024-key shared prefix, 80 keys each of their
// own) over 30 layers' pools from memory, when an item's own prefetch went 2 and 3 blocks
// ahead: 35.9 -> 33.2 ms per step with two blocks (one 33.8-34.3, four 34.2-35.8); with 3 and
// 5, kL2Ahead blocks (see block_rows).
struct Ahead {
  const uint16_t *kh = nullptr, *vh = nullptr;
  const int64_t* srow = nullptr;
  int64_t j = 0, k1 = 0, D = 0;
  bool runs = false;  // (prefetch_rows)
  void keys(int64_t n) {  // the next n keys' rows
    const int64_t e = std::min(k1, j + n);
    prefetch_rows<1>(kh, vh, srow, j, e, D, runs);
    j = e;
  }
};

#endif

#if MINISGL_FAST

using minisgl_vec::exp16;
using minisgl_vec::exp2_16;

// 16 x 16 transpose of 32-bit words, in place.
__attribute__((always_inline)) inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // r[4a + b] now holds, in each 128-bit lane L, words b of rows 4a..4a+3 from column block L.
  for (int i = 0; i < 4; ++i) {  // gather the four 128-bit lanes of rows 0-3, 4-7, ... per column
    __m512i a0 = _mm512_shuffle_i32x4(r[i], r[4 + i], 0x88);       // lanes 0,2 of each
    __m512i a1 = _mm512_shuffle_i32x4(r[i], r[4 + i], 0xdd);       // lanes 1,3
    __m512i b0 = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0x88);
    __m512i b1 = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0xdd);
    t[i] = _mm512_shuffle_i32x4(a0, b0, 0x88);       // column i      (lane 0 of each)
    t[8 + i] = _mm512_shuffle_i32x4(a0, b0, 0xdd);   // column 8 + i  (lane 2)
    t[4 + i] = _mm512_shuffle_i32x4(a1, b1, 0x88);   // column 4 + i  (lane 1)
    t[12 + i] = _mm512_shuffle_i32x4(a1, b1, 0xdd);  // column 12 + i (lane 3)
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// Scores of NR rows against one key block: out[r] lane j = q_r . k_j (float32). A decode item
// has only G rows (3 for SmolLM2), so each row's sum over the pairs runs in U independent chains
// (a vdpbf16ps waits for the previous one on the same accumulator): 32 x 300-key decode on
// pages in runs, 30 layers, 1.06x (KV from DRAM) to 1.15x (from cache) with U = 4 vs 1.
template <int NR>
inline void qk_rows(const int32_t* const* q, const __m512i* kt, int64_t P, __m512* out) {
  constexpr int U = NR <= 4 ? 4 : NR <= 8 ? 2 : 1;  // independent chains per row (latency)
  __m512 acc[NR][U];
  for (int r = 0; r < NR; ++r)
    for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P; p += U) {  // P = D / 2 is a multiple of 16
    for (int u = 0; u < U; ++u) {
      __m512bh k = (__m512bh)kt[p + u];
      for (int r = 0; r < NR; ++r)
        acc[r][u] = _mm512_dpbf16_ps(acc[r][u], (__m512bh)_mm512_set1_epi32(q[r][p + u]), k);
    }
  }
  for (int r = 0; r < NR; ++r) {
    __m512 t = acc[r][0];
    for (int u = 1; u < U; ++u) t = _mm512_add_ps(t, acc[r][u]);
    out[r] = t;
  }
}

// fn(std::integral_constant<int, nr>{}) for nr in 1 .. 16: a row count as a template argument
// (the register tiles of qk_rows and qk16_rows)
template <class Fn>
inline void with_rows(int nr, const Fn& fn) {
  switch (nr) {
#define MINISGL_CASE(n) \
  case n:               \
    return fn(std::integral_constant<int, n>{});
    MINISGL_CASE(1) MINISGL_CASE(2) MINISGL_CASE(3) MINISGL_CASE(4) MINISGL_CASE(5)
    MINISGL_CASE(6) MINISGL_CASE(7) MINISGL_CASE(8) MINISGL_CASE(9) MINISGL_CASE(10)
    MINISGL_CASE(11) MINISGL_CASE(12) MINISGL_CASE(13) MINISGL_CASE(14) MINISGL_CASE(15)
    MINISGL_CASE(16)
#undef MINISGL_CASE
  }
}

inline void qk_dispatch(int nr, const int32_t* const* q, const __m512i* kt, int64_t P, __m512* out) {
  with_rows(nr, [&](auto n) { qk_rows<decltype(n)::value>(q, kt, P, out); });
}

// Scores of NR rows against one key block of an int8 pool as integers: out[r] lane j = q_r .
// k_j, q_r the row's query quantized to int16 (q2[r][p]: dims 2p, 2p + 1), k_j's int8 values
// as load_k16 left them (kt, P = D / 2 pairs), by vpdpwssd (as many products per instruction as
// vdpbf16ps; |sums| < D x 127 x 32767 < 2^31). Chains as in qk_rows.
template <int NR>
inline void qk16_rows(const int32_t* const* q2, const __m512i* kt, int64_t P, __m512i* out) {
  constexpr int U = NR <= 4 ? 4 : NR <= 8 ? 2 : 1;
  __m512i acc[NR][U];
  for (int r = 0; r < NR; ++r)
    for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_si512();
  for (int64_t p = 0; p < P; p += U)
    for (int u = 0; u < U; ++u)
      for (int r = 0; r < NR; ++r)
        acc[r][u] = _mm512_dpwssd_epi32(acc[r][u], _mm512_set1_epi32(q2[r][p + u]), kt[p + u]);
  for (int r = 0; r < NR; ++r) {
    __m512i t = acc[r][0];
    for (int u = 1; u < U; ++u) t = _mm512_add_epi32(t, acc[r][u]);
    out[r] = t;
  }
}

inline void qk16_dispatch(int nr, const int32_t* const* q2, const __m512i* kt, int64_t P,
                          __m512i* out) {
  with_rows(nr, [&](auto n) { qk16_rows<decltype(n)::value>(q2, kt, P, out); });
}

// A query row (D bf16) as int16 pairs for qk16_rows, round(q x 32767 / max|q|) (relative error
// 2^-16 of the row's largest value, finer than its bf16 values), and the scale max|q| / 32767.
inline void quantize_query(const c10::BFloat16* q, int64_t D, int32_t* q2, float& scale) {
  auto load = [&](int64_t d) {  // 16 bf16 as float32
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + d));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  };
  __m512 amax = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load(d)));
  const float mx = _mm512_reduce_max_ps(amax);
  scale = mx / 32767.f;
  const __m512 inv = _mm512_set1_ps(mx > 0.f ? 32767.f / mx : 0.f);
  for (int64_t d = 0; d < D; d += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<int16_t*>(q2) + d),
                        _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(load(d), inv))));
}

// V rows of a block in key pairs: vp[jp * (D / 16) + z] holds (v_2jp, v_2jp+1) interleaved for
// 16 dims (null rows, past the block's end, as zeros).
// q8: the rows are an int8 pool's; their values (integers, exact in bf16) are widened, their
// scales left to the caller (folded into P: run_item).
template <bool q8 = false>
inline void pair_rows(const uint16_t* const* vrow, int64_t D, __m512i* vp) {
  const int64_t Z = D / 16;
  const __m512i zero = _mm512_setzero_si512();
  auto chunk = [&](const uint16_t* row, int64_t c) {  // dims 32c .. 32c + 31 as bf16
    if (row == nullptr) return zero;
    if constexpr (!q8) {
      return _mm512_loadu_si512(row + c * 32);
    } else {
      const auto* x =
          reinterpret_cast<const __m128i*>(reinterpret_cast<const int8_t*>(row) + c * 32);
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(x)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(x + 1)));
      return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    }
  };
  for (int jp = 0; jp < KB / 2; ++jp) {
    for (int64_t c = 0; c < D / 32; ++c) {
      const __m512i a = chunk(vrow[2 * jp], c), b = chunk(vrow[2 * jp + 1], c);
      vp[jp * Z + 2 * c] = _mm512_unpacklo_epi16(a, b);
      vp[jp * Z + 2 * c + 1] = _mm512_unpackhi_epi16(a, b);
    }
  }
}

// The scales of an int8 pool's rows (D values, then a float32): out[j], 0 for null rows.
inline void row_scales(const uint16_t* const* rows, int64_t D, float* out) {
  for (int j = 0; j < KB; ++j) out[j] = rows[j] != nullptr ? record_scale(rows[j], D) : 0.f;
}

// An int8 pool row (D values, then the row's float32 scale) as D bf16 values, value x scale
// rounded as KVPool.read rounds it (to nearest even): int8 -> int32 -> float32, 16 at a time.
inline void dequant_row(const uint16_t* row, int64_t D, uint16_t* out) {
  const auto* x = reinterpret_cast<const int8_t*>(row);
  const __m512 vs = _mm512_set1_ps(record_scale(row, D));
  auto widen = [&](int64_t c) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + c));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), vs);
  };
  for (int64_t c = 0; c < D; c += 32)
    _mm512_storeu_si512(out + c, (__m512i)_mm512_cvtne2ps_pbh(widen(c + 16), widen(c)));
}

// The block's K for the per-row rows from an int8 pool: its rows' int8 values widened to int16
// and transposed as kt is for bf16 (kt[p] lane j = dims (2p, 2p + 1) of key j, an int16 pair;
// rows past nk as zeros), and the keys' scales ks[j] (0 past nk).
inline void load_k16(const uint16_t* const* kr, int nk, int64_t D, __m512i* kt, float* ks) {
  for (int64_t c = 0; c < D / 32; ++c) {
    __m512i* t = kt + c * 16;
    for (int j = 0; j < KB; ++j)
      t[j] = j < nk ? _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                          reinterpret_cast<const char*>(kr[j]) + c * 32)))
                    : _mm512_setzero_si512();
    transpose16(t);
  }
  row_scales(kr, D, ks);
}

// The block of keys kb .. kb + 15 (fewer at k1) loaded for the products: K transposed (when kt
// is given; the per-row steps' operand), kt[p] lane j = dims (2p, 2p+1) of key j; V in key pairs
// (pair_rows); keys past the block's end as zeros. krow: the block's K rows (a row of zeros past
// its end). Returns its keys.
//
// An int8 pool (q8; rows pool_row(D, true) uint16 apart, D values then a float32 scale): V's
// values are paired as they are (integers, exact in bf16) and vs gets the rows' scales (P
// takes them: run_item); for the per-row rows kt is load_k16's int16 operand (scores by
// vpdpwssd against int16 queries, scaled after) and ks the keys' scales; for lane groups, K rows
// are widened to bf16 (value x scale) into kstage (given where the item has lane groups: 16
// rows of D, consecutive, which qk_lanes takes at fixed offsets wherever the pool's rows lie)
// and krow points there.
inline int load_block(const uint16_t* kh, const uint16_t* vh, const int64_t* srow, int64_t kb,
                      int64_t k1, int64_t D, __m512i* kt, __m512i* vp,
                      const uint16_t** krow = nullptr, bool q8 = false,
                      uint16_t* kstage = nullptr, float* ks = nullptr, float* vs = nullptr) {
  static const uint16_t zeros[MAXD] = {};
  const int nk = static_cast<int>(std::min<int64_t>(KB, k1 - kb));
  const __m512i zero = _mm512_setzero_si512();
  const uint16_t* kr[KB];
  const uint16_t* vrow[KB];
  block_rows(kh, vh, srow, kb, nk, k1, pool_row(D, q8), kr, vrow, q8);
  if (q8) {
    pair_rows<true>(vrow, D, vp);
    row_scales(vrow, D, vs);
    if (kt != nullptr) load_k16(kr, nk, D, kt, ks);
    for (int j = 0; j < KB; ++j) {
      if (kstage != nullptr && j < nk) dequant_row(kr[j], D, kstage + j * D);
      kr[j] = kstage != nullptr && j < nk ? kstage + j * D : nullptr;
    }
  }
  if (krow != nullptr)
    for (int j = 0; j < KB; ++j) krow[j] = kr[j] ? kr[j] : zeros;
  if (q8) return nk;
  for (int64_t c = 0; kt != nullptr && c < D / 32; ++c) {
    __m512i* t = kt + c * 16;
    for (int j = 0; j < KB; ++j) t[j] = kr[j] ? _mm512_loadu_si512(kr[j] + c * 32) : zero;
    transpose16(t);
  }
  pair_rows(vrow, D, vp);
  return nk;
}

// The lanes [hidden, visible) of a block as a mask.
inline __mmask16 lane_mask(int64_t hidden, int64_t visible) {
  return static_cast<__mmask16>(((1u << visible) - 1) & ~((1u << hidden) - 1));
}

// Rows of an item in groups of 16 take qk_lanes, lane_softmax and lane_pv; a last group of
// fewer than this many rows (a decode item's G rows, or 8 of a shared prefix's 24) takes the
// per-row steps, whose cost grows with its rows rather than with the block's 16 lanes. Against
// the per-row steps for every row (AMD Zen 4, one thread, SmolLM2's heads, alternating
// processes): a 1,024-token prefill's attention 11.0 -> 8.4-8.8 ms, 16 extends of 64 tokens on
// 1,088 keys 22.0 -> 17.9-18.1 ms; 64 decode queries in 8 groups on a shared 1,024-token prefix
// 1.82-2.03 ms with a last group of 8 in lanes, 1.69-1.71 per row (docs/benchmarks.md). Since
// the per-row softmax keeps a lazy reference (run_item), 64 decode queries in groups of 4 on a
// shared prefix (12 rows) run 1.05-1.08x faster per row than in lanes, in groups of 5 (15
// rows) 1.07-1.11x slower (two builds alternating in one process, KV in cache and from DRAM).
constexpr int kLaneRows = 13;
constexpr float kLaneLazy = 8.f;  // see lane_softmax
constexpr int kLaneSteps = 4;     // key blocks per lane_pv call (run_item)

// The online-softmax step of 16 rows against one key block with the rows in lanes: st[j] lane
// rr is row rr's score for key kb + j (qk_lanes' result), so the running max, the sum and the
// rescale factor take one vector op per key for the 16 rows, where the per-row steps take a
// few per row and block (rows seeing keys [low, lim), lanes outside `act` none). P
// goes to pt in key pairs, pt[jp] lane rr = (p of keys 2jp and 2jp + 1) in bf16, the operand of
// lane_pv; where a row's reference max moves (below), its lane of OT (O transposed, D vectors)
// is rescaled, after `flush()` has added the P V that waits (P against the old reference). In
// base 2, as on tiles: scale2 = scale x log2 e, m in those units (run_item turns a lane row's m
// back into natural units at the end), p = 2^(y - m) by exp2_16's 5 ops. vs (an int8 pool's
// V scales, else null): pt holds p x vs[j] for key j, the sums p alone.
template <typename Flush>
inline void lane_softmax(__m512* st, int nk, int64_t kb, const int32_t* low, const int32_t* lim,
                         bool all_see, __mmask16 act, float scale2, float* m, float* l, float* OT,
                         int64_t D, __m512i* pt, const float* vs, Flush&& flush) {
  const __m512 neg_inf = _mm512_set1_ps(NEG_INF);
  const __m512i lowv = _mm512_loadu_si512(low), limv = _mm512_loadu_si512(lim);
  const __m512 old = _mm512_mask_loadu_ps(neg_inf, act, m), vscale = _mm512_set1_ps(scale2);
  // every lane sees every key (prefill and extend away from the diagonal, a shared prefix's
  // decode rows, no padding lane): no masks
  const bool full = all_see && act == 0xFFFF;
  __mmask16 vis[KB];
  __m512 raw = neg_inf;  // the block's max score per row (scale > 0: the max of y too)
  for (int j = 0; j < nk; ++j) {
    const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(kb + j));
    vis[j] = all_see ? act
                     : _mm512_mask_cmpgt_epi32_mask(_mm512_cmpge_epi32_mask(key, lowv), limv, key);
    raw = _mm512_max_ps(raw, full ? st[j] : _mm512_mask_mov_ps(neg_inf, vis[j], st[j]));
  }
  const __m512 mx = _mm512_max_ps(old, _mm512_mul_ps(raw, vscale));
  // The reference each row's p are taken against (m) moves to the row's max only where that
  // passes it by more than kLaneLazy (p up to 2^8: exact enough in bf16, and a float32 sum of
  // them cannot overflow), or on the row's first keys; only there are l and OT rescaled. Rows
  // that have seen no key keep -inf, and 0 is subtracted there (their p are masked to 0, as
  // are the lanes a row does not see, whose 2^(y - ref) may be anything).
  const __mmask16 first = act & _mm512_cmp_ps_mask(old, neg_inf, _CMP_EQ_OQ);
  const __mmask16 up = _mm512_mask_cmp_ps_mask(
      act & ~first, mx, _mm512_add_ps(old, _mm512_set1_ps(kLaneLazy)), _CMP_GT_OQ);
  const __mmask16 seen = (first & _mm512_cmp_ps_mask(mx, neg_inf, _CMP_NEQ_OQ)) | (act & ~first);
  const __m512 ref = _mm512_mask_mov_ps(old, up | first, mx);
  const __m512 base = _mm512_maskz_mov_ps(seen, ref);
  for (int j = 0; j < nk; ++j) {  // y - ref in one FMA
    const __m512 p = exp2_16(_mm512_fmsub_ps(st[j], vscale, base));
    st[j] = full ? p : _mm512_maskz_mov_ps(vis[j], p);
  }
  for (int j = nk; j < KB; ++j) st[j] = _mm512_setzero_ps();
  // P in key pairs, rounded to bf16 as P V takes them, and the rows' sums of those p: a dot
  // product of each pair with (1, 1) (products exact), one instruction per pair of keys instead
  // of a conversion back to float32 and an add per key
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  const __m512bh ones = (__m512bh)_mm512_set1_epi32(0x3F803F80);
  __m512 sums[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int jp = 0; jp < KB / 2; ++jp) {
    pt[jp] = _mm512_permutexvar_epi16(
        pairs, (__m512i)_mm512_cvtne2ps_pbh(st[2 * jp + 1], st[2 * jp]));
    sums[jp % 2] = _mm512_dpbf16_ps(sums[jp % 2], (__m512bh)pt[jp], ones);
  }
  for (int jp = 0; vs != nullptr && jp < KB / 2; ++jp)
    pt[jp] = _mm512_permutexvar_epi16(
        pairs, (__m512i)_mm512_cvtne2ps_pbh(
                   _mm512_mul_ps(st[2 * jp + 1], _mm512_set1_ps(vs[2 * jp + 1])),
                   _mm512_mul_ps(st[2 * jp], _mm512_set1_ps(vs[2 * jp]))));
  const __m512 sum = _mm512_add_ps(sums[0], sums[1]);
  _mm512_mask_storeu_ps(m, act, ref);
  if (up) {  // 2^(old - ref) where the reference moved (l and OT are 0 on a row's first keys)
    flush();
    const __m512 corr = _mm512_mask_mov_ps(_mm512_set1_ps(1.f), up,
                                           exp2_16(_mm512_sub_ps(old, base)));
    _mm512_mask_storeu_ps(l, act, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(act, l), corr, sum));
    for (int64_t i = 0; i < D; ++i)
      _mm512_storeu_ps(OT + i * 16, _mm512_mul_ps(_mm512_loadu_ps(OT + i * 16), corr));
  } else {
    _mm512_mask_storeu_ps(l, act, _mm512_add_ps(_mm512_maskz_loadu_ps(act, l), sum));
  }
}

// OT += (P V)^T for 16 rows in lanes over np key pairs (np / 8 blocks, their pt and vp one
// after the other): OT[i] (dim i in vp's order) gets pt[jp] times key pair jp's dim i,
// broadcast. 16 dims at a time, so 16 independent accumulators take each pair's steps (the
// per-row product chains 8 steps through two accumulators per 16 dims), loaded and stored once
// per call: run_item calls it once per step of up to kLaneSteps blocks.
inline void lane_pv(const __m512i* pt, const __m512i* vp, int64_t D, float* OT, int np) {
  const int64_t Z = D / 16;
  for (int64_t z = 0; z < Z; ++z) {
    __m512 acc[16];
    float* ot = OT + z * 256;
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_loadu_ps(ot + i * 16);
    for (int jp = 0; jp < np; ++jp) {
      const int32_t* w = reinterpret_cast<const int32_t*>(vp + jp * Z + z);
      const __m512bh p = (__m512bh)pt[jp];
      for (int i = 0; i < 16; ++i)
        acc[i] = _mm512_dpbf16_ps(acc[i], p, (__m512bh)_mm512_set1_epi32(w[i]));
    }
    for (int i = 0; i < 16; ++i) _mm512_storeu_ps(ot + i * 16, acc[i]);
  }
}

// The scores of a lane group against one key block, rows in lanes: out[j] lane rr = q_rr . k_j,
// from the group's queries transposed (qt[p] lane rr = row rr's dims (2p, 2p + 1), zeros for
// padding rows) and the block's K rows as they lie in the pool, a pair of dims broadcast at a
// time. No transpose of K nor of the scores. A whole block's 16 keys go at once: 16 independent
// sums, where 8 left a core that issues two vdpbf16ps per cycle (AMD Zen 5; latency 6 cycles)
// waiting on them (a loop of 8 chains 5.6 G instructions/s, of 16 chains 8.4 G). Where the
// block's rows are consecutive in the pool (16 slots of a page, the usual case) and D is 64 or
// 128, its K is one array at offsets the compiler knows, so that the 16 rows' addresses take no
// registers (through 16 pointers GCC kept half of them in vector registers and moved them back
// per use). Prefill attention, 8,000 tokens, SmolLM2's heads (Zen 5, 2 threads, processes
// alternating): 8 chains 575-580 GFLOP/s, 16 through pointers 596-616, 16 at fixed offsets
// 636-647; at 4,096 tokens 566-578 / 579-593 / 572-644 (16 and 8 heads of 128: 559 -> 622-649).
template <int NK>
inline void qk_lanes_n(const __m512i* qt, const uint16_t* const* krow, int64_t P, __m512* out) {
  __m512 acc[NK];
  for (int i = 0; i < NK; ++i) acc[i] = _mm512_setzero_ps();
  const int32_t* kr[NK];
  for (int i = 0; i < NK; ++i) kr[i] = reinterpret_cast<const int32_t*>(krow[i]);
  for (int64_t p = 0; p < P; ++p) {
    const __m512bh qv = (__m512bh)qt[p];
    for (int i = 0; i < NK; ++i)
      acc[i] = _mm512_dpbf16_ps(acc[i], qv, (__m512bh)_mm512_set1_epi32(kr[i][p]));
  }
  for (int i = 0; i < NK; ++i) out[i] = acc[i];
}

// ... for a block of KB consecutive K rows from kr (P pairs each)
template <int P>
inline void qk_lanes_at(const __m512i* qt, const int32_t* kr, __m512* out) {
  __m512 acc[KB];
  for (int i = 0; i < KB; ++i) acc[i] = _mm512_setzero_ps();
  for (int p = 0; p < P; ++p) {
    const __m512bh qv = (__m512bh)qt[p];
    for (int i = 0; i < KB; ++i)
      acc[i] = _mm512_dpbf16_ps(acc[i], qv, (__m512bh)_mm512_set1_epi32(kr[i * P + p]));
  }
  for (int i = 0; i < KB; ++i) out[i] = acc[i];
}

inline void qk_lanes(const __m512i* qt, const uint16_t* const* krow, int nk, int64_t P,
                     __m512* out) {
  bool consecutive = nk == KB && (P == 32 || P == 64);
  for (int j = 1; consecutive && j < KB; ++j) consecutive = krow[j] == krow[0] + j * 2 * P;
  if (consecutive) {
    const int32_t* kr = reinterpret_cast<const int32_t*>(krow[0]);
    return P == 32 ? qk_lanes_at<32>(qt, kr, out) : qk_lanes_at<64>(qt, kr, out);
  }
  if (nk > 8) return qk_lanes_n<KB>(qt, krow, P, out);
  qk_lanes_n<8>(qt, krow, P, out);  // a block's last keys (the rest of krow are rows of zeros)
  for (int i = 8; i < KB; ++i) out[i] = _mm512_setzero_ps();
}

// The per-row steps' (run_item's and run_decode's) pieces for one row and one key block.
// A row's scores over an int8 pool: its integer sums times the keys' scales and its query's.
inline __m512 int8_scores(__m512i sums, __m512 kscale, float qscale) {
  return _mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(kscale, _mm512_set1_ps(qscale)));
}

// The online softmax of a row's scores y (in base 2) on the lanes it sees (mask), as
// lane_softmax: its reference `ref` moves only on the row's first keys or where a score passes
// it by more than kLaneLazy, and only then are its sums and O rescaled, by rescale(2^(old -
// new)); the sums stay by lane: no horizontal max nor sum per block. p = 2^(y - ref), 0 on the
// lanes it does not see.
template <class Rescale>
__attribute__((always_inline)) inline __m512 row_softmax(__m512 y, __mmask16 mask, float& ref,
                                                         const Rescale& rescale) {
  if (ref == NEG_INF ||
      _mm512_mask_cmp_ps_mask(mask, y, _mm512_set1_ps(ref + kLaneLazy), _CMP_GT_OQ)) {
    const float mx = _mm512_mask_reduce_max_ps(mask, y);
    if (ref != NEG_INF) rescale(exp2_16(_mm512_set1_ps(ref - mx)));
    ref = mx;
  }
  return _mm512_maskz_mov_ps(mask, exp2_16(_mm512_sub_ps(y, _mm512_set1_ps(ref))));
}

// p as P V takes it, 16 bf16 at pb: times V's scales over an int8 pool (vs; null for bf16).
inline void store_p(__m512 p, const float* vs, void* pb) {
  const __m512 pv = vs != nullptr ? _mm512_mul_ps(p, _mm512_load_ps(vs)) : p;
  _mm256_storeu_si256(static_cast<__m256i*>(pb), (__m256i)_mm512_cvtneps_pbh(pv));
}

// A decode item (one query: G <= 4 rows, its heads), D = 64 or 128, on a bf16 or (Q8) an int8
// pool: run_item's per-row steps, with O, the sums of p and the references in registers from the
// item's first key block to its last, where run_item keeps them in memory for any number of rows
// and runs a block's steps in a lambda. The same arithmetic in the same order: on bf16 pools the
// outputs are run_item's bit for bit (160 random decode batches); on int8 pools all but a few in
// 10,000, one bf16 rounding apart (-ffast-math lets the compiler order a score's two scale
// products differently). Measured (AMD Zen 5, 2 threads, SmolLM2's heads, 30 layers' pools from
// DRAM, alternating processes), us per layer: bf16 1 request x 4,000 keys 91-109 -> 73-81, 4 x
// 1,000 87-110 -> 72-77, 16 x 400 160-181 -> 133-152, 64 x 300 480-496 -> 453-475; int8 1 x
// 4,000 112-118 -> 65-69, 16 x 1,000 319-344 -> 259-267, 64 x 300 404-448 -> 360-386 (now
// 0.71-0.86x bf16's time: half the bytes). A bf16 decode step (the two alternating in one
// process): 1 x 4,000 keys 9.25 -> 8.45 ms, 16 x 1,000 18.80 -> 17.68, 32 x 600 22.30 -> 21.47,
// 1 x 400 0.99x. What gains is the steps' shape known at compile time, in one loop: O loaded and
// stored per block instead of kept in registers measured the same. Tried: two or four blocks
// per step (their scores before the softmax, for overlap): no faster than one; load_block and
// block_rows inlined here, or compiled for the known D (a function of its own): 10-15% faster
// from cache, 10-40% slower from DRAM (the prefetches' timing, presumably; not found).
template <int G, int D, bool Q8>
void run_decode(const Item& it, const int32_t* const* qrow, const uint16_t* kh,
                const uint16_t* vh, const int64_t* srow, int64_t low, float scale2, float* O,
                float* m, float* l, Ahead& ahead, int64_t per) {
  constexpr int P = D / 2, Z = D / 16;
  alignas(64) __m512i kt[P];
  alignas(64) __m512i vp[KB / 2 * Z];
  alignas(64) int32_t pb[G][KB / 2];  // each row's P in key pairs, bf16
  // an int8 pool's: the queries as int16 pairs and their scales, a block's K and V scales
  alignas(64) int32_t q2[Q8 ? G : 1][P];
  alignas(64) float ks[KB], vs[KB];
  float qscale[G];
  const int32_t* q2row[G];
  for (int r = 0; Q8 && r < G; ++r) {
    quantize_query(reinterpret_cast<const c10::BFloat16*>(qrow[r]), D, q2[r], qscale[r]);
    q2row[r] = q2[r];
  }
  __m512 o[G][Z], sums[G];
  float ref[G];
  for (int r = 0; r < G; ++r) {
    for (int z = 0; z < Z; ++z) o[r][z] = _mm512_setzero_ps();
    sums[r] = _mm512_setzero_ps();
    ref[r] = NEG_INF;
  }
  const __m512 vscale = _mm512_set1_ps(scale2);
  for (int64_t kb = it.k0; kb < it.k1; kb += KB) {
    const int nk = load_block(kh, vh, srow, kb, it.k1, D, kt, vp, nullptr, Q8, nullptr, ks, vs);
    ahead.keys(per);
    int64_t hidden, visible;
    if (!row_lanes(low, it.k1, kb, nk, hidden, visible)) continue;  // (before a window)
    const __mmask16 mask = lane_mask(hidden, visible);
    __m512 s[G];
    if constexpr (Q8) {  // integer sums times both scales
      __m512i si[G];
      qk16_rows<G>(q2row, kt, P, si);
      const __m512 kv = _mm512_load_ps(ks);
      for (int r = 0; r < G; ++r) s[r] = int8_scores(si[r], kv, qscale[r]);
    } else {
      qk_rows<G>(qrow, kt, P, s);
    }
    for (int r = 0; r < G; ++r) {
      const __m512 p = row_softmax(_mm512_mul_ps(s[r], vscale), mask, ref[r], [&](__m512 corr) {
        sums[r] = _mm512_mul_ps(sums[r], corr);
        for (int z = 0; z < Z; ++z) o[r][z] = _mm512_mul_ps(o[r][z], corr);
      });
      sums[r] = _mm512_add_ps(sums[r], p);
      store_p(p, Q8 ? vs : nullptr, pb[r]);
    }
    for (int z = 0; z < Z; ++z)
      for (int r = 0; r < G; ++r) {
        __m512 even = o[r][z], odd = _mm512_setzero_ps();
        for (int jp = 0; jp < KB / 2; jp += 2) {
          even = _mm512_dpbf16_ps(even, (__m512bh)_mm512_set1_epi32(pb[r][jp]),
                                  (__m512bh)vp[jp * Z + z]);
          odd = _mm512_dpbf16_ps(odd, (__m512bh)_mm512_set1_epi32(pb[r][jp + 1]),
                                 (__m512bh)vp[(jp + 1) * Z + z]);
        }
        o[r][z] = _mm512_add_ps(even, odd);
      }
  }
  for (int r = 0; r < G; ++r) {
    for (int z = 0; z < Z; ++z) _mm512_storeu_ps(O + r * D + z * 16, o[r][z]);
    l[r] = _mm512_reduce_add_ps(sums[r]);
    m[r] = ref[r] * std::numbers::ln2_v<float>;
  }
}

// One work item. O is float32 [R, D] in the "pair" order of the PV product: within each 32 dims,
// the first 16 floats are dims {8l + i : l < 4, i < 4} and the next 16 dims {8l + 4 + i}.
// `lanes`: O has room for R rounded up to 16 rows (not a decode request's split-K part).
void run_item(const Item& it, const c10::BFloat16* q, const c10::BFloat16* k,
              const c10::BFloat16* v, const int64_t* slots, int64_t Lk, int64_t prefix,
              int64_t qrow0, const int64_t* members, const int64_t* q_start, int64_t H,
              int64_t S, int64_t G, int64_t D, float scale, int64_t window, float* O, float* m,
              float* l, Ahead& ahead, bool lanes, bool q8) {
  const int64_t R = it.nq * G, P = D / 2, Z = D / 16;
  const int64_t Dr = pool_row(D, q8);
  const float scale2 = scale * minisgl_vec::kLog2e;  // the lane rows' softmax is in base 2
  constexpr int MR = QB * 8;  // rows of an item at most
  struct Scratch {
    alignas(64) __m512i kt[MAXD / 2];
    alignas(64) __m512i vp[kLaneSteps * KB / 2 * MAXD / 16];  // a step's blocks, one by one
    alignas(64) uint16_t pb[MR][KB];                  // P of each per-row row, bf16
    alignas(64) __m512i pt[kLaneSteps * KB / 2];      // P of a row group (lane_softmax)
    alignas(64) int32_t low32[MR], lim32[MR];
    alignas(64) int32_t qt[MR / 16][MAXD / 2][16];  // lane groups' queries (qk_lanes)
    alignas(64) float ot[MAXD * 16];                 // a lane group's OT, copied at the end
    alignas(64) float lsum[MR][16];                  // per-row rows' sums of p, by lane
    // int8 pools (load_block): a step's K widened for the lane groups; the per-row rows' queries
    // as int16 pairs and their scales (quantize_query); a block's key scales
    alignas(64) uint16_t kstage[kLaneSteps][KB * MAXD];
    alignas(64) int32_t q2[MR][MAXD / 2];
    alignas(64) float kscale[KB], vscale[kLaneSteps][KB];
    float qscale[MR];
    const int32_t* q2row[MR];
    std::vector<const int32_t*> qrow;
    std::vector<int64_t> qoff, lim, low;
  };
  static thread_local Scratch scratch;
  auto& [kt, vp, pb, pt, low32, lim32, qt, ot, lsum, kstage, q2, kscale, vscale, qscale, q2row,
         qrow, qoff, lim, low] = *minisgl::opaque(&scratch);
  qrow.resize(R);
  qoff.resize(R);
  lim.resize(R);
  low.resize(R);
  item_rows(it, prefix, qrow0, members, q_start, H, G, D, window, qoff.data(), lim.data(),
            low.data(), m, l);
  for (int64_t r = 0; r < R; ++r) qrow[r] = reinterpret_cast<const int32_t*>(q + qoff[r]);
  const int64_t blocks = std::max<int64_t>(1, (it.k1 - it.k0 + KB - 1) / KB);  // (0 keys: none)
  const int64_t per = (ahead.k1 - ahead.j + blocks - 1) / blocks;
  const int64_t* srow = slots + it.b * Lk;
  const uint16_t* kh = reinterpret_cast<const uint16_t*>(k) + it.h * S * Dr;
  const uint16_t* vh = reinterpret_cast<const uint16_t*>(v) + it.h * S * Dr;
  if (it.nq == 1 && it.mn == 0 && R <= 4 && (D == 64 || D == 128)) {  // a decode item
    using Fn = decltype(&run_decode<1, 64, false>);
    static constexpr Fn kDecode[2][2][4] = {
        {{&run_decode<1, 64, false>, &run_decode<2, 64, false>, &run_decode<3, 64, false>,
          &run_decode<4, 64, false>},
         {&run_decode<1, 128, false>, &run_decode<2, 128, false>, &run_decode<3, 128, false>,
          &run_decode<4, 128, false>}},
        {{&run_decode<1, 64, true>, &run_decode<2, 64, true>, &run_decode<3, 64, true>,
          &run_decode<4, 64, true>},
         {&run_decode<1, 128, true>, &run_decode<2, 128, true>, &run_decode<3, 128, true>,
          &run_decode<4, 128, true>}}};
    kDecode[q8][D == 128][R - 1](it, qrow.data(), kh, vh, srow, low[0], scale2, O, m, l, ahead,
                                 per);
    return;
  }
  // rows [0, RL) in lane groups, OT of group g at O + 16 g D (OT[i] at + 16 i); the rest per row
  const int64_t RL = !lanes ? 0 : R % 16 == 0 || R % 16 >= kLaneRows ? R : R / 16 * 16;
  int64_t see_from[MR / 16], see_to[MR / 16];  // keys every row of a lane group sees
  for (int64_t g = 0; g * 16 < RL; ++g) {
    see_from[g] = 0;
    see_to[g] = std::numeric_limits<int64_t>::max();
    for (int64_t r = 16 * g; r < 16 * g + 16; ++r) {
      const bool real = r < R;
      low32[r] = real ? static_cast<int32_t>(low[r]) : 0;
      lim32[r] = real ? static_cast<int32_t>(lim[r]) : 0;  // a padding lane sees no key
      if (real) {
        see_from[g] = std::max(see_from[g], low[r]);
        see_to[g] = std::min(see_to[g], lim[r]);
      }
      for (int64_t p = 0; p < P; ++p) qt[g][p][r - 16 * g] = real ? qrow[r][p] : 0;
    }
  }
  std::fill(O, O + std::max(R, (RL + 15) / 16 * 16) * D, 0.f);
  std::fill(&lsum[RL][0], &lsum[R][0], 0.f);
  for (int64_t r = RL; q8 && r < R; ++r) {
    quantize_query(q + qoff[r], D, q2[r], qscale[r]);
    q2row[r] = q2[r];
  }
  // One key block for the per-row rows [RL, R), 16 at a time: its K transposed in kt, its V in
  // key pairs at vb.
  auto row_block = [&](int64_t kb, int nk, const __m512i* vb, const float* vs) {
    for (int64_t r0 = RL; r0 < R; r0 += 16) {
      const int nr = static_cast<int>(std::min<int64_t>(16, R - r0));
      __m512 s[16];
      if (q8) {  // integer sums times both scales
        __m512i si[16];
        qk16_dispatch(nr, q2row + r0, kt, P, si);
        const __m512 kv = _mm512_load_ps(kscale);
        for (int rr = 0; rr < nr; ++rr) s[rr] = int8_scores(si[rr], kv, qscale[r0 + rr]);
      } else {
        qk_dispatch(nr, qrow.data() + r0, kt, P, s);
      }
      for (int rr = 0; rr < nr; ++rr) {
        const int64_t r = r0 + rr;
        int64_t hidden, visible;
        if (!row_lanes(low[r], lim[r], kb, nk, hidden, visible)) {
          std::memset(pb[r], 0, sizeof(pb[r]));
          continue;
        }
        // (the sums by lane: l[r] at the end)
        const __m512 y = _mm512_mul_ps(s[rr], _mm512_set1_ps(scale2));
        const __m512 p = row_softmax(y, lane_mask(hidden, visible), m[r], [&](__m512 corr) {
          _mm512_store_ps(lsum[r], _mm512_mul_ps(_mm512_load_ps(lsum[r]), corr));
          for (int64_t z = 0; z < D; z += 16)
            _mm512_storeu_ps(O + r * D + z, _mm512_mul_ps(_mm512_loadu_ps(O + r * D + z), corr));
        });
        _mm512_store_ps(lsum[r], _mm512_add_ps(_mm512_load_ps(lsum[r]), p));
        store_p(p, q8 ? vs : nullptr, pb[r]);
      }
    }
    // O += P V for the per-row rows, one 16-dim slice at a time with its 8 key-pair vectors in
    // registers (two chains per row, as in qk_rows).
    for (int64_t z = 0; z < Z; ++z) {
      __m512bh w[KB / 2];
      for (int jp = 0; jp < KB / 2; ++jp) w[jp] = (__m512bh)vb[jp * Z + z];
      for (int64_t r = RL; r < R; ++r) {
        const int32_t* pr = reinterpret_cast<const int32_t*>(pb[r]);
        __m512 o = _mm512_loadu_ps(O + r * D + z * 16), o2 = _mm512_setzero_ps();
        for (int jp = 0; jp < KB / 2; jp += 2) {
          o = _mm512_dpbf16_ps(o, (__m512bh)_mm512_set1_epi32(pr[jp]), w[jp]);
          o2 = _mm512_dpbf16_ps(o2, (__m512bh)_mm512_set1_epi32(pr[jp + 1]), w[jp + 1]);
        }
        _mm512_storeu_ps(O + r * D + z * 16, _mm512_add_ps(o, o2));
      }
    }
  };
  // Steps of up to kLaneSteps key blocks: the per-row rows take each block as it is loaded; a
  // lane group then takes the step's blocks in turn and adds their P V in one lane_pv call
  // (earlier where a row's reference moves mid-step).
  for (int64_t ks = it.k0; ks < it.k1; ks += kLaneSteps * KB) {
    const uint16_t* krow[kLaneSteps][KB];
    int nks[kLaneSteps];
    int nb = 0;
    for (int64_t kb = ks; kb < std::min(it.k1, ks + kLaneSteps * KB); kb += KB, ++nb) {
      __m512i* vb = vp + nb * (KB / 2) * Z;
      const int nk = nks[nb] = load_block(kh, vh, srow, kb, it.k1, D, RL < R ? kt : nullptr, vb,
                                          krow[nb], q8, RL > 0 ? kstage[nb] : nullptr, kscale,
                                          vscale[nb]);
      ahead.keys(per);
      if (RL < R) row_block(kb, nk, vb, vscale[nb]);
    }
    for (int64_t r0 = 0; r0 < RL; r0 += 16) {
      const int64_t g = r0 / 16;
      const int nr = static_cast<int>(std::min<int64_t>(16, R - r0));
      float* OT = O + r0 * D;
      int done = 0;  // blocks of the step whose P V is in OT
      for (int b = 0; b < nb; ++b) {
        const int64_t kb = ks + b * KB;
        __m512 s[16];
        qk_lanes(reinterpret_cast<const __m512i*>(qt[g]), krow[b], nks[b], P, s);
        lane_softmax(s, nks[b], kb, low32 + r0, lim32 + r0,
                     see_from[g] <= kb && see_to[g] >= kb + nks[b],
                     static_cast<__mmask16>((1u << nr) - 1), scale2, m + r0, l + r0, OT, D,
                     pt + b * (KB / 2), q8 ? vscale[b] : nullptr, [&] {
                       if (b > done)
                         lane_pv(pt + done * (KB / 2), vp + done * (KB / 2) * Z, D, OT,
                                 (b - done) * (KB / 2));
                       done = b;
                     });
      }
      lane_pv(pt + done * (KB / 2), vp + done * (KB / 2) * Z, D, OT, (nb - done) * (KB / 2));
    }
  }
  // The per-row rows' sums, every row's m back in natural units, and the lane groups' OT back
  // to rows of O, 16 dims at a time (through a copy: in place, rows would overwrite OT not yet
  // read).
  for (int64_t r = RL; r < R; ++r) l[r] = _mm512_reduce_add_ps(_mm512_load_ps(lsum[r]));
  for (int64_t r = 0; r < R; ++r) m[r] *= std::numbers::ln2_v<float>;
  __m512 t[16];
  for (int64_t r0 = 0; r0 < RL; r0 += 16) {
    const int64_t nr = std::min<int64_t>(16, R - r0);
    float* OT = O + r0 * D;
    std::copy(OT, OT + 16 * D, ot);
    for (int64_t z = 0; z < Z; ++z) {
      for (int i = 0; i < 16; ++i) t[i] = _mm512_load_ps(ot + (z * 16 + i) * 16);
      transpose16(reinterpret_cast<__m512i*>(t));
      for (int64_t rr = 0; rr < nr; ++rr) _mm512_storeu_ps(OT + rr * D + z * 16, t[rr]);
    }
  }
}

#if MINISGL_ATTN_AMX
// Items of 16 rows or more (prefill, extend, a shared prefix's decode queries) on AMX tiles,
// 16 rows (a row tile) at a time and 4 key blocks (64 keys) per softmax step. Every tile is 16
// rows of 64 bytes. Both products come transposed, so that the softmax runs lane-wise, a lane
// per row, with no horizontal reductions, no per-row exp and no transpose of P:
// - S^T = K Q^T: a block's 16 keys are a tile's rows as they lie in the pool (a page holds 16
//   consecutive slots; a block whose slots are not consecutive is copied into 16 rows first),
//   against the item's queries transposed once per item into bf16 pairs (qt);
// - O^T += V^T P^T: P^T in key pairs is what the softmax makes, a vector per pair of keys (16
//   rows' pairs as 32-bit lanes); V^T (D rows of 32 keys per pair of blocks) is built once per
//   distinct block for a prefill or extend batch (Blocks), else once per item.
// The 16 rows' running max, sum and rescale factor are one vector each. A row tile runs all
// its steps before the next: for D = 64 its O^T stays in 4 accumulator tiles (else it goes
// through memory, 64 dims per pass). A row's p are taken against a reference max, with no pass
// for the step's max, as long as no row's p overflow or sum past 2^kBig; else the step runs
// again after a pass for its max, which moves the reference only where the max passes it by
// more than kLazy (log2 units), and only then is O rescaled (out of the tiles and back). P
// need no bound for its bf16 rounding (relative) nor for O^T and the sums (float32, 2^128),
// so the reference moves a few times per row tile at most. O^T goes back to rows at the end
// (in pair_rows' order of dims, as run_item's O); O needs room for R rounded up to 16 rows. m
// is the reference max, l and O are in its terms.
constexpr int SB = 4;  // key blocks per step (even: P V takes them two by two)
constexpr int ZT = 4;  // O^T's accumulator tiles: 16 dims each, D / 16 of them in D / 64 passes
constexpr float kLazy = 8.f;  // how far (log2 units) a row's max may pass its reference
constexpr float kBig = 0x1p64f;  // a row's sum of p in a step that runs again (see above)

// Tiles 0-3: O^T; 4, 5: scores of two blocks, then P^T (4); 6: Q^T; 7: K; 6, 7: V^T.
inline void attn_tiles_begin() {
  minisgl::TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

// Runs X(n) for tile n = t of the 4 O^T tiles (the tile intrinsics take literal numbers).
#define MINISGL_TILE4(t, X) \
  switch (t) {             \
    case 0: X(0); break;   \
    case 1: X(1); break;   \
    case 2: X(2); break;   \
    default: X(3);         \
  }

// The 16 K rows (D bf16 each, D apart) of the block of nk keys whose rows are krow: the pool's
// own when the block is a run of 16 consecutive slots, else copied into buf (zeros past nk).
inline const uint16_t* block_k(const uint16_t* const* krow, int nk, int64_t D, uint16_t* buf) {
  bool run = nk == KB;
  for (int j = 1; run && j < KB; ++j) run = krow[j] == krow[0] + j * D;
  if (run) return krow[0];
  for (int j = 0; j < KB; ++j) {
    if (j < nk)
      std::memcpy(buf + j * D, krow[j], D * 2);
    else
      std::memset(buf + j * D, 0, D * 2);
  }
  return buf;
}

// V^T from np key pairs (pair_rows' layout: D / 16 vectors per pair; np = 8 for one block, 16
// for two): row d of out (rows 64 bytes apart) holds dim d (pair order) of the 2 np keys, 32-bit
// pair by pair; `bytes` (32 or 64) of each row are stored, zeros past the pairs; with `also`,
// the rows' first 32 bytes go there too (rows 64 bytes apart).
inline void vt_rows(const __m512i* vp, int np, int64_t D, uint16_t* out, int bytes,
                    uint16_t* also = nullptr) {
  const int64_t Z = D / 16;
  for (int64_t z = 0; z < Z; ++z) {
    __m512i u[16];
    for (int jp = 0; jp < 16; ++jp) u[jp] = jp < np ? vp[jp * Z + z] : _mm512_setzero_si512();
    transpose16(u);
    for (int d = 0; d < 16; ++d) {
      const int64_t row = (16 * z + d) * 32;
      const __m256i lo = _mm512_castsi512_si256(u[d]);
      if (bytes == 64)
        _mm512_storeu_si512(out + row, u[d]);
      else
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + row), lo);
      if (also) _mm256_storeu_si256(reinterpret_cast<__m256i*>(also + row), lo);
    }
  }
}

// The key blocks of a prefill or extend batch loaded once for all its items, not once per item:
// in a 1024-token prefill each block is seen by 32 query blocks on average, and requests that
// share a cached prefix (the same slots) share its blocks. Block j of request b (keys 16 j ..)
// is unique block id[b * nb + j]; for unique block u and kv head h, krow[h * n + u] is its 16 K
// rows (block_k), and vt + (h n + u) D 32 the V^T of u and u + 1 side by side (D rows of 64
// bytes: u's 16 keys, then u + 1's; zeros for u + 1 = n), so that two neighbouring blocks are
// one tile per 16 dims, contiguous (each block's V^T is written twice: in a layout with a row
// of all blocks per dim, 2 KB apart, prefill and extend ran ~5% slower: tiles of rows 2 KB
// apart, which the hardware's prefetch does not follow). A request's own blocks are
// consecutive. Items of such batches start at key 0 (no window, no split-K), so the blocks of
// an item's steps are blocks of its request.
struct Blocks {
  int64_t nb = 0, n = 0;  // blocks per request (row of id), unique blocks
  std::vector<int32_t> id;
  std::vector<const uint16_t*> krow;
  const uint16_t* vt = nullptr;  // in memory kept by the calling thread for its next calls
};

// 16 vectors of 16 lanes each (u[i] lane n) to u[n] lane i.
__attribute__((always_inline)) inline void transpose16(__m512* u) {
  transpose16(reinterpret_cast<__m512i*>(u));
}

// A step's key blocks, ready for both products (run_item_amx).
struct Step {
  int64_t kb0 = 0;             // first key
  int nsb = 0, nkeys = 0;      // blocks, keys
  const uint16_t* kp[SB];      // each block's 16 K rows (D apart)
  const uint16_t* vt[SB / 2];  // each pair of blocks' V^T: D rows of 32 keys (64 bytes)
};

constexpr int MT = QB * 8 / 16;  // row tiles of an item at most (16 queries x up to 8 heads)

// run_item_amx's buffers, per thread.
struct AmxScratch {
  alignas(64) __m512i qt[MT][MAXD / 32][16];  // Q^T per row tile
  alignas(64) float sc[SB * KB][16];          // scores: a key per row, a lane per row
  alignas(64) __m512i pt[SB / 2][16];         // P^T: 16 key pairs x 16 rows per 32 keys
  alignas(64) float ot[MAXD][16];             // a row tile's O^T in memory
  std::vector<int64_t> qoff, lim, low;
  std::vector<Step> steps;
  std::vector<uint16_t> kcopy, vcopy;  // K of blocks not in a run of slots; V^T built per item
};

void run_item_amx(const Item& it, const c10::BFloat16* q, const c10::BFloat16* k,
                  const c10::BFloat16* v, const int64_t* slots, int64_t Lk, int64_t prefix,
                  int64_t qrow0, const int64_t* members, const int64_t* q_start, int64_t H,
                  int64_t S, int64_t G, int64_t D, float scale, int64_t window, float* O,
                  float* m, float* l, const Blocks* blocks) {
  const int64_t R = it.nq * G, NT = (R + 15) / 16, Z = D / 16, C = D / 32;
  static thread_local AmxScratch scratch;
  AmxScratch& w = *minisgl::opaque(&scratch);
  auto& qt = w.qt;
  auto& sc = w.sc;
  auto& pt = w.pt;
  auto& ot = w.ot;
  auto& qoff = w.qoff;
  auto& lim = w.lim;
  auto& low = w.low;
  qoff.resize(R);
  lim.resize(R);
  low.resize(R);
  item_rows(it, prefix, qrow0, members, q_start, H, G, D, window, qoff.data(), lim.data(),
            low.data(), m, l);
  // Per row tile: Q^T (qt[t][c] row p lane n: dims 32 c + 2p, +1 of row 16 t + n), the rows'
  // key ranges as lanes (rows past R see everything: zero queries, never written out), and
  // their bounds.
  __m512i vlow[MT], vlim[MT];
  int64_t low_max[MT], low_min[MT], lim_max[MT], lim_min[MT];
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t t = 0; t < NT; ++t) {
    alignas(64) int32_t lo[16], li[16];
    low_max[t] = lim_max[t] = 0;
    low_min[t] = lim_min[t] = std::numeric_limits<int64_t>::max();
    for (int64_t c = 0; c < C; ++c) {
      __m512i* u = qt[t][c];
      for (int n = 0; n < 16; ++n) {
        const int64_t r = 16 * t + n;
        u[n] = r < R ? _mm512_loadu_si512(q + qoff[r] + c * 32) : zero;
      }
      transpose16(u);
    }
    for (int n = 0; n < 16; ++n) {
      const int64_t r = 16 * t + n;
      lo[n] = r < R ? static_cast<int32_t>(low[r]) : 0;
      li[n] = r < R ? static_cast<int32_t>(lim[r]) : std::numeric_limits<int32_t>::max();
      if (r >= R) continue;
      low_max[t] = std::max(low_max[t], low[r]);
      low_min[t] = std::min(low_min[t], low[r]);
      lim_max[t] = std::max(lim_max[t], lim[r]);
      lim_min[t] = std::min(lim_min[t], lim[r]);
    }
    vlow[t] = _mm512_load_si512(lo);
    vlim[t] = _mm512_load_si512(li);
  }
  const uint16_t* kh = reinterpret_cast<const uint16_t*>(k) + it.h * S * D;
  const uint16_t* vh = reinterpret_cast<const uint16_t*>(v) + it.h * S * D;
  const int64_t* srow = slots + it.b * Lk;
  const int32_t* ids = blocks && blocks->id[it.b * blocks->nb] >= 0
                           ? blocks->id.data() + it.b * blocks->nb
                           : nullptr;

  // The item's steps of 64 keys: each block's K rows, each pair of blocks' V^T (Blocks', or
  // built here; copied where a pair's blocks are not neighbours there).
  const int64_t nsteps = (it.k1 - it.k0 + SB * KB - 1) / (SB * KB);
  w.steps.resize(nsteps);
  w.vcopy.resize(nsteps * (SB / 2) * D * 32);
  if (ids == nullptr) w.kcopy.resize(nsteps * SB * KB * D);
  for (int64_t s = 0; s < nsteps; ++s) {
    Step& st = w.steps[s];
    st.kb0 = it.k0 + s * SB * KB;
    st.nkeys = static_cast<int>(std::min<int64_t>(SB * KB, it.k1 - st.kb0));
    st.nsb = (st.nkeys + KB - 1) / KB;
    for (int pp = 0; pp < (st.nsb + 1) / 2; ++pp) {
      uint16_t* vbuf = w.vcopy.data() + (s * (SB / 2) + pp) * D * 32;
      const bool two = 2 * pp + 1 < st.nsb;
      st.vt[pp] = vbuf;
      if (ids == nullptr) {
        alignas(64) __m512i vp[KB * MAXD / 16];  // the pair's key pairs
        for (int e = 0; e < (two ? 2 : 1); ++e) {
          const int sb = 2 * pp + e;
          const int64_t kb = st.kb0 + sb * KB;
          const int nk = static_cast<int>(std::min<int64_t>(KB, it.k1 - kb));
          const uint16_t* krow[KB];
          const uint16_t* vrow[KB];
          block_rows(kh, vh, srow, kb, nk, it.k1, D, krow, vrow);
          st.kp[sb] = block_k(krow, nk, D, w.kcopy.data() + (s * SB + sb) * KB * D);
          pair_rows(vrow, D, vp + e * 8 * Z);
        }
        vt_rows(vp, two ? 16 : 8, D, vbuf, 64);
        continue;
      }
      const int64_t j = st.kb0 / KB + 2 * pp;
      auto vt_of = [&](int32_t u) { return blocks->vt + (it.h * blocks->n + u) * D * 32; };
      st.kp[2 * pp] = blocks->krow[it.h * blocks->n + ids[j]];
      if (two) st.kp[2 * pp + 1] = blocks->krow[it.h * blocks->n + ids[j + 1]];
      if (!two || ids[j + 1] == ids[j] + 1) {  // (past an odd last block: the next unique
        st.vt[pp] = vt_of(ids[j]);             // block's finite data or zeros; P is 0 there)
      } else {  // a shared prefix's last block and the request's first: not neighbours
        const uint16_t* a = vt_of(ids[j]);
        const uint16_t* b = vt_of(ids[j + 1]);
        for (int64_t d = 0; d < D; ++d) {
          std::memcpy(vbuf + d * 32, a + d * 32, 32);
          std::memcpy(vbuf + d * 32 + 16, b + d * 32, 32);
        }
      }
    }
  }

  // (p_2i, p_2i+1) of each lane as one 32-bit pair: words 0-15 of cvtne2ps_pbh(b, a) are a's
  const __m512i interleave = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4,
      19, 3, 18, 2, 17, 1, 16, 0);
  // Softmax in base 2: y = score * scale * log2(e), the reference max in those units, p = 2^(y -
  // reference)
  const __m512 vscale = _mm512_set1_ps(scale * minisgl_vec::kLog2e),
               ninf = _mm512_set1_ps(NEG_INF), lazy = _mm512_set1_ps(kLazy),
               big = _mm512_set1_ps(kBig);
  const bool resident = Z == ZT;  // O^T in tiles 0-3 all along (D = 64)
  attn_tiles_begin();
  for (int64_t t = 0; t < NT; ++t) {
    __m512 mref = ninf, lsum = _mm512_setzero_ps();
    if (resident) {
#define MINISGL_ZERO(n) _tile_zero(n)
      for (int zt = 0; zt < ZT; ++zt) MINISGL_TILE4(zt, MINISGL_ZERO)
    } else {
      std::fill(&ot[0][0], &ot[0][0] + D * 16, 0.f);
    }
#define MINISGL_OLOAD(n) _tile_loadd(n, ot[16 * (z0 + zt)], 64)
#define MINISGL_OSTORE(n) _tile_stored(n, ot[16 * (z0 + zt)], 64)
    for (const Step& st : w.steps) {
      const int64_t kb0 = st.kb0;
      const int nkeys = st.nkeys, npair = (st.nsb + 1) / 2;
      if (low_min[t] >= kb0 + nkeys || lim_max[t] <= kb0) continue;  // no row sees these keys
      // S^T of the step's blocks, two at a time, into sc (a key per row)
      for (int sb = 0; sb < st.nsb; sb += 2) {
        const bool two = sb + 1 < st.nsb;
        _tile_zero(4);
        if (two) _tile_zero(5);
        for (int64_t c = 0; c < C; ++c) {
          _tile_loadd(6, qt[t][c], 64);
          _tile_loadd(7, st.kp[sb] + c * 32, D * 2);
          _tile_dpbf16ps(4, 7, 6);
          if (two) {
            _tile_loadd(7, st.kp[sb + 1] + c * 32, D * 2);
            _tile_dpbf16ps(5, 7, 6);
          }
        }
        _tile_stored(4, sc[sb * KB], 64);
        if (two) _tile_stored(5, sc[(sb + 1) * KB], 64);
      }
      // Rows that see all 64 keys of the step (prefill and extend away from the diagonal, a
      // shared prefix's decode queries) need no masks.
      const bool full = nkeys == SB * KB && low_max[t] <= kb0 && lim_min[t] >= kb0 + SB * KB;
      // (the loops are unrolled so that the chains and the pair vectors stay in registers)
      __mmask16 seen[SB * KB];
      if (!full) {
#pragma GCC unroll 16
        for (int j = 0; j < SB * KB; ++j) {
          const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(kb0 + j));
          seen[j] = j < nkeys ? _mm512_cmple_epi32_mask(vlow[t], key) &
                                    _mm512_cmplt_epi32_mask(key, vlim[t])
                              : __mmask16(0);
        }
      }
      // P^T of the step, p = 2^(y - mb), into pt; returns the rows' sums of p
      auto exps = [&](__m512 mb) {
        __m512 sum[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                         _mm512_setzero_ps()};
        for (int h = 0; h < npair; ++h) {  // 32 keys: p in pairs, as P^T's 16 rows
#pragma GCC unroll 16
          for (int i = 0; i < 16; ++i) {
            __m512 p[2];
            for (int e = 0; e < 2; ++e) {
              const int j = 32 * h + 2 * i + e;
              const __m512 x = _mm512_fmsub_ps(_mm512_load_ps(sc[j]), vscale, mb);
              p[e] = full ? exp2_16(x) : _mm512_maskz_mov_ps(seen[j], exp2_16(x));
              sum[(2 * i + e) % 4] = _mm512_add_ps(sum[(2 * i + e) % 4], p[e]);
            }
            _mm512_store_si512(&pt[h][i], _mm512_permutexvar_epi16(
                                              interleave, (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0])));
          }
        }
        return _mm512_add_ps(_mm512_add_ps(sum[0], sum[1]), _mm512_add_ps(sum[2], sum[3]));
      };
      // Rows that have a reference take p against it with no pass for the step's max; unless
      // a row's sum passes 2^kBig (a score far above the reference: p may have overflowed),
      // that is the step.
      bool done = false;
      if (_mm512_cmp_ps_mask(mref, ninf, _CMP_EQ_OQ) == 0) {
        const __m512 sum = exps(mref);
        done = _mm512_cmp_ps_mask(sum, big, _CMP_NLT_UQ) == 0;
        if (done) lsum = _mm512_add_ps(lsum, sum);
      }
      if (!done) {
        __m512 vmax[4] = {ninf, ninf, ninf, ninf};  // four chains: a max waits for the one before
#pragma GCC unroll 64
        for (int j = 0; j < SB * KB; ++j)  // (of the raw scores: scale > 0)
          vmax[j % 4] = _mm512_max_ps(vmax[j % 4], full ? _mm512_load_ps(sc[j])
                                                         : _mm512_mask_load_ps(ninf, seen[j], sc[j]));
        const __m512 mx = _mm512_mul_ps(vscale, _mm512_max_ps(_mm512_max_ps(vmax[0], vmax[1]),
                                                              _mm512_max_ps(vmax[2], vmax[3])));
        // Rows whose max passes their reference by more than kLazy (or that had none) move it
        // there; of them, those that had one rescale their sum and O (rows that had none have
        // O = 0, and the factor 0).
        if (const __mmask16 up = _mm512_cmp_ps_mask(mx, _mm512_add_ps(mref, lazy), _CMP_GT_OQ)) {
          const __m512 mnew = _mm512_mask_mov_ps(mref, up, mx);
          const __m512 corr =
              exp2_16(_mm512_max_ps(_mm512_sub_ps(mref, mnew), _mm512_set1_ps(-200.f)));
          lsum = _mm512_mul_ps(lsum, corr);
          if (_mm512_mask_cmp_ps_mask(up, mref, ninf, _CMP_NEQ_OQ)) {
            const int64_t z0 = 0;
            if (resident)
              for (int zt = 0; zt < ZT; ++zt) MINISGL_TILE4(zt, MINISGL_OSTORE)
            for (int64_t d = 0; d < D; ++d)
              _mm512_store_ps(ot[d], _mm512_mul_ps(_mm512_load_ps(ot[d]), corr));
            if (resident)
              for (int zt = 0; zt < ZT; ++zt) MINISGL_TILE4(zt, MINISGL_OLOAD)
          }
          mref = mnew;
        }
        // rows that have seen no key yet subtract 0, not -inf (their p are masked to 0)
        lsum = _mm512_add_ps(lsum, exps(_mm512_mask_mov_ps(
                                       mref, _mm512_cmp_ps_mask(mref, ninf, _CMP_EQ_OQ),
                                       _mm512_setzero_ps())));
      }
      // O^T += V^T P^T, 32 keys per tdpbf16ps, V^T alternating between tiles 6 and 7
#define MINISGL_PV(n, a)                                 \
  _tile_loadd(a, st.vt[pp] + 16 * (z0 + zt) * 32, 64); \
  _tile_dpbf16ps(n, a, 4)
#define MINISGL_PV_EVEN(n) MINISGL_PV(n, 6)
#define MINISGL_PV_ODD(n) MINISGL_PV(n, 7)
      for (int64_t z0 = 0; z0 < Z; z0 += ZT) {
        const int nz = static_cast<int>(std::min<int64_t>(ZT, Z - z0));
        if (!resident)
          for (int zt = 0; zt < nz; ++zt) MINISGL_TILE4(zt, MINISGL_OLOAD)
        for (int pp = 0; pp < npair; ++pp) {
          _tile_loadd(4, pt[pp], 64);
          for (int zt = 0; zt < nz; ++zt) {
            if (zt % 2) {
              MINISGL_TILE4(zt, MINISGL_PV_ODD)
            } else {
              MINISGL_TILE4(zt, MINISGL_PV_EVEN)
            }
          }
        }
        if (!resident)
          for (int zt = 0; zt < nz; ++zt) MINISGL_TILE4(zt, MINISGL_OSTORE)
      }
    }
    if (resident) {
      const int64_t z0 = 0;
      for (int zt = 0; zt < ZT; ++zt) MINISGL_TILE4(zt, MINISGL_OSTORE)
    }
    for (int64_t z = 0; z < Z; ++z) {  // O^T to rows
      __m512 u[16];
      for (int d = 0; d < 16; ++d) u[d] = _mm512_load_ps(ot[16 * z + d]);
      transpose16(u);
      for (int n = 0; n < 16; ++n) _mm512_storeu_ps(O + (16 * t + n) * D + 16 * z, u[n]);
    }
    alignas(64) float mf[16], lf[16];
    _mm512_store_ps(mf, mref);
    _mm512_store_ps(lf, lsum);
    for (int64_t n = 0; n < 16 && 16 * t + n < R; ++n)  // (the max in natural units again)
      m[16 * t + n] = mf[n] * std::numbers::ln2_v<float>, l[16 * t + n] = lf[n];
  }
  _tile_release();
}

// Fills blocks for the batch's requests whose items run on tiles (at least 16 rows: a mixed
// step's decode requests, G rows each, load their own), kv_lens kl, q_lens ql: unique blocks
// in order of first use; the id rows of the others stay -1.
void build_blocks(Blocks& blocks, const at::Tensor& k, const at::Tensor& v, const int64_t* slots,
                  int64_t Lk, const int64_t* kl, const int64_t* ql, int64_t B, int64_t G,
                  int64_t KVH, int64_t D) {
  int64_t max_kv = 0;
  for (int64_t b = 0; b < B; ++b) max_kv = std::max(max_kv, kl[b]);
  blocks.nb = (max_kv + KB - 1) / KB;
  blocks.id.assign(B * blocks.nb, -1);
  std::vector<std::pair<int64_t, int64_t>> first;  // unique block -> (request, block)
  std::unordered_map<int64_t, std::vector<int32_t>> by_slot;  // a block's first slot -> uniques
  for (int64_t b = 0; b < B; ++b) {
    if (std::min<int64_t>(QB, ql[b]) * G < 16) continue;
    const int64_t* srow = slots + b * Lk;
    for (int64_t j = 0; j * KB < kl[b]; ++j) {
      const int64_t nk = std::min<int64_t>(KB, kl[b] - j * KB);
      std::vector<int32_t>& same = by_slot[srow[j * KB]];
      int32_t u = -1;
      for (int32_t c : same) {
        const auto [cb, cj] = first[c];
        if (std::min<int64_t>(KB, kl[cb] - cj * KB) == nk &&
            std::equal(srow + j * KB, srow + j * KB + nk, slots + cb * Lk + cj * KB)) {
          u = c;
          break;
        }
      }
      if (u < 0) {
        u = static_cast<int32_t>(first.size());
        first.emplace_back(b, j);
        same.push_back(u);
      }
      blocks.id[b * blocks.nb + j] = u;
    }
  }
  const int64_t n = blocks.n = static_cast<int64_t>(first.size());
  // reused from call to call (a fresh allocation of megabytes per layer faults its pages in);
  // V^T rows of n + 1 blocks, the last zeros: an odd last block's pair partner (P is 0 there).
  // K rows of blocks that are not a run of slots are copied into kcopy.
  static thread_local std::vector<uint16_t> vt_store;
  static thread_local std::vector<uint16_t> kcopy;
  if (vt_store.size() < static_cast<size_t>(KVH * n * D * 32)) vt_store.resize(KVH * n * D * 32);
  if (kcopy.size() < static_cast<size_t>(KVH * n * KB * D)) kcopy.resize(KVH * n * KB * D);
  uint16_t* vt = vt_store.data();
  for (int64_t h = 0; n > 0 && h < KVH; ++h)  // the last block's partner: zeros
    for (int64_t d = 0; d < D; ++d)
      std::fill_n(vt + ((h * n + n - 1) * D + d) * 32 + 16, 16, uint16_t(0));
  uint16_t* kc = kcopy.data();  // (a thread_local named in the loop below is each thread's own)
  blocks.vt = vt;
  blocks.krow.resize(KVH * n);
  const int64_t S = k.size(1);
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<c10::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<c10::BFloat16>());
  at::parallel_for(0, KVH * n, 16, [&](int64_t begin, int64_t end) {
    alignas(64) __m512i pairs[KB / 2 * MAXD / 16];
    for (int64_t hu = begin; hu < end; ++hu) {
      const int64_t h = hu / n, u = hu % n;
      const auto [b, j] = first[u];
      const int nk = static_cast<int>(std::min<int64_t>(KB, kl[b] - j * KB));
      const uint16_t* krow[KB];
      const uint16_t* vrow[KB];
      block_rows(kp + h * S * D, vp + h * S * D, slots + b * Lk, j * KB, nk, kl[b], D, krow, vrow);
      blocks.krow[hu] = block_k(krow, nk, D, kc + hu * KB * D);
      pair_rows(vrow, D, pairs);
      // the left half of its own pair, the right half of the previous block's
      vt_rows(pairs, KB / 2, D, vt + hu * D * 32, 32,
              u > 0 ? vt + (hu - 1) * D * 32 + 16 : nullptr);
    }
  });
}
#undef MINISGL_TILE4
#undef MINISGL_ZERO
#undef MINISGL_OLOAD
#undef MINISGL_OSTORE
#undef MINISGL_PV
#undef MINISGL_PV_EVEN
#undef MINISGL_PV_ODD
#endif

// Dims of the pair order back to the natural order, scaled by inv, as bf16 (rounded to nearest
// even, as c10's conversion; a scalar conversion per dim took ~6% of a 1024-token prefill's
// attention).
inline void write_row(const float* o, float inv, int64_t D, c10::BFloat16* out) {
  // within 32 dims: 8l + i (i < 4) is lo[4l + i], 8l + 4 + i is hi[4l + i]
  const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int64_t c = 0; c < D / 32; ++c) {
    const __m512 lo = _mm512_loadu_ps(o + c * 32), hi = _mm512_loadu_ps(o + c * 32 + 16);
    const __m512 a = _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), vinv);
    const __m512 b = _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), vinv);
    _mm512_storeu_si512(out + c * 32, (__m512i)_mm512_cvtne2ps_pbh(b, a));
  }
}

#elif MINISGL_ATTN_AVX2

// The AVX2 build: the same items and 16-key blocks in float32 (AVX2 has no bf16 dot product).
// Per block, K is transposed and widened once: kt[d] = dim d of the block's 16 keys as two
// halves (keys 0-7, 8-15), so a row's 16 scores are D FMAs of its query's dims (widened once
// per item) with no horizontal sums; the softmax is online as above; P stays float32 and
// O += P V multiplies V rows widened on the fly. O is in the natural dim order.

using minisgl_vec::exp8;
using minisgl_vec::load_bf16;

struct F16 { __m256 lo, hi; };  // 16 float32 lanes: keys 0-7 and 8-15 of a block

// 8 x 8 transpose of 32-bit words, in place.
inline void transpose8(__m256i* r) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {  // within each 128-bit lane: words 0, 1 | 4, 5 and 2, 3 | 6, 7
    t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // u[4i + w]: word w | w + 4 of rows 4i .. 4i + 3
    u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int w = 0; w < 4; ++w) {
    r[w] = _mm256_permute2x128_si256(u[w], u[4 + w], 0x20);
    r[4 + w] = _mm256_permute2x128_si256(u[w], u[4 + w], 0x31);
  }
}

// Scores of NR rows against one key block: out[r] lane j = q_r . k_j. With few rows (the last
// group of an item's rows; decode items run run_decode) two chains per half and row (an FMA
// waits for the previous one on its accumulator); 12 accumulators either way.
template <int NR>
inline void qk_rows(const float* const* q, const F16* kt, int64_t D, F16* out) {
  constexpr int U = NR <= 3 ? 2 : 1;
  __m256 lo[NR][U], hi[NR][U];
  for (int r = 0; r < NR; ++r)
    for (int u = 0; u < U; ++u) lo[r][u] = hi[r][u] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += U)
    for (int u = 0; u < U; ++u) {
      const __m256 klo = kt[d + u].lo, khi = kt[d + u].hi;
      for (int r = 0; r < NR; ++r) {
        const __m256 x = _mm256_broadcast_ss(q[r] + d + u);
        lo[r][u] = _mm256_fmadd_ps(x, klo, lo[r][u]);
        hi[r][u] = _mm256_fmadd_ps(x, khi, hi[r][u]);
      }
    }
  for (int r = 0; r < NR; ++r) {
    out[r] = {lo[r][0], hi[r][0]};
    for (int u = 1; u < U; ++u)
      out[r] = {_mm256_add_ps(out[r].lo, lo[r][u]), _mm256_add_ps(out[r].hi, hi[r][u])};
  }
}

constexpr int kRows = 6;  // rows per qk_rows call at most (12 accumulators of 16 registers)

inline void qk_dispatch(int nr, const float* const* q, const F16* kt, int64_t D, F16* out) {
  switch (nr) {
    case 1: return qk_rows<1>(q, kt, D, out);
    case 2: return qk_rows<2>(q, kt, D, out);
    case 3: return qk_rows<3>(q, kt, D, out);
    case 4: return qk_rows<4>(q, kt, D, out);
    case 5: return qk_rows<5>(q, kt, D, out);
    default: return qk_rows<6>(q, kt, D, out);
  }
}

// Decode items. The G rows of a single query all see every key of the item's range [k0, k1)
// (a window included), and a block's transpose and online softmax are paid for G rows only (3
// for SmolLM2): so such an item runs two passes per chunk of up to kChunk keys instead. The
// scores of up to 3 rows against 4 keys at a time, each key's bf16 line widened as it is loaded
// (the even and the odd dims of its pairs; the queries are kept in that order) and the 4 sums
// gathered by horizontal adds; one softmax over the chunk (merged online with the chunks
// before); then O += P V with 12 accumulators (3 rows x 32 dims). 16 decode requests x 160
// keys: 0.72-0.81x the time of the blocks (docs/benchmarks.md, twentieth sitting).
constexpr int64_t kChunk = 512;  // keys per chunk: scores [G][kChunk] stay in L1

// Rows of an int8 pool (D values, then the row's float32 scale) as bf16 rows of D (value x
// scale, rounded as KVPool.read rounds it) at out + j * D: this build widens bf16 to float32
// where it uses a row, so an int8 pool's rows are made bf16 first (per chunk or block), and the
// rest runs as on a bf16 pool. rows[j] may be null (left alone).
inline void dequant_rows(const uint16_t* const* rows, int64_t n, int64_t D, uint16_t* out) {
  for (int64_t j = 0; j < n; ++j) {
    if (rows[j] == nullptr) continue;
    const auto* x = reinterpret_cast<const int8_t*>(rows[j]);
    const __m256 vs = _mm256_set1_ps(record_scale(rows[j], D));
    for (int64_t c = 0; c < D; c += 8) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(x + c));
      const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), vs);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j * D + c), minisgl_vec::to_bf16(f));
    }
  }
}
constexpr int64_t kAhead = 32;   // rows prefetched ahead in the chunk's K then V stream

// The even and the odd dims of 8 bf16 pairs, as float32.
inline void widen_pairs(__m256i x, __m256& even, __m256& odd) {
  even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(int(0xFFFF0000u))));
}

// out[r * ld + j] = q_r . k_j for NR rows (qp: [NR][D], per 16 dims the 8 even then the 8 odd)
// and the 4 keys kr[0 .. 3].
template <int NR>
inline void dot4(const float* qp, int64_t D, const uint16_t* const* kr, float* out, int64_t ld) {
  __m256 acc[NR][4];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < D; c += 16)
    for (int j = 0; j < 4; ++j) {
      __m256 e, o;
      widen_pairs(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kr[j] + c)), e, o);
      for (int r = 0; r < NR; ++r) {
        acc[r][j] = _mm256_fmadd_ps(e, _mm256_loadu_ps(qp + r * D + c), acc[r][j]);
        acc[r][j] = _mm256_fmadd_ps(o, _mm256_loadu_ps(qp + r * D + c + 8), acc[r][j]);
      }
    }
  for (int r = 0; r < NR; ++r) {  // lanes: sums of keys 0-3 over dims 0-3 | 4-7, then added
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[r][0], acc[r][1]),
                                    _mm256_hadd_ps(acc[r][2], acc[r][3]));
    _mm_storeu_ps(out + r * ld, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
}

// A broadcast of *p that the compiler does not merge with an earlier one of the same address
// (it would keep that in a register that an accumulator then loses to the stack).
inline __m256 broadcast_again(const float* p) {
  asm volatile("" : "+r"(p));
  return _mm256_broadcast_ss(p);
}

// O[r] (pair order, [D]) += sum over keys j < n of p[r * ld + j] v_j, for NR rows, 32 dims at a
// time. Prefetches: V rows kAhead ahead, then (the last 32 dims) the K rows that follow.
template <int NR>
inline void pv_rows(const float* p, int64_t ld, const uint16_t* const* vr, int64_t n, int64_t D,
                    const uint16_t* const* next_k, int64_t next_n, float* O) {
  for (int64_t c = 0; c < D; c += 32) {
    __m256 acc[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_loadu_ps(O + r * D + c + 8 * i);
    const bool last = c + 32 == D;
    for (int64_t j = 0; j < n; ++j) {
      if (j + kAhead < n) {
        __builtin_prefetch(vr[j + kAhead] + c, 0, 3);
      } else if (last && j + kAhead - n < next_n) {
        prefetch_row(next_k[j + kAhead - n], D);
      }
      for (int half = 0; half < 2; ++half) {  // 16 dims at a time: 12 + 2 + 1 registers
        __m256 e, o;
        widen_pairs(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vr[j] + c + 16 * half)),
                    e, o);
        for (int r = 0; r < NR; ++r) {
          const __m256 b = broadcast_again(p + r * ld + j);
          acc[r][2 * half] = _mm256_fmadd_ps(b, e, acc[r][2 * half]);
          acc[r][2 * half + 1] = _mm256_fmadd_ps(b, o, acc[r][2 * half + 1]);
        }
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(O + r * D + c + 8 * i, acc[r][i]);
  }
}

// fn(std::integral_constant<int, NR>{}, r0) for G rows in groups of NR = 3 (the last 1 or 2):
// the register tiles of dot4 and pv_rows
template <class Fn>
inline void row_groups(int64_t G, const Fn& fn) {
  for (int64_t r0 = 0; r0 < G; r0 += 3) {
    switch (std::min<int64_t>(3, G - r0)) {
      case 1: fn(std::integral_constant<int, 1>{}, r0); break;
      case 2: fn(std::integral_constant<int, 2>{}, r0); break;
      default: fn(std::integral_constant<int, 3>{}, r0);
    }
  }
}

// A decode item (nq = 1, not a shared-prefix item): O [G, D] natural order, m, l as run_item.
void run_decode(const Item& it, const c10::BFloat16* q, const c10::BFloat16* k,
                const c10::BFloat16* v, const int64_t* slots, int64_t Lk, int64_t qrow0,
                int64_t H, int64_t S, int64_t G, int64_t D, float scale, float* O, float* m,
                float* l, Ahead& ahead, bool q8) {
  constexpr int64_t ld = kChunk + 8;
  struct Scratch {
    alignas(32) float sc[8 * ld];   // scores, then P: [G][ld]
    alignas(32) float op[8 * MAXD];  // O in pair order: [G][D]
    alignas(32) float qp[8 * MAXD];  // the rows' queries in pair order
    const uint16_t* kr[kChunk + 4];
    const uint16_t* vr[kChunk + 4];
    std::vector<uint16_t> kst, vst;  // an int8 pool's chunk as bf16 rows (dequant_rows)
  };
  static thread_local Scratch scratch;
  auto& [sc, op, qp, kr, vr, kst, vst] = *minisgl::opaque(&scratch);
  alignas(64) static const uint16_t zero_row[MAXD] = {};
  const int64_t Dr = pool_row(D, q8);
  const uint16_t* kh = reinterpret_cast<const uint16_t*>(k) + it.h * S * Dr;
  const uint16_t* vh = reinterpret_cast<const uint16_t*>(v) + it.h * S * Dr;
  const int64_t* srow = slots + it.b * Lk;
  for (int64_t j = it.k0; j < std::min(it.k1, it.k0 + kAhead); ++j)
    prefetch_row(kh + srow[j] * Dr, Dr);
  const uint16_t* qh = reinterpret_cast<const uint16_t*>(q) + ((qrow0 + it.q0) * H + it.h * G) * D;
  for (int64_t i = 0; i < G * D; i += 16) {  // the G heads' queries lie back to back
    __m256 e, o;
    widen_pairs(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + i)), e, o);
    _mm256_store_ps(qp + i, e);
    _mm256_store_ps(qp + i + 8, o);
  }
  std::fill(op, op + G * D, 0.f);
  for (int64_t g = 0; g < G; ++g) m[g] = NEG_INF, l[g] = 0.f;
  const int64_t chunks = std::max<int64_t>(1, (it.k1 - it.k0 + kChunk - 1) / kChunk);
  const int64_t per = (ahead.k1 - ahead.j + chunks - 1) / chunks;
  for (int64_t a = it.k0; a < it.k1; a += kChunk) {
    const int64_t n = std::min(kChunk, it.k1 - a), n4 = (n + 3) / 4 * 4, n8 = (n + 7) / 8 * 8;
    ahead.keys(per);
    for (int64_t j = 0; j < n4; ++j) {
      kr[j] = j < n ? kh + srow[a + j] * Dr : zero_row;
      vr[j] = j < n ? vh + srow[a + j] * Dr : zero_row;
    }
    if (q8) {  // (their prefetches below then ask for the scratch rows: in cache already)
      kst.resize(n * D);
      vst.resize(n * D);
      dequant_rows(kr, n, D, kst.data());
      dequant_rows(vr, n, D, vst.data());
      for (int64_t j = 0; j < n; ++j) kr[j] = kst.data() + j * D, vr[j] = vst.data() + j * D;
    }
    // this chunk's K rows, then its V rows, kAhead ahead of use
    for (int64_t j = 0; j < n4; j += 4) {
      for (int64_t t = j + kAhead; t < std::min(j + kAhead + 4, 2 * n); ++t)
        prefetch_row(t < n ? kr[t] : vr[t - n], D);
      row_groups(G, [&](auto nr, int64_t r0) {
        dot4<decltype(nr)::value>(qp + r0 * D, D, kr + j, sc + r0 * ld + j, ld);
      });
    }
    // softmax over the chunk, merged with the chunks before
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t g = 0; g < G; ++g) {
      float* s = sc + g * ld;
      for (int64_t j = n; j < n8; ++j) s[j] = NEG_INF;
      __m256 vmax = _mm256_set1_ps(NEG_INF);
      for (int64_t j = 0; j < n8; j += 8) {
        const __m256 x = _mm256_mul_ps(_mm256_load_ps(s + j), vscale);
        _mm256_store_ps(s + j, x);
        vmax = _mm256_max_ps(vmax, x);
      }
      const float mx = std::max(m[g], minisgl_vec::hmax8(vmax));
      const __m256 vmx = _mm256_set1_ps(mx);
      __m256 vsum = _mm256_setzero_ps();
      for (int64_t j = 0; j < n8; j += 8) {
        const __m256 e = minisgl_vec::exp8(_mm256_sub_ps(_mm256_load_ps(s + j), vmx));
        _mm256_store_ps(s + j, e);
        if (j + 8 <= n) vsum = _mm256_add_ps(vsum, e);
      }
      for (int64_t j = n; j < n8; ++j) s[j] = 0.f;
      float sum = minisgl_vec::hsum8(vsum);
      for (int64_t j = n / 8 * 8; j < n; ++j) sum += s[j];
      const float corr = m[g] == NEG_INF ? 0.f : std::exp(m[g] - mx);
      if (corr != 1.f)
        for (int64_t d = 0; d < D; ++d) op[g * D + d] *= corr;
      l[g] = l[g] * corr + sum;
      m[g] = mx;
    }
    // O += P V; meanwhile the next chunk's first K rows
    const int64_t next_n = std::min(kAhead, it.k1 - a - n);
    const uint16_t* next_k[kAhead];
    for (int64_t t = 0; t < next_n; ++t) next_k[t] = kh + srow[a + n + t] * Dr;
    row_groups(G, [&](auto nr, int64_t r0) {
      pv_rows<decltype(nr)::value>(sc + r0 * ld, ld, vr, n, D, next_k, next_n, op + r0 * D);
    });
  }
  // pair order back to the natural one: dims 16c + 2i, 16c + 2i + 1 are lanes i of the even and
  // the odd vector
  for (int64_t i = 0; i < G * D; i += 16) {
    const __m256 e = _mm256_load_ps(op + i), o = _mm256_load_ps(op + i + 8);
    const __m256 lo = _mm256_unpacklo_ps(e, o), hi = _mm256_unpackhi_ps(e, o);
    _mm256_storeu_ps(O + i, _mm256_permute2f128_ps(lo, hi, 0x20));
    _mm256_storeu_ps(O + i + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
  }
}

// One work item, as the AVX-512 one; O float32 [R, D] in the natural dim order.
void run_item(const Item& it, const c10::BFloat16* q, const c10::BFloat16* k,
              const c10::BFloat16* v, const int64_t* slots, int64_t Lk, int64_t prefix,
              int64_t qrow0, const int64_t* members, const int64_t* q_start, int64_t H,
              int64_t S, int64_t G, int64_t D, float scale, int64_t window, float* O, float* m,
              float* l, Ahead& ahead, bool /*lanes: the AVX-512 build's*/, bool q8) {
  if (it.nq == 1 && it.mn == 0) {  // one query: its rows see all of [k0, k1)
    run_decode(it, q, k, v, slots, Lk, qrow0, H, S, G, D, scale, O, m, l, ahead, q8);
    return;
  }
  const int64_t R = it.nq * G;
  struct Scratch {
    alignas(32) F16 kt[MAXD];
    alignas(32) float pb[QB * 8][KB];  // P of each row
    std::vector<float> qf;  // the rows' queries in float32, [R, D]
    std::vector<const float*> qrow;
    std::vector<int64_t> qoff, lim, low;
  };
  static thread_local Scratch scratch;
  auto& [kt, pb, qf, qrow, qoff, lim, low] = *minisgl::opaque(&scratch);
  qf.resize(R * D);
  qrow.resize(R);
  qoff.resize(R);
  lim.resize(R);
  low.resize(R);
  item_rows(it, prefix, qrow0, members, q_start, H, G, D, window, qoff.data(), lim.data(),
            low.data(), m, l);
  for (int64_t r = 0; r < R; ++r) {
    qrow[r] = qf.data() + r * D;
    for (int64_t d = 0; d < D; d += 8)
      _mm256_storeu_ps(qf.data() + r * D + d, load_bf16(q + qoff[r] + d));
  }
  std::fill(O, O + R * D, 0.f);
  const int64_t Dr = pool_row(D, q8);
  const uint16_t* kh = reinterpret_cast<const uint16_t*>(k) + it.h * S * Dr;
  const uint16_t* vh = reinterpret_cast<const uint16_t*>(v) + it.h * S * Dr;
  const int64_t* srow = slots + it.b * Lk;
  alignas(32) static thread_local uint16_t stage[2][KB * MAXD];  // an int8 block as bf16 rows
  const __m256i zero = _mm256_setzero_si256(), high = _mm256_set1_epi32(int(0xFFFF0000u));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i lane8 = _mm256_add_epi32(lane, _mm256_set1_epi32(8));
  const __m256 vscale = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(NEG_INF);
  for (int64_t kb = it.k0; kb < it.k1; kb += KB) {
    const int nk = static_cast<int>(std::min<int64_t>(KB, it.k1 - kb));
    const int halves = nk > 8 ? 2 : 1;  // keys 8-15 past nk: their lanes stay masked
    const uint16_t* krow[KB];
    const uint16_t* vrow[KB];
    block_rows(kh, vh, srow, kb, nk, it.k1, Dr, krow, vrow, q8);
    if (q8) {
      dequant_rows(krow, nk, D, stage[0]);
      dequant_rows(vrow, nk, D, stage[1]);
      for (int j = 0; j < nk; ++j) krow[j] = stage[0] + j * D, vrow[j] = stage[1] + j * D;
    }
    // kt[d] = dim d of the block's keys: 32 bytes (16 dims, 8 pairs) of 8 keys transposed,
    // then each pair's even and odd dim widened
    for (int64_t c = 0; c < D / 16; ++c)
      for (int half = 0; half < halves; ++half) {
        __m256i t[8];
        for (int j = 0; j < 8; ++j) {
          const uint16_t* row = krow[8 * half + j];
          t[j] = row ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 16)) : zero;
        }
        transpose8(t);  // t[i] lane j: dims 16c + 2i, 16c + 2i + 1 of key 8 half + j
        for (int i = 0; i < 8; ++i) {
          const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(t[i], 16));
          const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(t[i], high));
          F16& a = kt[16 * c + 2 * i];
          F16& b = kt[16 * c + 2 * i + 1];
          (half ? a.hi : a.lo) = even;
          (half ? b.hi : b.lo) = odd;
        }
      }
    // Scores and online softmax, kRows rows at a time.
    for (int64_t r0 = 0; r0 < R; r0 += kRows) {
      const int nr = static_cast<int>(std::min<int64_t>(kRows, R - r0));
      F16 s[kRows];
      qk_dispatch(nr, qrow.data() + r0, kt, D, s);
      for (int rr = 0; rr < nr; ++rr) {
        const int64_t r = r0 + rr;
        int64_t hidden, visible;
        if (!row_lanes(low[r], lim[r], kb, nk, hidden, visible)) {
          std::memset(pb[r], 0, sizeof(pb[r]));
          continue;
        }
        auto seen = [&](__m256i idx) {  // lanes hidden <= j < visible
          return _mm256_castsi256_ps(_mm256_andnot_si256(
              _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(hidden)), idx),
              _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(visible)), idx)));
        };
        const __m256 mlo = seen(lane), mhi = seen(lane8);
        const __m256 xlo = _mm256_blendv_ps(ninf, _mm256_mul_ps(s[rr].lo, vscale), mlo);
        const __m256 xhi = _mm256_blendv_ps(ninf, _mm256_mul_ps(s[rr].hi, vscale), mhi);
        const float mx = std::max(m[r], minisgl_vec::hmax8(_mm256_max_ps(xlo, xhi)));
        const __m256 vmx = _mm256_set1_ps(mx);
        const __m256 plo = _mm256_and_ps(mlo, exp8(_mm256_sub_ps(xlo, vmx)));
        const __m256 phi = _mm256_and_ps(mhi, exp8(_mm256_sub_ps(xhi, vmx)));
        const float corr = m[r] == mx         ? 1.f
                           : m[r] == NEG_INF ? 0.f
                                             : _mm256_cvtss_f32(exp8(_mm256_set1_ps(m[r] - mx)));
        l[r] = l[r] * corr + minisgl_vec::hsum8(_mm256_add_ps(plo, phi));
        m[r] = mx;
        if (corr != 1.f) {
          float* o = O + r * D;
          for (int64_t d = 0; d < D; d += 8)
            _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), _mm256_set1_ps(corr)));
        }
        _mm256_storeu_ps(pb[r], plo);
        _mm256_storeu_ps(pb[r] + 8, phi);
      }
    }
    // O += P V, 8 dims and 8 keys at a time (their V in registers), two chains per row.
    for (int64_t d = 0; d < D; d += 8)
      for (int half = 0; half < halves; ++half) {
        __m256 w[8];
        for (int j = 0; j < 8; ++j) {
          const uint16_t* row = vrow[8 * half + j];
          w[j] = row ? load_bf16(row + d) : _mm256_setzero_ps();
        }
        for (int64_t r = 0; r < R; ++r) {
          const float* pr = pb[r] + 8 * half;
          __m256 a = _mm256_loadu_ps(O + r * D + d), b = _mm256_setzero_ps();
          for (int j = 0; j < 8; j += 2) {
            a = _mm256_fmadd_ps(_mm256_broadcast_ss(pr + j), w[j], a);
            b = _mm256_fmadd_ps(_mm256_broadcast_ss(pr + j + 1), w[j + 1], b);
          }
          _mm256_storeu_ps(O + r * D + d, _mm256_add_ps(a, b));
        }
      }
  }
}

// O's row scaled by inv, as bf16.
inline void write_row(const float* o, float inv, int64_t D, c10::BFloat16* out) {
  for (int64_t d = 0; d < D; d += 8)
    minisgl_vec::store_bf16(out + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), _mm256_set1_ps(inv)));
}

#endif  // the builds

bool available() { return MINISGL_ATTN_ANY; }
bool int8_kv() { return MINISGL_ATTN_ANY; }  // whether paged_attention reads int8 pools

// The leading slots two slot rows have in common, within their first n, in whole key blocks:
// compared 256 slots at a time, then the first unequal span block by block (a slot at a time,
// 64 decode requests' rows of ~1,100 slots took ~40 us per layer to compare).
int64_t common_blocks(const int64_t* a, const int64_t* b, int64_t n) {
  constexpr int64_t kSpan = 16 * KB;
  int64_t j = 0;
  while (j + kSpan <= n && std::memcmp(a + j, b + j, kSpan * sizeof(int64_t)) == 0) j += kSpan;
  while (j + KB <= n && std::memcmp(a + j, b + j, KB * sizeof(int64_t)) == 0) j += KB;
  return j;
}

#if MINISGL_ATTN_ANY
struct Group {  // decode requests order[i .. j) share their first `common` slots
  int64_t i, j, common;
};
// A call's bookkeeping, kept per calling thread from call to call (cleared, not freed): a
// batch-1 decode step called this 30 times, each with ~18 allocations of it (several past
// malloc's per-thread cache: the threads' O buffers are 12 KB) on the main thread between the
// layers' weight streams.
struct CallScratch {
  std::vector<Item> items;
  std::vector<int64_t> members, shared, order, run_end, from, of, fill;
  std::vector<Group> groups;
  std::vector<float> kept;  // the split-K parts
};
#endif

// out [T, H, D] = attention of q [T, H, D] (bf16 rows back to back) over the pool k, v; the rest
// as the paged_attention op, whose checks of q's tensor the caller has made. split_threads (0:
// this call's at::get_num_threads()): the thread count that decides how far decode requests'
// keys are split (split-K; a shared prefix's pieces), which changes the order of the sums: an
// engine passes its own, so that a step it runs on fewer threads (minisgl/core/threads.py, the
// thread tuner) sums as every other step does and gives the same numbers to the bit.
void attention_into(const c10::BFloat16* qp, int64_t T, int64_t H, int64_t Dq,
                    const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                    const at::Tensor& kv_lens, const at::Tensor& q_start,
                    const at::Tensor& q_lens, double scale, int64_t window, c10::BFloat16* op,
                    int64_t split_threads = 0) {
  TORCH_CHECK(MINISGL_ATTN_ANY, "paged_attention needs AVX2 with FMA (or AVX512-BF16)");
  const bool q8 = k.scalar_type() == at::kChar;
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.is_contiguous() && v.is_contiguous() &&
                  (k.scalar_type() == at::kBFloat16 || q8) &&
                  v.scalar_type() == k.scalar_type() && k.sizes() == v.sizes(),
              "k, v: contiguous bfloat16 [KVH, S, D] (or int8 [KVH, S, D + 4]) of one shape");
  TORCH_CHECK(k.size(2) == (q8 ? Dq + 4 : Dq), "head_dim / pool shapes differ");
  TORCH_CHECK(Dq % 32 == 0 && Dq <= 256, "head_dim must be a multiple of 32, <= 256");
  TORCH_CHECK(H % k.size(0) == 0 && H / k.size(0) <= 8,
              "query heads must be 1-8 times the kv heads");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: no sliding window), got ", window);
  TORCH_CHECK(scale > 0, "scale must be > 0, got ", scale);
  TORCH_CHECK(split_threads >= 0, "threads must be >= 0 (0: the call's), got ", split_threads);
  for (const at::Tensor* t : {&slots, &kv_lens, &q_start, &q_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "index tensors: contiguous int64");
  const int64_t B = slots.size(0);
  TORCH_CHECK(slots.dim() == 2 && kv_lens.numel() == B && q_start.numel() == B && q_lens.numel() == B,
              "slots: [B, Lk]; kv_lens, q_start, q_lens: [B]");
#if MINISGL_ATTN_ANY
  const int64_t D = Dq, KVH = k.size(0), S = k.size(1), G = H / KVH;
  const int64_t Dr = pool_row(D, q8);
  const int64_t Lk = slots.size(1);
  const int64_t* kl = kv_lens.data_ptr<int64_t>();
  const int64_t* qs = q_start.data_ptr<int64_t>();
  const int64_t* ql = q_lens.data_ptr<int64_t>();
  int64_t max_q = 0, max_kv = 0, work = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(ql[b] >= 0 && ql[b] <= kl[b] && kl[b] <= Lk && qs[b] >= 0 && qs[b] + ql[b] <= T,
                "request ", b, ": bad lengths");
    max_q = std::max(max_q, ql[b]);
    max_kv = std::max(max_kv, kl[b]);
    work += (ql[b] + QB - 1) / QB * KVH;
  }
  // Few items (small decode batches): split each request's keys so every thread has work (as
  // many threads as split_threads says: see above).
  const int64_t threads = at::get_num_threads();
  const int64_t for_threads = split_threads > 0 ? split_threads : threads;
  int64_t splits = 1;
  if (max_q == 1 && work < 4 * for_threads) {
    const int64_t keys = window > 0 ? std::min(max_kv, window) : max_kv;  // per query at most
    splits = std::clamp<int64_t>((4 * for_threads + work - 1) / work, 1,
                                 std::max<int64_t>(1, keys / 64));
  }
  // (references bound on this thread: the other threads would see their own by the name)
  static thread_local CallScratch call_scratch;
  CallScratch& cs = *minisgl::opaque(&call_scratch);
  auto& items = cs.items;
  auto& members = cs.members;
  auto& shared = cs.shared;  // keys of request b run in its group's shared items
  items.clear();
  members.clear();
  shared.assign(B, 0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  int64_t parts = 0;
  if (max_q == 1 && window == 0) {
    // Decode requests whose slot rows start alike share a cached prefix: its K/V blocks are
    // loaded and transposed once for the queries of up to QB requests instead of once each.
    auto& order = cs.order;  // (requests with a query)
    order.clear();
    for (int64_t b = 0; b < B; ++b)
      if (ql[b] > 0) order.push_back(b);
    const int64_t BQ = static_cast<int64_t>(order.size());
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return sp[a * Lk] < sp[b * Lk]; });
    auto& groups = cs.groups;
    groups.clear();
    int64_t whole = 0;  // shared items with each group's keys in one piece
    for (int64_t i = 0, j; i < BQ; i = j) {
      const int64_t* first = sp + order[i] * Lk;
      int64_t common = kl[order[i]] / KB * KB;
      for (j = i + 1; j < BQ && sp[order[j] * Lk] == first[0]; ++j)
        common = common_blocks(first, sp + order[j] * Lk, std::min(common, kl[order[j]]));
      if (j - i < 2 || common < 2 * KB) continue;
      groups.push_back({i, j, common});
      whole += (j - i + QB - 1) / QB * KVH;
    }
    // Split the shared keys only as far as the threads need (4 items each): every piece is one
    // more part per member to merge, and one more pass over its queries' setup.
    const int64_t pieces =
        std::max<int64_t>(1, (4 * for_threads + whole - 1) / std::max<int64_t>(1, whole));
    for (const Group& gr : groups) {
      const int64_t chunk = std::max<int64_t>(
          16 * KB, ((gr.common + pieces - 1) / pieces + 4 * KB - 1) / (4 * KB) * (4 * KB));
      for (int64_t g0 = gr.i; g0 < gr.j; g0 += QB) {
        const int64_t m0 = static_cast<int64_t>(members.size());
        const int64_t mn = std::min<int64_t>(QB, gr.j - g0);
        members.insert(members.end(), order.begin() + g0, order.begin() + g0 + mn);
        for (int64_t h = 0; h < KVH; ++h)
          for (int64_t k0 = 0; k0 < gr.common; k0 += chunk, parts += mn)
            items.push_back({order[g0], h, 0, mn, k0, std::min(gr.common, k0 + chunk), parts, m0, mn});
      }
      for (int64_t t = gr.i; t < gr.j; ++t) shared[order[t]] = gr.common;
    }
  }
  for (int64_t b = 0; b < B; ++b) {
    if (shared[b] > 0) {  // the request's own keys, merged with its group's parts
      for (int64_t h = 0; h < KVH; ++h) items.push_back({b, h, 0, 1, shared[b], kl[b], parts++});
      continue;
    }
    const int64_t prefix = kl[b] - ql[b];
    for (int64_t h = 0; h < KVH; ++h)
      for (int64_t q0 = 0; q0 < ql[b]; q0 += QB) {
        const int64_t nq = std::min<int64_t>(QB, ql[b] - q0);
        const int64_t end = prefix + q0 + nq;  // keys the block's last query sees
        // and the first one its first query sees
        const int64_t begin = window > 0 ? std::max<int64_t>(0, prefix + q0 + 1 - window) : 0;
        if (splits == 1) {
          items.push_back({b, h, q0, nq, begin, end, -1});
          continue;
        }
        const int64_t chunk = ((end - begin + splits - 1) / splits + KB - 1) / KB * KB;
        for (int64_t k0 = begin; k0 < end; k0 += chunk)
          items.push_back({b, h, q0, nq, k0, std::min(end, k0 + chunk), parts++});
      }
  }
  if (max_q > 1) {
    // Items of one kv head and one (shared) prefix back to back, so that its keys stay in cache
    // from one item to the next (a 1024-key prefix of one kv head is 256 KB of blocks, read from
    // memory per item otherwise: 8 groups of 7 requests extending 64 tokens past their group's
    // 1024 keys, 17.2 -> 15.4 ms per layer); within them longest first: causal items differ in
    // cost and are handed out one at a time.
    auto first = [&](const Item& it) { return sp[it.b * Lk]; };
    std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
      if (a.h != b.h) return a.h < b.h;
      if (first(a) != first(b)) return first(a) < first(b);
      return a.k1 - a.k0 > b.k1 - b.k0;
    });
  } else {  // decode: requests that start on the same page (a shared prefix) back to back, so
            // its K/V is still in cache for the next one (the threads take neighbouring items)
    auto first = [&](const Item& it) { return sp[it.b * Lk + it.k0]; };
    std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
      return a.h != b.h ? a.h < b.h : first(a) < first(b);
    });
  }
#if MINISGL_ATTN_AMX
  Blocks blocks;  // prefill / extend on tiles: every key block loaded once (see Blocks)
  const bool cached = max_q > 1 && window == 0 && !q8 && minisgl::amx_usable();
  if (cached) build_blocks(blocks, k, v, sp, Lk, kl, ql, B, G, KVH, D);
  const Blocks* bp = cached ? &blocks : nullptr;
#endif
  const int64_t stride = G * (D + 2);  // a part: m[G], l[G], O[G, D] (decode: one query)
  // (every part is written before it is read)
  cs.kept.resize(parts * stride);
  float* const part = cs.kept.data();
  // (an int8 pool's rows too: run_item reads them through uint16 pointers, see load_block)
  const auto* kp = static_cast<const c10::BFloat16*>(k.const_data_ptr());
  const auto* vp = static_cast<const c10::BFloat16*>(v.const_data_ptr());
  const float fscale = static_cast<float>(scale);
  // Threads claim runs of consecutive items of about equal work (keys x rows, and a block's
  // worth per item for its setup), 16 runs per thread, one atomic per run: each claim moves the
  // counter's cache line between cores (~100 ns; a third of the samples for 64 decode requests'
  // 192 items of one block each, when claimed one by one). The counter has its line to itself.
  const int64_t n_items = static_cast<int64_t>(items.size());
  auto& run_end = cs.run_end;  // run r: items run_end[r - 1] (0 for r = 0) .. run_end[r] - 1
  run_end.clear();
  {
    auto cost = [&](const Item& it) {
      return (it.k1 - it.k0 + KB) * std::max<int64_t>(it.nq, it.mn) * G;
    };
    int64_t total = 0, acc = 0;
    for (const Item& it : items) total += cost(it);
    const int64_t per = std::max<int64_t>(1, total / (16 * threads));
    for (int64_t i = 0; i < n_items; ++i) {
      acc += cost(items[i]);
      if (acc >= per || i + 1 == n_items) run_end.push_back(i + 1), acc = 0;
    }
  }
  const int64_t n_runs = static_cast<int64_t>(run_end.size());
  struct alignas(64) {
    std::atomic<int64_t> v{0};
  } next;
  minisgl::parallel_chunks(threads, [&](int64_t, int64_t) {
    static thread_local std::vector<float> O, m, l;  // this thread's (each one's own)
    O.resize(QB * G * D), m.resize(QB * G), l.resize(QB * G);
    // (a thread claims its next run before it starts one, so that it knows the item after each
    // of its items: see Ahead)
    for (int64_t run = next.v.fetch_add(1), after; run < n_runs; run = after) {
      after = next.v.fetch_add(1);
      for (int64_t i = run > 0 ? run_end[run - 1] : 0; i < run_end[run]; ++i) {
        const Item& it = items[i];
        Ahead ahead;  // decode items only: a prefill's next item mostly reads blocks in cache
        const int64_t ni = i + 1 < run_end[run] ? i + 1 : after < n_runs ? run_end[after - 1] : -1;
        if (ni >= 0 && max_q == 1) {
          const Item& nx = items[ni];
          ahead = {reinterpret_cast<const uint16_t*>(kp) + nx.h * S * Dr,
                   reinterpret_cast<const uint16_t*>(vp) + nx.h * S * Dr, sp + nx.b * Lk, nx.k0,
                   std::min(nx.k1, nx.k0 + kL2Ahead * KB), Dr, q8};
        }
        const int64_t prefix = kl[it.b] - ql[it.b];
        float* Ob = O.data();
        float* mb = m.data();
        float* lb = l.data();
        if (it.part >= 0 && it.mn == 0) {
          mb = part + it.part * stride;
          lb = mb + G;
          Ob = lb + G;
        }
#if MINISGL_ATTN_AMX
        // (O is the thread's [QB * G, D] buffer, room for the rows rounded up to 16, unless the
        // item is one request's split-K part; a shared-prefix item's parts are copied out after)
        if (it.nq * G >= 16 && (it.part < 0 || it.mn > 0) && !q8 && minisgl::amx_usable())
          run_item_amx(it, qp, kp, vp, sp, Lk, prefix, qs[it.b], members.data(), qs, H, S, G, D,
                       fscale, window, Ob, mb, lb, bp);
        else
#endif
          run_item(it, qp, kp, vp, sp, Lk, prefix, qs[it.b], members.data(), qs, H, S, G, D,
                   fscale, window, Ob, mb, lb, ahead, it.part < 0 || it.mn > 0, q8);
        for (int64_t j = 0; j < it.mn; ++j) {  // a shared item's rows to its members' parts
          float* dst = part + (it.part + j) * stride;
          std::copy(mb + j * G, mb + (j + 1) * G, dst);
          std::copy(lb + j * G, lb + (j + 1) * G, dst + G);
          std::copy(Ob + j * G * D, Ob + (j + 1) * G * D, dst + 2 * G);
        }
        if (it.part >= 0) continue;
        for (int64_t r = 0; r < it.nq * G; ++r) {
          const int64_t row = qs[it.b] + it.q0 + r / G, head = it.h * G + r % G;
          write_row(Ob + r * D, lb[r] > 0.f ? 1.f / lb[r] : 0.f, D, op + (row * H + head) * D);
        }
      }
    }
  });
  if (parts > 0) {  // merge the split-K parts of each (request, kv head); decode only
    // the parts of (request, kv head) bh: of[from[bh] .. from[bh + 1])
    auto& from = cs.from;
    auto& of = cs.of;
    auto& fill = cs.fill;
    from.assign(B * KVH + 1, 0);
    of.resize(parts);
    auto each_part = [&](auto fn) {
      for (const Item& it : items) {
        if (it.mn > 0) {
          for (int64_t j = 0; j < it.mn; ++j) fn(members[it.m0 + j] * KVH + it.h, it.part + j);
        } else if (it.part >= 0) {
          fn(it.b * KVH + it.h, it.part);
        }
      }
    };
    each_part([&](int64_t bh, int64_t) { ++from[bh + 1]; });
    for (int64_t bh = 0; bh < B * KVH; ++bh) from[bh + 1] += from[bh];
    fill.assign(from.begin(), from.end() - 1);
    each_part([&](int64_t bh, int64_t pi) { of[fill[bh]++] = pi; });
    // a few (request, kv head) pairs (batch-1 decode: SmolLM2's 3) merge on this thread: a
    // parallel region costs more than their G x parts x D multiply-adds
    at::parallel_for(0, B * KVH, 8, [&](int64_t begin, int64_t end) {
      float res[MAXD];
      for (int64_t bh = begin; bh < end; ++bh) {
        if (from[bh] == from[bh + 1]) continue;  // written directly
        const int64_t b = bh / KVH, h = bh % KVH;
        const auto mine = std::span(of).subspan(from[bh], from[bh + 1] - from[bh]);
        for (int64_t g = 0; g < G; ++g) {
          float mx = NEG_INF, sum = 0.f;
          for (int64_t pi : mine) mx = std::max(mx, part[pi * stride + g]);
          std::fill(res, res + D, 0.f);
          for (int64_t pi : mine) {
            const float* pm = part + pi * stride;
            if (pm[g] == NEG_INF) continue;
            const float w = std::exp(pm[g] - mx);
            sum += w * pm[G + g];
            for (int64_t d = 0; d < D; ++d) res[d] += w * pm[2 * G + g * D + d];
          }
          write_row(res, sum > 0.f ? 1.f / sum : 0.f, D, op + (qs[b] * H + h * G + g) * D);
        }
      }
    });
  }
#endif
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& slots, const at::Tensor& kv_lens,
                           const at::Tensor& q_start, const at::Tensor& q_lens, double scale,
                           int64_t window, int64_t threads) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kBFloat16,
              "q: contiguous bfloat16 [T, H, D]");  // (k and v: attention_into)
  auto out = at::empty(q.sizes(), q.options());
  attention_into(q.const_data_ptr<c10::BFloat16>(), q.size(0), q.size(1), q.size(2), k, v, slots,
                 kv_lens, q_start, q_lens, scale, window, out.mutable_data_ptr<c10::BFloat16>(),
                 threads);
  return out;
}

}  // namespace

void minisgl::paged_attention_into(const c10::BFloat16* q, int64_t T, int64_t H, int64_t D,
                                   const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& slots, const at::Tensor& kv_lens,
                                   const at::Tensor& q_start, const at::Tensor& q_lens,
                                   double scale, int64_t window, c10::BFloat16* out,
                                   int64_t split_threads) {
  attention_into(q, T, H, D, k, v, slots, kv_lens, q_start, q_lens, scale, window, out,
                 split_threads);
}

TORCH_LIBRARY(minisgl_cpu, m) {
  m.def("available() -> bool", &available);
  m.def("int8_kv() -> bool", &int8_kv);
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor kv_lens, "
        "Tensor q_start, Tensor q_lens, float scale, int window=0, int threads=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(minisgl_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
