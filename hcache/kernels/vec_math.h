// Vector math our AVX-512 kernels share.
#pragma once

#include <immintrin.h>

namespace hcache {

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

}  // namespace hcache
