// Vector helpers shared by the kernels: exp16 / exp8, exp of 16 (AVX-512) or 8 (AVX2 with FMA)
// float32 lanes at once, for the softmax-like sums of cpu_attention.cpp and cpu_sample.cpp and
// the SiLU of cpu_linear.cpp (silu_mul16 / silu_mul8); exp2_16, a shorter 2^t for the attention's
// softmax in lanes and on tiles, whose p are rounded to bf16; and the AVX2 build's bf16 <-> float32
// conversions and horizontal reductions (AVX-512 has them as instructions). Include only where
// one of the two is available.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace minisgl_vec {

// exp(x) for x <= 0: 2^(x log2 e) = 2^n * 2^f, |f| <= 0.5, x clamped at -87 (2^n normal), and
// 2^f by a degree-6 polynomial (rel. err ~1e-7), its coefficients highest first (Horner).
constexpr float kClamp = -87.f, kLog2e = 1.44269504088896341f;
constexpr float kPoly[] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                           5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f,
                           1.f};

#if defined(__AVX512F__)
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kClamp));
  __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(kLog2e));
  __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(kPoly[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kPoly[i]));
  return _mm512_scalef_ps(p, n);
}

// 2^t for finite t (the softmax's scores less their reference max; the callers mask the lanes
// a row does not see, whatever 2^t gave there): t = n + f, n = floor(t), 0 <= f < 1 in one
// vreduceps, 2^f by a degree-3 polynomial (rel. err 7.5e-5, far below P's bf16 rounding, 2^-9;
// exp16's is degree 6), 2^n by vscalefps, which floors t itself. 5 vector ops against exp16's 11
// (no clamp; the caller folds log2 e into its FMA). (On tiles, against n = round(t) and degree
// 4, 7 ops: the 1024-token prefill's attention ~3% faster.)
inline __m512 exp2_16(__m512 t) {
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(7.802452892065048e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.2606714069843292e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.958335638046265e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999251961708069e-1f));
  return _mm512_scalef_ps(p, t);
}

#if defined(__AVX512BF16__)
// silu(g) rounded to bf16, times u (g and u bf16 values as float32): what F.silu(g) * u gives on
// bf16 tensors, before its final rounding. sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e)
// below, e = e^-|g| (exp16 only sees x <= 0).
inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.f);
  const __m512 e = exp16(_mm512_sub_ps(zero, _mm512_abs_ps(g)));
  const __mmask16 neg = _mm512_cmp_ps_mask(g, zero, _CMP_LT_OQ);
  const __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(neg, one, e), _mm512_add_ps(one, e));
  const __m512 silu = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(_mm512_mul_ps(g, sig)));
  return _mm512_mul_ps(silu, u);
}
#endif
#endif

#if defined(__AVX2__) && defined(__FMA__)
// The same on 8 lanes; 2^n by adding n to the exponent field.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(kClamp));
  __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(kLog2e));
  __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(kPoly[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kPoly[i]));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                           _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

// 8 bf16 as float32 (a bf16 is the top half of a float32), from p[0 .. n) with zeros past n.
inline __m256 widen8(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load_bf16(const void* p) {
  return widen8(_mm_loadu_si128(static_cast<const __m128i*>(p)));
}
inline __m256 load_bf16(const void* p, int64_t n) {
  if (n >= 8) return load_bf16(p);
  alignas(16) uint16_t t[8] = {};
  std::memcpy(t, p, n * sizeof(uint16_t));
  return widen8(_mm_load_si128(reinterpret_cast<const __m128i*>(t)));
}

// The bf16 nearest each lane (to nearest even, as c10 rounds: x + 0x7FFF + (x >> 16 & 1), then
// the top half; NaN stays a quiet NaN), in the low 16 bits of each 32-bit lane.
inline __m256i bf16_bits(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i top = _mm256_srli_epi32(u, 16);
  const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                                        _mm256_and_si256(top, _mm256_set1_epi32(1)));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_or_si256(top, _mm256_set1_epi32(0x40)), nan);
}
// ... as 8 packed bf16
inline __m128i to_bf16(__m256 v) {
  // 8 x 32-bit -> 8 x 16-bit (values < 2^16: packus keeps them), lanes back in order
  const __m256i r = bf16_bits(v);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}
// ... as float32 again (what a bf16 tensor holds after the operation)
inline __m256 rounded(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16));
}
// v rounded to bf16 into p[0 .. n) (n >= 8: all 8)
inline void store_bf16(void* p, __m256 v, int64_t n = 8) {
  const __m128i h = to_bf16(v);
  if (n >= 8) {
    _mm_storeu_si128(static_cast<__m128i*>(p), h);
    return;
  }
  alignas(16) uint16_t t[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(t), h);
  std::memcpy(p, t, n * sizeof(uint16_t));
}

// silu_mul16 on 8 lanes
inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  const __m256 e = exp8(_mm256_sub_ps(zero, _mm256_andnot_ps(sign, g)));
  const __m256 neg = _mm256_cmp_ps(g, zero, _CMP_LT_OQ);
  const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(one, e, neg), _mm256_add_ps(one, e));
  return _mm256_mul_ps(rounded(_mm256_mul_ps(g, sig)), u);
}

// Horizontal sum and max of 8 lanes (pairwise: lanes i and i + 4, then i + 2, then i + 1).
inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
inline float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
#endif

}  // namespace minisgl_vec
