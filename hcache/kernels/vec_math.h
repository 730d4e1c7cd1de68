// Vector math our kernels share: AVX-512 forms, and AVX2 ones that give the same bits.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace hcache {

#ifdef __AVX512F__
// 2**x = 2**n * 2**f, n = round(x), |f| <= 1/2 (Cephes' exp2f polynomial); scalef
// takes any n, so a very negative x gives 0. Lanes outside `keep` are 0 whatever x holds
// there (-inf or NaN included)
inline __m512 exp2_ps(__m512 x, __mmask16 keep = 0xFFFF) {
  __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

#endif

// Lanes 0..n-1 of 8 all ones, the rest zero (none for n <= 0): a partial vector's mask
inline __m256i first8(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// The polynomial of `exp2_ps` at f = x - round(x), in vectors of 8
inline __m256 exp2_poly(__m256 f) {
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
  return _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
}

inline __m256 pow2(__m256 n) {  // 2**n for an integral n in [-126, 127], from its exponent bits
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}

// `exp2_ps` in AVX2, to its bits: scalef's p * 2**n as p * 2**a (exact: a keeps it normal)
// times 2**(n - a), which rounds once as scalef does, to a subnormal, 0 or infinity
inline __m256 exp2_ps(__m256 x) {
  const __m256 r = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 p = exp2_poly(_mm256_sub_ps(x, r));
  // past these, p * 2**n is 0 or infinite whatever p is (p in [0.7, 1.42])
  const __m256 n = _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-226.f)), _mm256_set1_ps(254.f));
  const __m256 a = _mm256_min_ps(_mm256_max_ps(n, _mm256_set1_ps(-100.f)), _mm256_set1_ps(127.f));
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2(a)), pow2(_mm256_sub_ps(n, a)));
}

}  // namespace hcache
