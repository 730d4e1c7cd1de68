// Activation rows quantized to two int8 passes inside a kernel's call, as
// `quant.int8_rows_mm` does in the graph at 8 bits (7 for an LM head): the row at a
// power-of-two scale, then its remainder at the remainder's. Every step is exact (a
// power-of-two scale, a rounding to an integer, a remainder that float32 holds), so the bits
// equal the Python's. Quantizing inside the call leaves inductor no fused copy of the
// activations to round otherwise than eager code, and an eager turn no dozen small ops per
// linear.

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace hcache {

// `f(std::integral_constant<int, R>)` for R = min(left, MR): a GEMM's micro-kernel holds R
// activation rows in registers, so each row count up to MR is its own instantiation
template <int MR, typename F>
inline void with_rows(int left, F&& f) {
  if constexpr (MR > 1) {
    if (left < MR) return with_rows<MR - 1>(left, f);
  }
  f(std::integral_constant<int, MR>{});
}

#ifdef __AVX512F__
inline __mmask16 lanes_left(int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1); }

// 16 values (fewer under `mask`, the rest zero) as float32: float32 as they are, bfloat16
// (its bits as uint16) widened, which is exact
inline __m512 load16(const float* x, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, x); }
inline __m512 load16(const uint16_t* x, __mmask16 mask) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#else
// 8 values as float32 (bfloat16 widened, exactly); a row's last < 8 go through `scalar`
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const uint16_t* x) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#endif
inline float scalar(float x) { return x; }
inline float scalar(uint16_t x) {
  const uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The power of two that puts a row's largest magnitude in [2^(bits-2), 2^(bits-1)) steps: the
// float32 exponent field alone (a row of zeros takes 2^-100's)
template <typename T>
inline float pow2_scale(const T* x, int64_t k, int bits) {
  float amax = 0x1p-100f;
#ifdef __AVX512F__
  const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
  __m512 top = _mm512_setzero_ps();
  for (int64_t j = 0; j < k; j += 16) {
    const __m512 v = load16(x + j, lanes_left(k - j));
    top = _mm512_max_ps(top, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), magnitude)));
  }
  amax = std::max(_mm512_reduce_max_ps(top), amax);
#else
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 top = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= k; j += 8) top = _mm256_max_ps(top, _mm256_and_ps(load8(x + j), magnitude));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  for (float l : lanes) amax = std::max(amax, l);
  for (; j < k; ++j) amax = std::max(amax, std::fabs(scalar(x[j])));
#endif
  uint32_t exponent;
  std::memcpy(&exponent, &amax, 4);
  exponent &= 0x7F800000u;
  float p;
  std::memcpy(&p, &exponent, 4);
  return std::ldexp(p, -(bits - 2));
}

// `x` at scale `s` rounded to the nearest integer, ties to even, within +-top, into `q`
// (plus `offset`: 128 gives the unsigned form around its zero point); `rest` (optional)
// gets x - q * s
template <typename T>
inline void quantize(const T* x, float s, int64_t k, int8_t* q, float* rest, int8_t offset, float top) {
  int64_t j = 0;
#ifdef __AVX512F__
  const __m512 inv = _mm512_set1_ps(1.f / s), scale = _mm512_set1_ps(s);
  const __m512 lo = _mm512_set1_ps(-top), hi = _mm512_set1_ps(top);
  const __m128i shift = _mm_set1_epi8(offset);
  for (; j < k; j += 16) {
    const __mmask16 mask = lanes_left(k - j);
    const __m512 v = load16(x + j, mask);
    const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(v, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 c = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
    const __m128i b = _mm_add_epi8(_mm512_cvtepi32_epi8(_mm512_cvtps_epi32(c)), shift);
    _mm_mask_storeu_epi8(q + j, mask, b);
    if (rest != nullptr) _mm512_mask_storeu_ps(rest + j, mask, _mm512_sub_ps(v, _mm512_mul_ps(c, scale)));
  }
#else
  const __m256 inv = _mm256_set1_ps(1.f / s), scale = _mm256_set1_ps(s);
  const __m256 lo = _mm256_set1_ps(-top), hi = _mm256_set1_ps(top);
  const __m128i shift = _mm_set1_epi8(offset);
  for (; j + 8 <= k; j += 8) {
    const __m256 v = load8(x + j);
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(v, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 c = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
    const __m256i w = _mm256_cvtps_epi32(c);
    const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + j), _mm_add_epi8(_mm_packs_epi16(w16, w16), shift));
    if (rest != nullptr) _mm256_storeu_ps(rest + j, _mm256_sub_ps(v, _mm256_mul_ps(c, scale)));
  }
  for (; j < k; ++j) {  // the default rounding mode: to nearest, ties to even
    const float v = scalar(x[j]), c = std::min(std::max(std::nearbyint(v * (1.f / s)), -top), top);
    q[j] = int8_t(int(c) + offset);
    if (rest != nullptr) rest[j] = v - c * s;
  }
#endif
}

// Row `x` [k] in two passes of `bits` (sign included): `q1` at `*s1`, the remainder `q2` at
// `*s2`; `rest` is scratch of k
template <typename T>
inline void two_passes(const T* x, int64_t k, int8_t* q1, int8_t* q2, float* s1, float* s2, float* rest,
                       int8_t offset, int bits) {
  const float top = float((1 << (bits - 1)) - 1);
  *s1 = pow2_scale(x, k, bits);
  quantize(x, *s1, k, q1, rest, offset, top);
  *s2 = pow2_scale(rest, k, bits);
  quantize(rest, *s2, k, q2, static_cast<float*>(nullptr), offset, top);
}

// Every row of `x` (float32 or bfloat16 [m, k], contiguous) by `two_passes`: row r's passes
// into rows r and m + r of `q`, their scales into `scales[r]` and `scales[m + r]`
inline void quantize_rows(const at::Tensor& x, int8_t* q, float* scales, int8_t offset, int bits = 8) {
  const int64_t m = x.size(0), k = x.size(1);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const void* src = x.data_ptr();
  at::parallel_for(0, m, 16, [&](int64_t b, int64_t e) {
    std::vector<float> rest(k);
    for (int64_t r = b; r < e; ++r) {
      int8_t *q1 = q + r * k, *q2 = q + (m + r) * k;
      if (bf16)
        two_passes(static_cast<const uint16_t*>(src) + r * k, k, q1, q2, &scales[r], &scales[m + r], rest.data(),
                   offset, bits);
      else
        two_passes(static_cast<const float*>(src) + r * k, k, q1, q2, &scales[r], &scales[m + r], rest.data(), offset,
                   bits);
    }
  });
}

}  // namespace hcache
