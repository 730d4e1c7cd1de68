// A turn's attention over a bfloat16 cache with AVX2 and FMA: the arithmetic of
// attention_bf16.cpp's AVX-512F form, lane for lane, in vectors of 8 rows. Each key pair's
// two exact products add by two FMAs, the odd element first; the online softmax runs in
// base 2 over the same tiles of keys; P is rounded to bfloat16 to nearest even; the spans
// merge as there (attention_driver.h). So a turn attends to the same bits on AVX2 and
// AVX-512 replicas. Without it, AVX2 widened K/V to float32 copies for torch's flash kernel.
//
// AVX2 has 16 vector registers: the scores take 4 keys against 16 rows at a time, P V 6 rows
// against 16 elements of D, rather than holding a work item's every row. A score step's keys
// are widened once for all its rows, and each element is then one broadcast load: widened in
// the loop over rows, the scalar splits and broadcasts outnumbered the FMAs.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "attention_driver.h"
#include "vec_math.h"

namespace {

using hcache::FLOOR, hcache::NONE, hcache::pair, hcache::ROWS, hcache::Shape, hcache::TILE;

constexpr int KQ = 4;  // keys per score step
constexpr int RC = 2;  // vectors of 8 rows per score step
// a tile's score steps end at its end: keys past it would raise the rows' maxima (`tmx`)
static_assert(TILE % KQ == 0);

// 2**x where FLOOR <= x <= 0, else exactly 0 (masked keys are -inf). Over that range
// scalef's p * 2**n is normal, so one product by 2**n from its exponent bits is exact: the
// AVX-512 forms' bits, without vec_math.h's steps for the far ranges
inline __m256 exp2_or_zero(__m256 x) {
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 p = _mm256_mul_ps(hcache::exp2_poly(_mm256_sub_ps(x, n)), hcache::pow2(n));
  return _mm256_and_ps(p, _mm256_cmp_ps(x, _mm256_set1_ps(FLOOR), _CMP_GE_OQ));
}

// float32 rounded to the nearest bfloat16, ties to even, kept as float32 (P is finite, >= 0)
inline __m256 round_bf16(__m256 x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
}

// keys kr[0..KQ] as float32, split into each pair's odd and even elements: [KQ][D/2] each,
// once per step for every row vector's scores
inline void widen_keys(const at::BFloat16* const* kr, int64_t dp, float (*ko)[64], float (*ke)[64]) {
  const __m256i high = _mm256_set1_epi32(int32_t(0xFFFF0000u));
  for (int a = 0; a < KQ; ++a)
    for (int64_t e = 0; e < dp; e += 8) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kr[a] + 2 * e));
      _mm256_store_si256(reinterpret_cast<__m256i*>(&ko[a][e]), _mm256_and_si256(x, high));
      _mm256_store_si256(reinterpret_cast<__m256i*>(&ke[a][e]), _mm256_slli_epi32(x, 16));
    }
}

// scores of the widened keys against row vectors i0..i0+RC: each pair's odd element first
inline void scores(const float (*qo)[ROWS], const float (*qe)[ROWS], const float (*ko)[64], const float (*ke)[64],
                   int64_t dp, int i0, __m256 (&acc)[KQ][RC]) {
  for (int a = 0; a < KQ; ++a)
    for (int i = 0; i < RC; ++i) acc[a][i] = _mm256_setzero_ps();
  for (int64_t e = 0; e < dp; ++e) {
    __m256 qox[RC], qex[RC];
    for (int i = 0; i < RC; ++i)
      qox[i] = _mm256_load_ps(&qo[e][8 * (i0 + i)]), qex[i] = _mm256_load_ps(&qe[e][8 * (i0 + i)]);
    for (int a = 0; a < KQ; ++a) {
      const __m256 kox = _mm256_broadcast_ss(&ko[a][e]), kex = _mm256_broadcast_ss(&ke[a][e]);
      for (int i = 0; i < RC; ++i) acc[a][i] = _mm256_fmadd_ps(qex[i], kex, _mm256_fmadd_ps(qox[i], kox, acc[a][i]));
    }
  }
}

