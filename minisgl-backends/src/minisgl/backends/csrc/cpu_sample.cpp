// argmax_logsumexp: what the sampler needs of every row of float32 logits [M, V] at once, the
// index of the row's first maximum (the greedy token) and its log-sum-exp (the log-probability
// denominator), registered with minisgl.core.sampling.register_argmax_logsumexp.
//
// ATen does this in ~8 operators (two-level argmax, logsumexp, a gather), each a dispatch and a
// pass over the row. Right after a decode step the caches hold the last weights streamed, so
// each of those small operators ran from cold code and data: on AMD Zen 4 they took ~0.4 ms for
// one SmolLM2 row (V = 49,152) after the forward, against ~0.1 ms warm. Here: one call, two
// passes over the row (the max, then the first index of it and the sum of exp(x - max)).
//
// Same semantics as torch.argmax and torch.logsumexp: the first maximum; a NaN counts as the
// maximum (its index, NaN log-sum-exp); +inf gives +inf; a row of -inf gives -inf.

// sample_rows: a sampled (temperature > 0) row's token, with its top-k, top-p and min-p filters,
// registered with minisgl.core.sampling.register_sample_rows: the same token as the torch path
// (softmax, filter_probs' sort of the whole row, sampling.race), up to float rounding at a near
// tie. Why: that sort took ~8 ms per SmolLM2 row (V = 49,152) on AMD Zen 4, and a row at
// temperature alone (softmax, a uniform per token from the request's generator, the race) ~0.75
// ms: a 32-request decode step spent 113 ms sampling with top_p against ~40 ms in the forward.
// Here a row is a few passes over V:
//
//   x = logits / T (its max m), e = exp(x - m) and their sum Z (float64)
//   top-k / top-p: the tokens with e >= c, first c = 2^-10, until those hold the whole answer
//     (the top k of them; or the prefix whose mass above the last kept token stays under top_p,
//     ending before the candidates do): else the floor of the power-of-two band where the
//     row's count reaches k (top-k from k = 128; a smaller k 2^-20, 2^-40, 0) or its mass
//     top_p (top-p); the top k selected (nth_element), the top-p prefix selected on its mass
//     (top_p_prefix), neither sorted
//   min-p: e >= min_p (e is relative to the top token's)
//   the race: argmax e_i / q_i over the kept tokens, q_i = -log(1 - u_i) with u_i sampling.py's
//     hash of (row key, i); token i is skipped unless e_i >= u_i * best (q_i >= u_i), the top
//     token first, so the log is taken for a few tokens only (where every token may win, no
//     top-k nor top-p, in a vector pass over the row)
//
// A row with NaN or infinite x is left to the torch path (-1).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define MINISGL_SAMPLE_FAST 1
#include <immintrin.h>

#include "vec.h"
#else
#define MINISGL_SAMPLE_FAST 0
#endif

namespace {

#if MINISGL_SAMPLE_FAST

// A row with a NaN, +inf or only -inf (rare): the plain loop.
void special_row(const float* x, int64_t V, float mx, int64_t* index, float* lse) {
  int64_t at = 0;
  for (int64_t k = 0; k < V; ++k) {
    if (std::isnan(x[k])) { at = k; break; }
    if (x[k] > x[at]) at = k;
  }
  *index = at;
  *lse = std::isnan(x[at]) ? x[at] : mx;
}

#endif

#if defined(__AVX512F__)

inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

void one_row(const float* x, int64_t V, int64_t* index, float* lse) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  for (int64_t k = 0; k < V; k += 16) {
    const __mmask16 m = tail_mask(V - k);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + k);
    nan |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
    vmax = _mm512_mask_max_ps(vmax, m, vmax, v);  // lanes past V keep -inf, not 0
  }
  const float mx = _mm512_reduce_max_ps(vmax);
  if (nan || !std::isfinite(mx)) return special_row(x, V, mx, index, lse);
  const __m512 vm = _mm512_set1_ps(mx);
  __m512 sum = _mm512_setzero_ps();
  int64_t first = -1;
  for (int64_t k = 0; k < V; k += 16) {
    const __mmask16 m = tail_mask(V - k);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + k);
    if (first < 0) {
      const __mmask16 eq = _mm512_mask_cmp_ps_mask(m, v, vm, _CMP_EQ_OQ);
      if (eq) first = k + __builtin_ctz(eq);
    }
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, minisgl_vec::exp16(_mm512_sub_ps(v, vm))));
  }
  *index = first;
  *lse = mx + std::log(_mm512_reduce_add_ps(sum));
}

