// A turn's attention over a long bfloat16 cache with AVX512-BF16 dot products, or, built
// without AVX512-BF16 (`__AVX512BF16__` undefined), the same arithmetic in AVX-512F: each
// pair's two exact products added by two FMAs, the odd element first as `vdpbf16ps` adds
// them, and P rounded to bfloat16 to nearest even as `vcvtne2ps2bf16` rounds it (the
// instruction reads subnormal inputs as 0 and flushes subnormal sums to 0; this form does
// neither). On a CPU without AVX512-BF16 this form beats torch's float32 flash kernel over
// widened K/V: it reads K/V once per query-head group and widens them in registers.
//
// The last T of S positions attend causally; a KV head's G query heads are its G*T query
// rows, so K/V are read once per group, as they lie in the cache (no copies, no mask
// tensor). Work items are (KV head, block of up to 96 rows, span of SPLIT keys): scores
// in float32 from bfloat16 pairs (`vdpbf16ps`), an online softmax in base 2, P rounded to
// bfloat16 for P V as torch's flash kernel rounds it; the spans are merged by their
// maxima and sums. Spans and tiles start at fixed key positions and every row is reduced
// on its own, so a position's output depends neither on the threads nor on how a prompt
// was cut into chunks (a turn and a one-pass prefill give the same bits).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "attention_driver.h"
#include "vec_math.h"

namespace {

using hcache::FLOOR, hcache::NONE, hcache::pair, hcache::ROWS, hcache::Shape, hcache::TILE;

// 2**x where x >= FLOOR, else exactly 0 (masked keys are -inf)
inline __m512 exp2_or_zero(__m512 x) {
  return hcache::exp2_ps(x, _mm512_cmp_ps_mask(x, _mm512_set1_ps(FLOOR), _CMP_GE_OQ));
}

#ifdef __AVX512BF16__
constexpr bool DPBF16 = true;
#else
constexpr bool DPBF16 = false;
#endif

// A bfloat16 pair's elements as float32 lanes: the odd (high) one and the even (low) one
inline __m512 odd_of(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
}
inline __m512 even_of(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }

// float32 rounded to the nearest bfloat16, ties to even, kept as float32 (P is finite, >= 0)
inline __m512 round_bf16(__m512 x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
}

// A key's K and V rows into L1. The cache's rows are strided (a KV head's D of every
// head's): the hardware prefetcher alone left a layer's cold K/V waiting on memory.
inline void prefetch_row(const at::BFloat16* k, const at::BFloat16* v, int64_t d) {
  for (int64_t e = 0; e < d; e += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(k + e), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(v + e), _MM_HINT_T0);
  }
}

#ifndef __AVX512BF16__
// o[NR][NE vectors] = o * alpha + P V over `nk2` keys (an even count), the pair's odd key
// first as `vdpbf16ps` adds it; `p` [keys][rows] with row stride `ps`, `vf` [keys][D].
template <int NR, int NE>
inline void pv_tile(float* o, int64_t d, const float* al, const float* p, int64_t ps, const float* vf, int64_t nk2) {
  __m512 acc[NR][NE];
  for (int a = 0; a < NR; ++a)
    for (int b = 0; b < NE; ++b) acc[a][b] = _mm512_mul_ps(_mm512_load_ps(o + a * d + 16 * b), _mm512_set1_ps(al[a]));
  for (int64_t j = 0; j < nk2; j += 2) {
    for (int64_t key = j + 1; key >= j; --key) {
      __m512 vx[NE];
      for (int b = 0; b < NE; ++b) vx[b] = _mm512_load_ps(vf + key * d + 16 * b);
      for (int a = 0; a < NR; ++a) {
        const __m512 pb = _mm512_set1_ps(p[key * ps + a]);
        for (int b = 0; b < NE; ++b) acc[a][b] = _mm512_fmadd_ps(pb, vx[b], acc[a][b]);
      }
    }
  }
  for (int a = 0; a < NR; ++a)
    for (int b = 0; b < NE; ++b) _mm512_store_ps(o + a * d + 16 * b, acc[a][b]);
}

// `nr` rows of o (an even count), as many at a time as the registers hold (NR * NE sums,
// NE of V, P's broadcast): each V load then feeds more FMAs
template <int NE>
inline void pv_rows(float* o, int64_t d, const float* al, const float* p, int64_t ps, const float* vf, int64_t nk2,
                    int64_t nr) {
  constexpr int NR = NE >= 4 ? 6 : 8;
  int64_t r = 0;
  for (; r + NR <= nr; r += NR) pv_tile<NR, NE>(o + r * d, d, al + r, p + r, ps, vf, nk2);
  for (; r < nr; r += 2) pv_tile<2, NE>(o + r * d, d, al + r, p + r, ps, vf, nk2);
}
#endif