// o[NR rows][16 of D] = o * alpha + P V over `nk2` keys, the pair's odd key first
template <int NR>
inline void pv_tile(float* o, int64_t d, const float* al, const float* p, const float* vf, int64_t nk2) {
  __m256 acc[NR][2];
  for (int a = 0; a < NR; ++a)
    for (int b = 0; b < 2; ++b) acc[a][b] = _mm256_mul_ps(_mm256_load_ps(o + a * d + 8 * b), _mm256_set1_ps(al[a]));
  for (int64_t j = 0; j < nk2; j += 2)
    for (int64_t key = j + 1; key >= j; --key) {
      const __m256 v0 = _mm256_load_ps(vf + key * d), v1 = _mm256_load_ps(vf + key * d + 8);
      for (int a = 0; a < NR; ++a) {
        const __m256 pb = _mm256_set1_ps(p[key * ROWS + a]);
        acc[a][0] = _mm256_fmadd_ps(pb, v0, acc[a][0]);
        acc[a][1] = _mm256_fmadd_ps(pb, v1, acc[a][1]);
      }
    }
  for (int a = 0; a < NR; ++a)
    for (int b = 0; b < 2; ++b) _mm256_store_ps(o + a * d + 8 * b, acc[a][b]);
}

// One work item, as attention_bf16.cpp's `span`: rows r0..r0+nr (R = 16 * rv of them, the
// rest padding) of KV head h over keys k0..k1; leaves `o` [ROWS][D], `m` and `l`
void span(int rv, const Shape& sh, const at::BFloat16* q, const at::BFloat16* k, const at::BFloat16* v, int64_t h,
          int64_t r0, int64_t nr, int64_t k0, int64_t k1, float* o, float* m, float* l) {
  const int64_t R = 16 * rv, nv = 2 * rv;  // rows, and their vectors of 8
  const int64_t d = sh.d, dp = d / 2;
  // scores, keys-major (a last step's keys past the tile land in the pad), then P in place:
  // one array less to keep in cache
  alignas(32) float sc[TILE + KQ][ROWS];
  alignas(32) float qo[64][ROWS], qe[64][ROWS];  // q's odd and even elements along D: [D/2][rows]
  alignas(32) float vf[TILE * 128];  // V widened: [keys][D]
  alignas(32) int32_t tok[ROWS];  // each row's new token: it sees keys up to prefix + tok
  alignas(32) float ko[KQ][64], ke[KQ][64];  // a score step's keys, widened
  for (int64_t r = 0; r < R; ++r) {
    const bool real = r < nr;
    const int64_t row = r0 + (real ? r : 0);
    const int64_t t = row % sh.t, head = h * sh.g + row / sh.t;
    tok[r] = real ? int32_t(t) : int32_t(sh.t);
    const at::BFloat16* qr = q + t * sh.qs0 + head * sh.qs1;
    for (int64_t j = 0; j < dp; ++j) {
      const uint32_t x = real ? pair(qr + 2 * j) : 0u;
      const uint32_t odd = x & 0xFFFF0000u, even = x << 16;
      std::memcpy(&qo[j][r], &odd, 4);
      std::memcpy(&qe[j][r], &even, 4);
    }
  }
  for (int64_t r = 0; r < R; ++r) m[r] = NONE, l[r] = 0.f;
  int32_t last = 0;  // keys past prefix + the rows' latest token are masked for all of them
  for (int64_t r = 0; r < nr; ++r) last = std::max(last, tok[r]);
  k1 = std::min(k1, sh.prefix + last + 1);
  if (k0 >= k1) return;  // nothing seen: `o` left unset, the merge skips the span (m = NONE)
  std::memset(o, 0, sizeof(float) * R * d);
  const __m256 c = _mm256_set1_ps(sh.c), ninf = _mm256_set1_ps(-INFINITY);
  const at::BFloat16* kh = k + h * sh.ks1;
  const at::BFloat16* vh = v + h * sh.vs1;

  // the rows' maxima so far, raised by the score steps (no pass of their own): at a tile's
  // start they are `m`, which the softmax then takes from them
  alignas(32) float tmx[ROWS];
  std::memcpy(tmx, m, sizeof(float) * R);
  for (int64_t kt = k0; kt < k1; kt += TILE) {
    const int64_t nk = std::min(TILE, k1 - kt), nk2 = (nk + 1) & ~int64_t(1);
    for (int64_t j = 0; j < nk; j += KQ) {
      const at::BFloat16* kr[KQ];
      for (int a = 0; a < KQ; ++a) kr[a] = kh + std::min(kt + j + a, k1 - 1) * sh.ks0;
      for (int a = 0; a < KQ; ++a) {  // the next tile's rows into L1, a tile's compute ahead of use
        const int64_t key = kt + j + a + TILE;
        if (key < sh.s)
          for (int64_t e = 0; e < d; e += 32) {
            _mm_prefetch(reinterpret_cast<const char*>(kh + key * sh.ks0 + e), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(vh + key * sh.vs0 + e), _MM_HINT_T0);
          }
      }
      widen_keys(kr, dp, ko, ke);
      for (int64_t i0 = 0; i0 < nv; i0 += RC) {
        __m256 acc[KQ][RC];
        scores(qo, qe, ko, ke, dp, int(i0), acc);
        __m256 tm[RC];
        for (int i = 0; i < RC; ++i) tm[i] = _mm256_load_ps(&tmx[8 * (i0 + i)]);
        for (int a = 0; a < KQ; ++a) {
          const int64_t key = kt + j + a;
          for (int i = 0; i < RC; ++i) {
            __m256 s = _mm256_mul_ps(acc[a][i], c);
            if (key >= k1) {
              s = ninf;
            } else if (key >= sh.prefix) {  // the new block: row sees key iff key - prefix <= its token
              const __m256i tv = _mm256_load_si256(reinterpret_cast<const __m256i*>(&tok[8 * (i0 + i)]));
              const __m256i hidden = _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(key - sh.prefix)), tv);
              s = _mm256_blendv_ps(s, ninf, _mm256_castsi256_ps(hidden));
            }
            _mm256_store_ps(&sc[j + a][8 * (i0 + i)], s);
            tm[i] = _mm256_max_ps(tm[i], s);
          }
        }
        for (int i = 0; i < RC; ++i) _mm256_store_ps(&tmx[8 * (i0 + i)], tm[i]);
      }
    }
    // online softmax: new maxima, old terms rescaled, P rounded to bfloat16 over the scores
    alignas(32) float al[ROWS];
    for (int64_t i = 0; i < nv; ++i) {
      const __m256 old = _mm256_load_ps(&m[8 * i]);
      const __m256 mx = _mm256_load_ps(&tmx[8 * i]);
      const __m256 alpha = exp2_or_zero(_mm256_sub_ps(old, mx));
      _mm256_store_ps(&m[8 * i], mx);
      __m256 sum = _mm256_setzero_ps();
      for (int64_t j = 0; j < nk2; j += 2) {
        const __m256 p0 = exp2_or_zero(_mm256_sub_ps(_mm256_load_ps(&sc[j][8 * i]), mx));
        const __m256 p1 =
            j + 1 < nk ? exp2_or_zero(_mm256_sub_ps(_mm256_load_ps(&sc[j + 1][8 * i]), mx)) : _mm256_setzero_ps();
        sum = _mm256_add_ps(sum, _mm256_add_ps(p0, p1));
        _mm256_store_ps(&sc[j][8 * i], round_bf16(p0));
        _mm256_store_ps(&sc[j + 1][8 * i], round_bf16(p1));
      }
      _mm256_store_ps(&l[8 * i], _mm256_fmadd_ps(_mm256_load_ps(&l[8 * i]), alpha, sum));
      _mm256_store_ps(&al[8 * i], alpha);
    }
    for (int64_t j = 0; j < nk2; ++j) {  // a pad key (odd nk) repeats the last: its P is 0
      const at::BFloat16* a = vh + std::min(kt + j, k1 - 1) * sh.vs0;
      for (int64_t e = 0; e < d; e += 8) {
        const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + e)));
        _mm256_store_ps(&vf[j * d + e], _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));
      }
    }
    // o = o * alpha + P V, 6 rows x 16 of D at a time (R is a multiple of 16: 2 + 2 after 12)
    for (int64_t e = 0; e < d; e += 16) {
      int64_t r = 0;
      for (; r + 6 <= R; r += 6) pv_tile<6>(o + r * d + e, d, al + r, &sc[0][r], vf + e, nk2);
      for (; r < R; r += 2) pv_tile<2>(o + r * d + e, d, al + r, &sc[0][r], vf + e, nk2);
    }
  }
}

at::Tensor causal_attention_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  return hcache::attend(q, k, v, scale, span);
}

}  // namespace

HCACHE_ATTENTION_LIBRARY(hcache_kernels_avx2)