#elif MINISGL_SAMPLE_FAST  // AVX2: 8 lanes, the last V % 8 entries one by one

void one_row(const float* x, int64_t V, int64_t* index, float* lse) {
  const int64_t V8 = V / 8 * 8;
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 nan = _mm256_setzero_ps();
  for (int64_t k = 0; k < V8; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    vmax = _mm256_max_ps(vmax, v);
  }
  float mx = minisgl_vec::hmax8(vmax);
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t k = V8; k < V; ++k) {
    any_nan |= std::isnan(x[k]);
    mx = std::max(mx, x[k]);
  }
  if (any_nan || !std::isfinite(mx)) return special_row(x, V, mx, index, lse);
  const __m256 vm = _mm256_set1_ps(mx);
  __m256 sum = _mm256_setzero_ps();
  int64_t first = -1;
  for (int64_t k = 0; k < V8; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    if (first < 0) {
      const int eq = _mm256_movemask_ps(_mm256_cmp_ps(v, vm, _CMP_EQ_OQ));
      if (eq) first = k + __builtin_ctz(eq);
    }
    sum = _mm256_add_ps(sum, minisgl_vec::exp8(_mm256_sub_ps(v, vm)));
  }
  float total = minisgl_vec::hsum8(sum);
  for (int64_t k = V8; k < V; ++k) {
    if (first < 0 && x[k] == mx) first = k;
    total += std::exp(x[k] - mx);
  }
  *index = first;
  *lse = mx + std::log(total);
}

#endif

std::tuple<at::Tensor, at::Tensor> argmax_logsumexp(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "x must be float32 [M, V] with V > 0");
  at::Tensor index = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  at::Tensor lse = at::empty({x.size(0)}, x.options());
#if MINISGL_SAMPLE_FAST
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t M = xc.size(0), V = xc.size(1), stride = xc.stride(0);
  const float* xp = xc.const_data_ptr<float>();
  int64_t* ip = index.mutable_data_ptr<int64_t>();
  float* lp = lse.mutable_data_ptr<float>();
  // one row (a batch-1 decode step) is ~15 us of work: threads only from two rows up
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) one_row(xp + m * stride, V, ip + m, lp + m);
  });
#else
  TORCH_CHECK(false, "argmax_logsumexp needs AVX-512 or AVX2 with FMA");
#endif
  return {index, lse};
}


// --- sample_rows ------------------------------------------------------------------------------

// MurmurHash3's finaliser; token i's bits under key k (sampling.py's token_uniforms)
inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}
inline uint32_t token_bits(uint32_t i, uint32_t k1, uint32_t k2) {
  return fmix32(fmix32(i + k1) ^ k2);
}
// q ~ Exp(1) from the bits: -log(1 - u), u = (h + 1/2) / 2^32
inline double exp_draw(uint32_t h) {
  return -std::log1p(-(static_cast<double>(h) + 0.5) * 0x1p-32);
}

#if MINISGL_SAMPLE_FAST

// 8 tokens' bits at once (AVX2; the AVX-512 build runs it too)
inline __m256i fmix8(__m256i h) {
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(0x85EBCA6Bu)));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(0xC2B2AE35u)));
  return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}

struct Cand {
  float x;  // logit / T: the order (then the lower index first, as a stable sort)
  int32_t i;
};

struct Race {  // the best e_i / q_i so far; ties go to the lower index (the first maximum)
  uint32_t k1, k2;
  double best = -1.0;
  int64_t at = -1;
  void consider(int64_t i, float e) { take(i, e, token_bits(static_cast<uint32_t>(i), k1, k2)); }
  // consider, where token i can win: e_i / q_i >= best needs e_i >= u_i * best (q_i >= u_i),
  // u_i from the bits' top 31 (the bound rounded down by a 2^-20 margin); the log is the cost
  void bounded(int64_t i, float e) {
    const uint32_t h = token_bits(static_cast<uint32_t>(i), k1, k2);
    if (static_cast<double>(e) >= best * (1.0 - 0x1p-20) * (static_cast<double>(h >> 1) * 0x1p-31))
      take(i, e, h);
  }
  void take(int64_t i, float e, uint32_t h) {
    const double r = static_cast<double>(e) / exp_draw(h);
    if (r > best || (r == best && i < at)) best = r, at = i;
  }
};