// One work item: rows r0..r0+nr of KV head h over keys k0..k1. Leaves the unnormalized
// output `o` [ROWS][D], each row's maximum `m` and sum `l` (base 2).
template <int RV>
void span(const Shape& sh, const at::BFloat16* q, const at::BFloat16* k, const at::BFloat16* v, int64_t h,
          int64_t r0, int64_t nr, int64_t k0, int64_t k1, float* o, float* m, float* l) {
  constexpr int64_t R = RV * 16;
  // keys per score step: KQ * RV sums, KQ key pairs and a q vector fit 32 registers with room
  // (24 + 4 + 1 at 6 vectors left gcc spilling sums)
  // (without AVX512-BF16 a key is two vectors, odd and even elements: 3 keys from 5 vectors)
  constexpr int KQ = RV >= 6 || (!DPBF16 && RV >= 5) ? 3 : 4;
  const int64_t d = sh.d, dp = d / 2, dv = d / 16;
  alignas(64) float sc[TILE + 4][R];    // scores, keys-major; a last step's keys past the tile land in the pad
#ifdef __AVX512BF16__
  alignas(64) uint32_t qv[64][R];       // q as bfloat16 pairs along D: [D/2][rows]
  alignas(64) uint32_t pp[TILE / 2][R];  // P as bfloat16 pairs along keys: [keys/2][rows]
  alignas(64) uint32_t vp[TILE / 2][128];  // V as bfloat16 pairs along keys: [keys/2][D]
#else
  alignas(64) float qo[64][R], qe[64][R];  // q's odd and even elements along D: [D/2][rows]
  alignas(64) float pf[TILE][R];         // P rounded to bfloat16: [keys][rows]
  // V widened: [keys][D], rows D apart (at 128 apart, a D of 64 left half of L1's sets unused)
  alignas(64) float vf[TILE * 128];
#endif
  alignas(64) int32_t tok[R];           // each row's new token: it sees keys up to prefix + tok
  for (int64_t r = 0; r < R; ++r) {
    const bool real = r < nr;
    const int64_t row = r0 + (real ? r : 0);
    const int64_t t = row % sh.t, head = h * sh.g + row / sh.t;
    tok[r] = real ? int32_t(t) : int32_t(sh.t);
    const at::BFloat16* qr = q + t * sh.qs0 + head * sh.qs1;
    for (int64_t j = 0; j < dp; ++j) {
      const uint32_t x = real ? pair(qr + 2 * j) : 0u;
#ifdef __AVX512BF16__
      qv[j][r] = x;
#else
      const uint32_t odd = x & 0xFFFF0000u, even = x << 16;
      std::memcpy(&qo[j][r], &odd, 4);
      std::memcpy(&qe[j][r], &even, 4);
#endif
    }
  }
  for (int64_t r = 0; r < R; ++r) m[r] = NONE, l[r] = 0.f;
  int32_t last = 0;  // keys past prefix + the rows' latest token are masked for all of them
  for (int64_t r = 0; r < nr; ++r) last = std::max(last, tok[r]);
  k1 = std::min(k1, sh.prefix + last + 1);
  if (k0 >= k1) return;  // nothing seen: `o` left unset, the merge skips the span (m = NONE)
  std::memset(o, 0, sizeof(float) * R * d);
  const __m512 c = _mm512_set1_ps(sh.c);
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
#ifdef __AVX512BF16__
  // (0, 16, 1, 17, ...): two vectors of 16 bfloat16 interleaved into 16 pairs
  const __m512i zip = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21,
                                       5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  // (0, 32, 1, 33, ...) and (16, 48, 17, 49, ...): two rows' elements interleaved into pairs
  const __m512i vzip = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                        5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i vzip_hi = _mm512_add_epi16(vzip, _mm512_set1_epi16(16));
#endif
  const at::BFloat16* kh = k + h * sh.ks1;
  const at::BFloat16* vh = v + h * sh.vs1;

  for (int64_t kt = k0; kt < k1; kt += TILE) {
    const int64_t nk = std::min(TILE, k1 - kt);
    const int64_t nk2 = (nk + 1) & ~int64_t(1);
    // scores of KQ keys at a time: each key's pair broadcast against every row
    for (int64_t j = 0; j < nk; j += KQ) {
      __m512 acc[KQ][RV];
      for (int a = 0; a < KQ; ++a)
        for (int i = 0; i < RV; ++i) acc[a][i] = _mm512_setzero_ps();
      const at::BFloat16* kr[KQ];
      for (int a = 0; a < KQ; ++a) kr[a] = kh + std::min(kt + j + a, k1 - 1) * sh.ks0;
      for (int a = 0; a < KQ; ++a) {  // the next tile's rows, a tile's compute ahead of use
        const int64_t key = kt + j + a + TILE;
        if (key < sh.s) prefetch_row(kh + key * sh.ks0, vh + key * sh.vs0, d);
      }
      for (int64_t e = 0; e < dp; ++e) {
#ifdef __AVX512BF16__
        __m512i kb[KQ];
        for (int a = 0; a < KQ; ++a) kb[a] = _mm512_set1_epi32(int32_t(pair(kr[a] + 2 * e)));
        for (int i = 0; i < RV; ++i) {
          const __m512i qx = _mm512_load_si512(&qv[e][16 * i]);
          for (int a = 0; a < KQ; ++a) acc[a][i] = _mm512_dpbf16_ps(acc[a][i], (__m512bh)qx, (__m512bh)kb[a]);
        }
#else
        __m512 ko[KQ], ke[KQ];
        for (int a = 0; a < KQ; ++a) {
          const __m512i kb = _mm512_set1_epi32(int32_t(pair(kr[a] + 2 * e)));
          ko[a] = odd_of(kb), ke[a] = even_of(kb);
        }
        for (int i = 0; i < RV; ++i) {
          __m512 qox = _mm512_load_ps(&qo[e][16 * i]), qex = _mm512_load_ps(&qe[e][16 * i]);
          __asm__("" : "+v"(qox), "+v"(qex));  // loaded once for the KQ keys, not folded into each FMA
          for (int a = 0; a < KQ; ++a) acc[a][i] = _mm512_fmadd_ps(qex, ke[a], _mm512_fmadd_ps(qox, ko[a], acc[a][i]));
        }
#endif
      }
      for (int a = 0; a < KQ; ++a) {
        const int64_t key = kt + j + a;
        for (int i = 0; i < RV; ++i) {
          __m512 s = _mm512_mul_ps(acc[a][i], c);
          if (key >= k1) {
            s = ninf;
          } else if (key >= sh.prefix) {  // the new block: row sees key iff key - prefix <= its token
            __m512i tv = _mm512_load_si512(&tok[16 * i]);
            __mmask16 see = _mm512_cmp_epi32_mask(tv, _mm512_set1_epi32(int32_t(key - sh.prefix)), _MM_CMPINT_NLT);
            s = _mm512_mask_blend_ps(see, ninf, s);
          }
          _mm512_store_ps(&sc[j + a][16 * i], s);
        }
      }
    }
    // online softmax: new maxima, old terms rescaled, P as bfloat16 pairs
    __m512 mx[RV], alpha[RV], sum[RV];
    for (int i = 0; i < RV; ++i) {
      __m512 t = _mm512_load_ps(&m[16 * i]);
      for (int64_t j = 0; j < nk; ++j) t = _mm512_max_ps(t, _mm512_load_ps(&sc[j][16 * i]));
      alpha[i] = exp2_or_zero(_mm512_sub_ps(_mm512_load_ps(&m[16 * i]), t));
      mx[i] = t;
      _mm512_store_ps(&m[16 * i], t);
      sum[i] = _mm512_setzero_ps();
    }
    for (int64_t j = 0; j < nk2; j += 2) {
      for (int i = 0; i < RV; ++i) {
        __m512 p0 = exp2_or_zero(_mm512_sub_ps(_mm512_load_ps(&sc[j][16 * i]), mx[i]));
        __m512 p1 = j + 1 < nk ? exp2_or_zero(_mm512_sub_ps(_mm512_load_ps(&sc[j + 1][16 * i]), mx[i]))
                               : _mm512_setzero_ps();
        sum[i] = _mm512_add_ps(sum[i], _mm512_add_ps(p0, p1));
#ifdef __AVX512BF16__
        // bfloat16 rows [p0 | p1], then interleaved into (p0[r], p1[r]) pairs
        __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
        _mm512_store_si512(&pp[j / 2][16 * i], _mm512_permutexvar_epi16(zip, both));
#else
        _mm512_store_ps(&pf[j][16 * i], round_bf16(p0));
        _mm512_store_ps(&pf[j + 1][16 * i], round_bf16(p1));
#endif
      }
    }
    for (int i = 0; i < RV; ++i) {
      __m512 lv = _mm512_fmadd_ps(_mm512_load_ps(&l[16 * i]), alpha[i], sum[i]);
      _mm512_store_ps(&l[16 * i], lv);
    }
#ifdef __AVX512BF16__
    // V as pairs of consecutive keys along D
    for (int64_t j = 0; j < nk2; j += 2) {
      const at::BFloat16* a = vh + std::min(kt + j, k1 - 1) * sh.vs0;
      const at::BFloat16* b = vh + std::min(kt + j + 1, k1 - 1) * sh.vs0;
      for (int64_t e = 0; e < d; e += 32) {
        const __mmask32 in = d - e >= 32 ? ~__mmask32(0) : (__mmask32(1) << (d - e)) - 1;
        __m512i x = _mm512_maskz_loadu_epi16(in, a + e), y = _mm512_maskz_loadu_epi16(in, b + e);
        _mm512_store_si512(&vp[j / 2][e], _mm512_permutex2var_epi16(x, vzip, y));
        if (e + 16 < d) _mm512_store_si512(&vp[j / 2][e + 16], _mm512_permutex2var_epi16(x, vzip_hi, y));
      }
    }
#else
    for (int64_t j = 0; j < nk2; ++j) {  // a pad key (odd nk) repeats the last: its P is 0
      const at::BFloat16* a = vh + std::min(kt + j, k1 - 1) * sh.vs0;
      for (int64_t e = 0; e < d; e += 16) {
        const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + e)));
        _mm512_store_ps(&vf[j * d + e], _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
      }
    }
