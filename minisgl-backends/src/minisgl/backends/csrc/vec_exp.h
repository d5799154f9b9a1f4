// exp16 / exp8: exp of 16 (AVX-512) or 8 (AVX2 with FMA) float32 lanes at once, for the
// softmax-like sums of cpu_attention.cpp and cpu_sample.cpp. Include only where one of them is
// available.
#pragma once

#include <immintrin.h>

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
#endif

}  // namespace minisgl_vec