// The race over every token with e >= floor (min_p; 0: all), 8 at a time: a token can beat
// `best` only if e_i > u_i * best, as q_i >= u_i; u from the bits' top 31 (rounded at most
// 2^-24 up, covered with best's, the product's and a 2^-20 margin).
int64_t race_all(const float* e, int64_t V, float floor, int64_t top, Race& race) {
  race.consider(top, e[top]);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i k1 = _mm256_set1_epi32(static_cast<int>(race.k1));
  const __m256i k2 = _mm256_set1_epi32(static_cast<int>(race.k2));
  const __m256 vfloor = _mm256_set1_ps(floor);
  __m256 bar = _mm256_set1_ps(static_cast<float>(race.best * (1.0 - 0x1p-20) * 0x1p-31));
  int64_t k = 0;
  for (; k + 8 <= V; k += 8) {
    const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(k)), lane);
    const __m256i h = fmix8(_mm256_xor_si256(fmix8(_mm256_add_epi32(idx, k1)), k2));
    const __m256 u = _mm256_cvtepi32_ps(_mm256_srli_epi32(h, 1));  // u * 2^31
    const __m256 ev = _mm256_loadu_ps(e + k);
    int hit = _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(ev, vfloor, _CMP_GE_OQ),
                                               _mm256_cmp_ps(ev, _mm256_mul_ps(u, bar), _CMP_GE_OQ)));
    if (hit == 0) continue;
    for (; hit != 0; hit &= hit - 1) {
      const int64_t i = k + __builtin_ctz(hit);
      race.consider(i, e[i]);
    }
    bar = _mm256_set1_ps(static_cast<float>(race.best * (1.0 - 0x1p-20) * 0x1p-31));
  }
  for (; k < V; ++k)
    if (e[k] >= floor) race.consider(k, e[k]);
  return race.at;
}

// A row's e by power-of-two band, band j holding e in [2^-j, 2^-j+1) (by its exponent bits,
// exactly; 0 and denormals in band 64): each band's mass (four interleaved tables keep the adds
// of neighbouring tokens off one dependency chain) and count, in one pass when first needed.
// The candidates' floors come from them: the largest 2^-j (j < 64) with the tokens at or above
// it holding `need` of mass (top-p) or k tokens (top-k, exact); 0 where none does.
constexpr int64_t kBandsTopK = 128;  // top-k from this k on takes the bands' floor (below)
struct Bands {
  bool filled = false;
  double mass[4][65];
  int64_t count[65];
  void fill(const float* e, int64_t V) {
    if (filled) return;
    std::memset(mass, 0, sizeof mass);
    std::memset(count, 0, sizeof count);
    for (int64_t k = 0; k < V; ++k) {
      uint32_t bits;
      std::memcpy(&bits, e + k, sizeof bits);
      const uint32_t j = std::min<uint32_t>(127u - (bits >> 23), 64u);
      mass[k & 3][j] += e[k];
      ++count[j];
    }
    filled = true;
  }
  float mass_floor(double need) const {
    double acc = 0.0;
    for (int j = 0; j < 64; ++j) {
      acc += mass[0][j] + mass[1][j] + mass[2][j] + mass[3][j];
      if (acc >= need) return std::ldexp(1.0f, -j);
    }
    return 0.f;
  }
  float count_floor(int64_t k) const {
    int64_t acc = 0;
    for (int j = 0; j < 64; ++j)
      if ((acc += count[j]) >= k) return std::ldexp(1.0f, -j);
    return 0.f;
  }
};

// The tokens with e >= c, with their x = logit / T for the order; returns their mass.
double gather(const float* e, const float* logit, float T, int64_t V, float c,
              std::vector<Cand>& out) {
  out.clear();
  const __m256 vc = _mm256_set1_ps(c);
  double held = 0.0;
  int64_t k = 0;
  for (; k + 8 <= V; k += 8)
    for (int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(e + k), vc, _CMP_GE_OQ));
         hit != 0; hit &= hit - 1) {
      const int64_t i = k + __builtin_ctz(hit);
      out.push_back({logit[i] / T, static_cast<int32_t>(i)});
      held += e[i];
    }
  for (; k < V; ++k)
    if (e[k] >= c) out.push_back({logit[k] / T, static_cast<int32_t>(k)}), held += e[k];
  return held;
}

// The candidates before one another: the larger x first, then the lower index (a stable sort's
// order of the row).
inline bool before(const Cand& a, const Cand& b) { return a.x > b.x || (a.x == b.x && a.i < b.i); }