#endif
    // o = o * alpha + P V, a block of rows x D at a time
    alignas(64) float al[R];
    for (int i = 0; i < RV; ++i) _mm512_store_ps(&al[16 * i], alpha[i]);
#ifdef __AVX512BF16__
    for (int64_t r = 0; r < R; r += 4) {
      for (int64_t e = 0; e < dv; e += 4) {
        const int64_t ne = std::min<int64_t>(4, dv - e);
        __m512 acc[4][4];
        for (int a = 0; a < 4; ++a)
          for (int b = 0; b < 4; ++b)
            acc[a][b] = b < ne ? _mm512_mul_ps(_mm512_load_ps(o + (r + a) * d + 16 * (e + b)), _mm512_set1_ps(al[r + a]))
                               : _mm512_setzero_ps();
        for (int64_t j = 0; j < nk2 / 2; ++j) {
          __m512i vx[4];
          for (int b = 0; b < 4; ++b) vx[b] = b < ne ? _mm512_load_si512(&vp[j][16 * (e + b)]) : _mm512_setzero_si512();
          for (int a = 0; a < 4; ++a) {
            const __m512i pb = _mm512_set1_epi32(int32_t(pp[j][r + a]));
            for (int b = 0; b < 4; ++b) acc[a][b] = _mm512_dpbf16_ps(acc[a][b], (__m512bh)pb, (__m512bh)vx[b]);
          }
        }
        for (int a = 0; a < 4; ++a)
          for (int b = 0; b < ne; ++b) _mm512_store_ps(o + (r + a) * d + 16 * (e + b), acc[a][b]);
      }
    }