// Top-p's prefix of c[0, n) in `before` order: a token is kept while the mass before it,
// over `mass`, is short of top_p. Reorders c so the kept ones come first (in no order) and
// returns how many; `above` gets their mass. A selection on the mass (quickselect: partition
// around a pivot, keep the side holding the boundary), not a sort: at temperature 1 / top_p
// 0.95 a row of the bench's prompts keeps ~3,600 tokens.
int64_t top_p_prefix(Cand* c, int64_t n, const float* e, double mass, double top_p,
                     double& above) {
  int64_t lo = 0, hi = n;  // c[0, lo) kept, c[hi, n) dropped
  above = 0.0;
  while (lo < hi) {
    const Cand a = c[lo], m = c[lo + (hi - lo) / 2], b = c[hi - 1];
    Cand p = m;  // the pivot: the median of the three
    if (before(a, m) != before(m, b)) p = before(a, b) == before(b, m) ? b : a;
    Cand* mid = std::partition(c + lo, c + hi, [&](const Cand& t) { return before(t, p); });
    std::iter_swap(mid, std::find_if(mid, c + hi, [&](const Cand& t) { return t.i == p.i; }));
    double g = 0.0;
    for (const Cand* t = c + lo; t < mid; ++t) g += e[t->i];
    if ((above + g) / mass < top_p) {  // the pivot is kept, and all before it
      above += g + e[p.i];
      lo = mid - c + 1;
    } else {
      hi = mid - c;
    }
  }
  return lo;
}

int64_t sample_row(const float* logit, int64_t V, float T, int64_t top_k, double top_p,
                   float min_p, uint64_t key, std::vector<float>& ebuf, std::vector<Cand>& cand) {
  ebuf.resize(V);
  float* e = ebuf.data();
  // x = logit / T (as torch divides) and its max; NaN or inf: torch's row
  const __m256 vt = _mm256_set1_ps(T);
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), nan = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= V; k += 8) {
    const __m256 x = _mm256_div_ps(_mm256_loadu_ps(logit + k), vt);
    _mm256_storeu_ps(e + k, x);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    vmax = _mm256_max_ps(vmax, x);
  }
  float m = minisgl_vec::hmax8(vmax);
  bool bad = _mm256_movemask_ps(nan) != 0;
  for (; k < V; ++k) {
    e[k] = logit[k] / T;
    bad |= std::isnan(e[k]);
    m = std::max(m, e[k]);
  }
  if (bad || !std::isfinite(m)) return -1;
  // e = exp(x - m) (1 at the max), Z = their sum, the first max's index
  const __m256 vm = _mm256_set1_ps(m);
  __m256d zlo = _mm256_setzero_pd(), zhi = _mm256_setzero_pd();
  int64_t top = -1;
  for (k = 0; k + 8 <= V; k += 8) {
    const __m256 x = _mm256_loadu_ps(e + k);
    if (top < 0) {
      const int eq = _mm256_movemask_ps(_mm256_cmp_ps(x, vm, _CMP_EQ_OQ));
      if (eq) top = k + __builtin_ctz(eq);
    }
    const __m256 ev = minisgl_vec::exp8(_mm256_sub_ps(x, vm));
    _mm256_storeu_ps(e + k, ev);
    zlo = _mm256_add_pd(zlo, _mm256_cvtps_pd(_mm256_castps256_ps128(ev)));
    zhi = _mm256_add_pd(zhi, _mm256_cvtps_pd(_mm256_extractf128_ps(ev, 1)));
  }
  alignas(32) double z4[4];
  _mm256_store_pd(z4, _mm256_add_pd(zlo, zhi));
  double Z = z4[0] + z4[1] + z4[2] + z4[3];
  for (; k < V; ++k) {
    if (top < 0 && e[k] == m) top = k;
    e[k] = std::exp(e[k] - m);
    Z += e[k];
  }
  Race race{static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32)};
  const int64_t K = top_k > 0 && top_k < V ? top_k : V;
  const bool use_p = top_p < 1.0;
  if (K == V && !use_p) return race_all(e, V, min_p, top, race);
  // Candidates: the tokens with e >= c, first c = 2^-10. Where the top k reach below c: for a
  // large k the band floor holding k tokens (the counts are exact), else 2^-20, 2^-40 and 0 (a
  // pass of compares costs less than the bands' pass, whose floor leaves fewer candidates: the
  // top 1,000 of SmolLM2's rows at temperature 1 are ~12,000 tokens at 2^-20). Where the top-p
  // prefix reaches below c, once, the band floor holding top_p of the mass, then (float sums
  // disagreeing at its edge) wider.
  auto wider = [](float c) { return c > 0x1p-20f ? 0x1p-20f : c > 0x1p-40f ? 0x1p-40f : 0.f; };
  float c = 0x1p-10f;
  bool banded = false;
  Bands bands;
  for (;;) {
    const double held = gather(e, logit, T, V, c, cand);
    const int64_t n = static_cast<int64_t>(cand.size());
    if (n < K && K < V && c > 0.f) {  // the top k reach below c
      if (K >= kBandsTopK && !bands.filled) {
        bands.fill(e, V);
        c = bands.count_floor(K);  // < c (c is a power of two or a band floor)
      } else {
        c = wider(c);
      }
      continue;
    }
    const int64_t kk = std::min(n, K);
    if (kk < n) std::nth_element(cand.begin(), cand.begin() + kk, cand.end(), before);
    int64_t keep = kk;
    if (use_p) {
      // With no top-k, candidates holding less than top_p of Z (by more than the sums'
      // rounding) are all kept and more past them: no need to select among them (the bench's
      // prompts at temperature 1 / top_p 0.95: ~700 candidates at 2^-10 holding ~87% of Z)
      bool past = K == V && n < V && held < top_p * Z * (1.0 - 0x1p-30);
      if (!past) {
        double mass = 0.0;  // the top k's (all tokens': Z)
        if (K < V)
          for (int64_t j = 0; j < K; ++j) mass += e[cand[j].i];
        else
          mass = Z;
        double above = 0.0;
        keep = top_p_prefix(cand.data(), kk, e, mass, top_p, above);
        past = keep == n && n < K && above / mass < top_p;
      }
      if (past) {  // more past the candidates
        // at temperature 1 / top_p 0.95 half of SmolLM2's rows: ~12,000 tokens at 2^-20,
        // ~700 at the band floor; once (float sums may disagree at its edge: then wider)
        float f = 0.f;
        if (!banded) {
          bands.fill(e, V);
          f = bands.mass_floor(top_p * Z * (1.0 + 0x1p-30));
          banded = true;
        }
        c = f > 0.f && f < c ? f : wider(c);
        continue;
      }
    }
    // the top token first (always kept: the first of `before`'s order, e = 1 >= min_p), so
    // that the bound skips the log for most of the others (~3,600 kept tokens at temperature 1 /
    // top_p 0.95 on the bench's prompts)
    race.consider(top, e[top]);
    for (int64_t j = 0; j < keep; ++j)
      if (e[cand[j].i] >= min_p) race.bounded(cand[j].i, e[cand[j].i]);
    return race.at;
  }
}