#else
    int64_t e = 0;
    for (; e + 4 <= dv; e += 4) pv_rows<4>(o + 16 * e, d, al, &pf[0][0], R, &vf[16 * e], nk2, R);
    switch (dv - e) {
      case 3: pv_rows<3>(o + 16 * e, d, al, &pf[0][0], R, &vf[16 * e], nk2, R); break;
      case 2: pv_rows<2>(o + 16 * e, d, al, &pf[0][0], R, &vf[16 * e], nk2, R); break;
      case 1: pv_rows<1>(o + 16 * e, d, al, &pf[0][0], R, &vf[16 * e], nk2, R); break;
      default: break;
    }
#endif
  }
}

void run_span(int rv, const Shape& sh, const at::BFloat16* q, const at::BFloat16* k, const at::BFloat16* v, int64_t h,
              int64_t r0, int64_t nr, int64_t k0, int64_t k1, float* o, float* m, float* l) {
  switch (rv) {
    case 1: return span<1>(sh, q, k, v, h, r0, nr, k0, k1, o, m, l);
    case 2: return span<2>(sh, q, k, v, h, r0, nr, k0, k1, o, m, l);
    case 3: return span<3>(sh, q, k, v, h, r0, nr, k0, k1, o, m, l);
    case 4: return span<4>(sh, q, k, v, h, r0, nr, k0, k1, o, m, l);
    case 5: return span<5>(sh, q, k, v, h, r0, nr, k0, k1, o, m, l);
    default: return span<6>(sh, q, k, v, h, r0, nr, k0, k1, o, m, l);
  }
}

// q [T, H, D], k/v [S, KvH, D] bfloat16 (rows of D contiguous); returns [T, H*D] bfloat16
at::Tensor causal_attention_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  return hcache::attend(q, k, v, scale, run_span);
}

}  // namespace

#ifdef __AVX512BF16__
#define HCACHE_NS hcache_kernels
#else
#define HCACHE_NS hcache_kernels_avx512
#endif
HCACHE_ATTENTION_LIBRARY(HCACHE_NS)