#endif

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature,
                       const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p,
                       const at::Tensor& keys) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "sample_rows: logits must be float32 [B, V] with V > 0");
  const int64_t B = logits.size(0), V = logits.size(1);
  auto check = [&](const at::Tensor& t, at::ScalarType type, const char* name) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == B && t.scalar_type() == type && t.is_contiguous(),
                "sample_rows: ", name, " must be a contiguous [B] ", c10::toString(type),
                " tensor");
  };
  check(temperature, at::kFloat, "temperature");
  check(top_k, at::kLong, "top_k");
  check(top_p, at::kDouble, "top_p");
  check(min_p, at::kFloat, "min_p");
  check(keys, at::kLong, "keys");
  TORCH_CHECK(V < (int64_t(1) << 31), "sample_rows: at most 2^31 - 1 columns");
  at::Tensor out = at::empty({B}, logits.options().dtype(at::kLong));
#if MINISGL_SAMPLE_FAST
  const at::Tensor x = logits.stride(1) == 1 ? logits : logits.contiguous();
  const float* xp = x.const_data_ptr<float>();
  const int64_t stride = x.stride(0);
  const float* tp = temperature.const_data_ptr<float>();
  const int64_t* kp = top_k.const_data_ptr<int64_t>();
  const double* pp = top_p.const_data_ptr<double>();
  const float* mp = min_p.const_data_ptr<float>();
  const int64_t* key = keys.const_data_ptr<int64_t>();
  int64_t* op = out.mutable_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(tp[b] > 0.f, "sample_rows: temperature must be > 0 (greedy rows take the argmax)");
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    static thread_local std::vector<float> e;
    static thread_local std::vector<Cand> cand;
    for (int64_t b = b0; b < b1; ++b)
      op[b] = sample_row(xp + b * stride, V, tp[b], kp[b], pp[b], mp[b],
                         static_cast<uint64_t>(key[b]), e, cand);
  });
#else
  TORCH_CHECK(false, "sample_rows needs AVX-512 or AVX2 with FMA");
#endif
  return out;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(minisgl_cpu, m) {
  m.def("argmax_logsumexp(Tensor x) -> (Tensor, Tensor)");
  m.def("sample_rows(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, "
        "Tensor min_p, Tensor keys) -> Tensor");
}

TORCH_LIBRARY_IMPL(minisgl_cpu, CPU, m) {
  m.impl("argmax_logsumexp", &argmax_logsumexp);
  m.impl("sample_rows", &sample_rows);
}
