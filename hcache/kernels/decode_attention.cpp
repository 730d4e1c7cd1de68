// A decode step's attention: one new token per sequence over its cached rows, read where
// they lie in the pool (a row index per key: no gather, no mask tensor). One source, two
// forms: AVX-512, and AVX2 with FMA, which gives the AVX-512 form's bits, so replicas of
// either kind decode a session alike.
//
// A KV head's G query heads share each key row, widened once to float32. Work items are
// (sequence, KV head, span of SPLIT keys): scores in float32, a key's 16 lanes of products
// summed in one fixed tree, a softmax in base 2, then P V; the spans merge by their maxima
// and sums. Only a sequence's own keys are read, spans start at fixed key positions and
// each item is one thread's, so a sequence's bits depend neither on the batch around it
// (nor on how far it was padded) nor on the threads.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "vec_math.h"

namespace {

constexpr int64_t SPLIT = 512;  // keys per work item
constexpr float LOG2E = 1.4426950408889634f;

// The sum of 8 lanes in the order of GCC's _mm512_reduce_add_ps after its first halving:
// lanes i + 4, then (0 + 2) + (1 + 3)
inline float sum8(__m256 x) {
  const __m128 a = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
  const __m128 b = _mm_add_ps(a, _mm_shuffle_ps(a, a, 0x4E));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_shuffle_ps(b, b, 0x55)));
}

// A key's 16 products sum as ((B0 + B1) + (B2 + B3)), Bk the 4 lanes of 128-bit block k
// as ((e0 + e2) + (e1 + e3)): in both forms the same steps per 128-bit block. pairs(x, y)
// leaves per block (x0 + x2, y0 + y2, x1 + x3, y1 + y3); quads of two pairs, each of its 4
// keys' Bk

#ifdef __AVX512F__
using Vec = __m512;
constexpr int VW = 1;  // vectors per 16 lanes

inline void load16(const float* p, Vec* v) { v[0] = _mm512_loadu_ps(p); }
inline void load16(const at::BFloat16* p, Vec* v) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  v[0] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline __m512 pairs(__m512 x, __m512 y) { return _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y)); }
inline __m512 quads(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x44), _mm512_shuffle_ps(x, y, 0xEE));
}

// Lane j of the result: key j's sum (v[j] its 16 lanes of products)
inline __m512 sum16(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i) a[i] = pairs(v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < 4; ++i) b[i] = quads(a[2 * i], a[2 * i + 1]);
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
}

// Head `qh` [D] against 16 widened keys `kb` [16][D]: the first nk scores into `out`
template <int DV>
void scores16(const float* qh, const float (*kb)[DV * 16], int64_t nk, float* out) {
  __m512 part[16];
  for (int j = 0; j < 16; ++j) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qh), _mm512_load_ps(kb[j]));
    for (int c = 1; c < DV; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c), _mm512_load_ps(kb[j] + 16 * c), acc);
    part[j] = acc;
  }
  _mm512_mask_storeu_ps(out, nk >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << nk) - 1), sum16(part));
}

// 2**(s - max) for a head's n scores in place; its maximum and the sum (lane j holding
// keys j, j + 16, ... in order, then the lanes summed as sum8 does)
inline void softmax(float* s, int64_t n, float* m, float* l) {
  const int64_t full = n / 16 * 16;
  const __mmask16 tail = __mmask16((1u << (n - full)) - 1);
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < full; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + j));
  if (tail) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, s + full));
  const float mh = _mm512_reduce_max_ps(mx);
  const __m512 mv = _mm512_set1_ps(mh);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < full; j += 16) {
    const __m512 p = hcache::exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
    _mm512_storeu_ps(s + j, p);
    sum = _mm512_add_ps(sum, p);
  }
  if (tail) {
    const __m512 p = hcache::exp2_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + full), mv), tail);
    _mm512_mask_storeu_ps(s + full, tail, p);
    sum = _mm512_add_ps(sum, p);
  }
  *m = mh;
  *l = sum8(_mm256_add_ps(_mm512_extractf32x8_ps(sum, 1), _mm512_castps512_ps256(sum)));
}

// P V's register blocking: heads at a time, and 16-lane column chunks of D at a time
template <int DV>
constexpr int HC = DV >= 16 ? 1 : 16 / DV;
template <int DV>
constexpr int CW = DV;

inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec set1(float x) { return _mm512_set1_ps(x); }
inline Vec zero() { return _mm512_setzero_ps(); }
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }

#else
using Vec = __m256;
constexpr int VW = 2;

inline void load16(const float* p, Vec* v) { v[0] = _mm256_loadu_ps(p), v[1] = _mm256_loadu_ps(p + 8); }
inline void load16(const at::BFloat16* p, Vec* v) {
  for (int i = 0; i < 2; ++i) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * i)));
    v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
}
inline __m256 pairs(__m256 x, __m256 y) { return _mm256_add_ps(_mm256_unpacklo_ps(x, y), _mm256_unpackhi_ps(x, y)); }
inline __m256 quads(__m256 x, __m256 y) {
  return _mm256_add_ps(_mm256_shuffle_ps(x, y, 0x44), _mm256_shuffle_ps(x, y, 0xEE));
}

// sum16's tree, 4 keys at a time: each key's lanes 0-7 (blocks 0, 1) and 8-15 (2, 3)
template <int DV>
void scores16(const float* qh, const float (*kb)[DV * 16], int64_t nk, float* out) {
  for (int j0 = 0; j0 < nk; j0 += 4) {
    __m256 part[4][2];
    for (int j = 0; j < 4; ++j)
      for (int h = 0; h < 2; ++h) {
        const float* k = kb[j0 + j] + 8 * h;
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(qh + 8 * h), _mm256_load_ps(k));
        for (int c = 1; c < DV; ++c) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 16 * c + 8 * h), _mm256_load_ps(k + 16 * c), acc);
        part[j][h] = acc;
      }
    __m128 half[2];  // B0 + B1 and B2 + B3 of the 4 keys
    for (int h = 0; h < 2; ++h) {
      const __m256 b = quads(pairs(part[0][h], part[1][h]), pairs(part[2][h], part[3][h]));
      half[h] = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
    }
    alignas(16) float s[4];
    _mm_store_ps(s, _mm_add_ps(half[0], half[1]));
    for (int j = 0; j < 4 && j0 + j < nk; ++j) out[j0 + j] = s[j];
  }
}

// softmax's lanes as two vectors of 8: the same per-lane steps, the same sum
inline void softmax(float* s, int64_t n, float* m, float* l) {
  const int64_t full = n / 16 * 16, left = n - full;
  const __m256i i0 = hcache::first8(left), i1 = hcache::first8(left - 8);
  const __m256 t0 = _mm256_castsi256_ps(i0), t1 = _mm256_castsi256_ps(i1);
  __m256 mx0 = _mm256_set1_ps(-INFINITY), mx1 = mx0;
  for (int64_t j = 0; j < full; j += 16)
    mx0 = _mm256_max_ps(mx0, _mm256_loadu_ps(s + j)), mx1 = _mm256_max_ps(mx1, _mm256_loadu_ps(s + j + 8));
  if (left) {
    mx0 = _mm256_blendv_ps(mx0, _mm256_max_ps(mx0, _mm256_maskload_ps(s + full, i0)), t0);
    mx1 = _mm256_blendv_ps(mx1, _mm256_max_ps(mx1, _mm256_maskload_ps(s + full + 8, i1)), t1);
  }
  __m256 x = _mm256_max_ps(mx0, mx1);
  x = _mm256_max_ps(x, _mm256_permute2f128_ps(x, x, 1));
  x = _mm256_max_ps(x, _mm256_permute_ps(x, 0x4E));
  const float mh = _mm256_cvtss_f32(_mm256_max_ps(x, _mm256_permute_ps(x, 0xB1)));
  const __m256 mv = _mm256_set1_ps(mh);
  __m256 sum0 = _mm256_setzero_ps(), sum1 = sum0;
  for (int64_t j = 0; j < full; j += 16) {
    const __m256 p0 = hcache::exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    const __m256 p1 = hcache::exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j + 8), mv));
    _mm256_storeu_ps(s + j, p0), _mm256_storeu_ps(s + j + 8, p1);
    sum0 = _mm256_add_ps(sum0, p0), sum1 = _mm256_add_ps(sum1, p1);
  }
  if (left) {  // lanes past n are 0, as the AVX-512 form's masked exp2 leaves them
    const __m256 p0 = _mm256_and_ps(hcache::exp2_ps(_mm256_sub_ps(_mm256_maskload_ps(s + full, i0), mv)), t0);
    const __m256 p1 = _mm256_and_ps(hcache::exp2_ps(_mm256_sub_ps(_mm256_maskload_ps(s + full + 8, i1), mv)), t1);
    _mm256_maskstore_ps(s + full, i0, p0), _mm256_maskstore_ps(s + full + 8, i1, p1);
    sum0 = _mm256_add_ps(sum0, p0), sum1 = _mm256_add_ps(sum1, p1);
  }
  *m = mh;
  *l = sum8(_mm256_add_ps(sum1, sum0));
}

// 16 registers: 6 heads by 16 lanes of accumulators, a value chunk and a broadcast
template <int DV>
constexpr int HC = 6;
template <int DV>
constexpr int CW = 1;

inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec set1(float x) { return _mm256_set1_ps(x); }
inline Vec zero() { return _mm256_setzero_ps(); }
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
#endif

struct Shape {
  int64_t g, width, kvh;           // query heads per KV head, keys per row of `rows`, KV heads
  int64_t qs0, qs1, ks0, ks1, vs0, vs1;  // strides (elements) of q [B,H,D] and the pools [N,KvH,D]
  float c;                         // scale * log2(e)
};

// A step reads each layer's pools once, so a sequence's rows come from memory, where their
// index hides them from the prefetchers. The first item of a span reads its keys' rows, every
// KV head's K and V, with plain loads in key order, which the hardware prefetchers follow
// (they learn from loads, not from prefetch instructions); the span's other items, next on
// the same thread, find the rows in L2.
template <typename KT>
inline void touch_rows(const KT* base, int64_t stride, const int64_t* rows, int64_t n, int64_t bytes) {
  uint64_t x = 0;
  for (int64_t j = 0; j < n; ++j) {
    const char* p = reinterpret_cast<const char*>(base + rows[j] * stride);
    for (int64_t b = 0; b < bytes; b += 64) x += *reinterpret_cast<const volatile uint64_t*>(p + b);
  }
  asm volatile("" : : "r"(x));
}

// `touch_rows` over every KV head's K and V of keys `rows[0..n]`, head dim d
template <typename KT>
void touch_span(const Shape& sh, const KT* kp, const KT* vp, const int64_t* rows, int64_t n, int64_t d) {
  const int64_t kbytes = ((sh.kvh - 1) * sh.ks1 + d) * int64_t(sizeof(KT));
  const int64_t vbytes = ((sh.kvh - 1) * sh.vs1 + d) * int64_t(sizeof(KT));
  // K and V of a token in one row (the engine's pool): one stretch. Compared as integers:
  // the pools may be separate tensors
  const auto ka = reinterpret_cast<uintptr_t>(kp), va = reinterpret_cast<uintptr_t>(vp);
  if (va > ka && va - ka < uintptr_t(sh.ks0) * sizeof(KT) && sh.vs0 == sh.ks0) {
    touch_rows(kp, sh.ks0, rows, n, int64_t(va - ka) + vbytes);
  } else {
    touch_rows(kp, sh.ks0, rows, n, kbytes);
    touch_rows(vp, sh.vs0, rows, n, vbytes);
  }
}

// Item: KV head h of a sequence over its keys k0..k1 (rows `rows[k0..k1]`), its query
// heads `q` [G][D] already times `c`. Leaves the unnormalized output `o` [G][D] and each
// head's maximum `m` and sum `l` (base 2). `sc` holds G * SPLIT scores.
template <int DV, typename KT>
void span(const Shape& sh, const float* q, const KT* kp, const KT* vp, const int64_t* rows, int64_t h, int64_t k0,
          int64_t k1, float* sc, float* o, float* m, float* l) {
  constexpr int64_t D = DV * 16;
  constexpr int hc = HC<DV>, cw = CW<DV>;
  const int64_t g = sh.g, n = k1 - k0;
  alignas(64) float kb[16][D];
  // scores, 16 keys at a time: each key widened once, then every head's
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t nk = std::min<int64_t>(16, n - j0);
    for (int64_t j = 0; j < 16; ++j) {
      const KT* kr = j < nk ? kp + rows[k0 + j0 + j] * sh.ks0 + h * sh.ks1 : nullptr;
      for (int c = 0; c < DV; ++c) {
        Vec x[VW];
        for (int w = 0; w < VW; ++w) x[w] = zero();
        if (kr) load16(kr + 16 * c, x);
        for (int w = 0; w < VW; ++w) store(kb[j] + 16 * c + 16 / VW * w, x[w]);
      }
    }
    for (int64_t hq = 0; hq < g; ++hq) scores16<DV>(q + hq * D, kb, nk, sc + hq * SPLIT + j0);
  }
  for (int64_t hq = 0; hq < g; ++hq) softmax(sc + hq * SPLIT, n, m + hq, l + hq);
  // P V, hc heads by cw 16-lane chunks at a time: each key's value chunk widened once per group
  for (int64_t h0 = 0; h0 < g; h0 += hc) {
    const int hn = int(std::min<int64_t>(hc, g - h0));
    for (int c0 = 0; c0 < DV; c0 += cw) {
      Vec acc[hc][cw * VW];
      for (int a = 0; a < hc; ++a)
        for (int c = 0; c < cw * VW; ++c) acc[a][c] = zero();
      for (int64_t j = 0; j < n; ++j) {
        const KT* vr = vp + rows[k0 + j] * sh.vs0 + h * sh.vs1 + 16 * c0;
        Vec vv[cw * VW];
        for (int c = 0; c < cw; ++c) load16(vr + 16 * c, vv + VW * c);
        for (int a = 0; a < hc; ++a) {
          if (a >= hn) break;
          const Vec p = set1(sc[(h0 + a) * SPLIT + j]);
          for (int c = 0; c < cw * VW; ++c) acc[a][c] = fmadd(p, vv[c], acc[a][c]);
        }
      }
      for (int a = 0; a < hn; ++a)
        for (int c = 0; c < cw * VW; ++c) store(o + (h0 + a) * D + 16 * c0 + 16 / VW * c, acc[a][c]);
    }
  }
}

template <int DV, typename KT, typename QT>
void run(const Shape& sh, const QT* q, const KT* kp, const KT* vp, const int64_t* rows, const int64_t* lengths,
         int64_t b, QT* out) {
  constexpr int64_t D = DV * 16;
  const int64_t g = sh.g, kvh = sh.kvh, nsp = (sh.width + SPLIT - 1) / SPLIT;
  // every item's partial results, merged per (sequence, KV head) after
  std::vector<float> o(size_t(b * kvh * nsp * g * D)), m(size_t(b * kvh * nsp * g)), l(size_t(b * kvh * nsp * g));
  at::parallel_for(0, b * kvh * nsp, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sc(size_t(g * SPLIT)), qf(size_t(g * D));
    for (int64_t it = begin; it < end; ++it) {
      // a span's KV heads one after another (`touch_span`); partials kept by (sequence, head, span)
      const int64_t s = it / (kvh * nsp), sp = it / kvh % nsp, h = it % kvh, at = (s * kvh + h) * nsp + sp;
      const int64_t k0 = sp * SPLIT, k1 = std::min(lengths[s], k0 + SPLIT);
      if (k0 >= k1) continue;  // past this sequence's keys: the merge skips it
      if (h == 0) touch_span(sh, kp, vp, rows + s * sh.width + k0, k1 - k0, D);
      for (int64_t hq = 0; hq < g; ++hq) {
        const QT* qr = q + s * sh.qs0 + (h * g + hq) * sh.qs1;
        for (int64_t e = 0; e < D; ++e) qf[hq * D + e] = static_cast<float>(qr[e]) * sh.c;
      }
      span<DV, KT>(sh, qf.data(), kp, vp, rows + s * sh.width, h, k0, k1, sc.data(), o.data() + at * g * D,
                   m.data() + at * g, l.data() + at * g);
    }
  });
  at::parallel_for(0, b * kvh, 1, [&](int64_t begin, int64_t end) {
    for (int64_t sh_ = begin; sh_ < end; ++sh_) {
      const int64_t s = sh_ / kvh, h = sh_ % kvh, used = (lengths[s] + SPLIT - 1) / SPLIT;
      for (int64_t hq = 0; hq < g; ++hq) {
        float mx = -INFINITY;
        for (int64_t sp = 0; sp < used; ++sp) mx = std::max(mx, m[(sh_ * nsp + sp) * g + hq]);
        float acc[D] = {}, tot = 0.f;
        for (int64_t sp = 0; sp < used; ++sp) {
          const int64_t it = sh_ * nsp + sp;
          const float w = std::exp2(m[it * g + hq] - mx);
          tot += w * l[it * g + hq];
          for (int64_t e = 0; e < D; ++e) acc[e] += w * o[(it * g + hq) * D + e];
        }
        QT* dst = out + s * kvh * g * D + (h * g + hq) * D;
        for (int64_t e = 0; e < D; ++e) dst[e] = static_cast<QT>(acc[e] / tot);
      }
    }
  });
}

template <int DV>
void dispatch(const Shape& sh, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* rows,
              const int64_t* lengths, int64_t b, at::Tensor& out) {
  const bool kb = k.scalar_type() == at::kBFloat16;
  if (q.scalar_type() == at::kFloat) {
    if (kb)
      run<DV>(sh, q.data_ptr<float>(), k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(), rows, lengths, b,
              out.data_ptr<float>());
    else
      run<DV>(sh, q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), rows, lengths, b, out.data_ptr<float>());
  } else {
    if (kb)
      run<DV>(sh, q.data_ptr<at::BFloat16>(), k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(), rows, lengths,
              b, out.data_ptr<at::BFloat16>());
    else
      run<DV>(sh, q.data_ptr<at::BFloat16>(), k.data_ptr<float>(), v.data_ptr<float>(), rows, lengths, b,
              out.data_ptr<at::BFloat16>());
  }
}

// q [B, H, D] (float32 or bfloat16), pools k/v [N, KvH, D] (bfloat16 or float32), rows
// [B, W] int64 (each sequence's pool rows in key order), lengths [B] int64 (keys each
// sequence attends: its first `lengths[b]` rows) -> [B, H*D] in q's dtype
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& rows,
                            const at::Tensor& lengths, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "decode_attention: q [B, H, D], pools [N, KvH, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "decode_attention: float q");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16),
              "decode_attention: float32 or bfloat16 pools of one dtype");
  const int64_t b = q.size(0), heads = q.size(1), d = q.size(2), kvh = k.size(1);
  TORCH_CHECK((d == 16 || d == 32 || d == 64 || d == 128 || d == 256) && k.size(2) == d && v.size(2) == d &&
                  v.size(1) == kvh,
              "decode_attention: a head dim of 16, 32, 64, 128 or 256, the same in q, k and v");
  TORCH_CHECK(heads % kvh == 0, "decode_attention: query heads a multiple of KV heads");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "decode_attention: head dims contiguous");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 2 && rows.size(0) == b, "decode_attention: rows [B, W]");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.numel() == b, "decode_attention: lengths [B]");
  const at::Tensor rc = rows.contiguous(), lc = lengths.contiguous();
  const int64_t width = rc.size(1), n = k.size(0);
  const int64_t* rp = rc.data_ptr<int64_t>();
  const int64_t* lp = lc.data_ptr<int64_t>();
  for (int64_t s = 0; s < b; ++s) {
    TORCH_CHECK(lp[s] >= 1 && lp[s] <= width, "decode_attention: a length outside 1..W");
    for (int64_t j = 0; j < lp[s]; ++j)
      TORCH_CHECK(rp[s * width + j] >= 0 && rp[s * width + j] < n, "decode_attention: a row outside the pool");
  }
  const Shape sh{heads / kvh, width, kvh, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                 float(scale) * LOG2E};
  at::Tensor out = at::empty({b, heads * d}, q.options());
  switch (d / 16) {  // the head dims models use; each a build's worth of instances
    case 1: dispatch<1>(sh, q, k, v, rp, lp, b, out); break;
    case 2: dispatch<2>(sh, q, k, v, rp, lp, b, out); break;
    case 4: dispatch<4>(sh, q, k, v, rp, lp, b, out); break;
    case 8: dispatch<8>(sh, q, k, v, rp, lp, b, out); break;
    default: dispatch<16>(sh, q, k, v, rp, lp, b, out);
  }
  return out;
}

}  // namespace

#ifdef __AVX512F__
#define HCACHE_NS hcache_decode
#else
#define HCACHE_NS hcache_decode_avx2
#endif
#define LIBRARY(ns, lib) TORCH_LIBRARY(ns, lib)
#define LIBRARY_IMPL(ns, key, lib) TORCH_LIBRARY_IMPL(ns, key, lib)

LIBRARY(HCACHE_NS, lib) {
  lib.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor rows, Tensor lengths, float scale) -> Tensor");
}

LIBRARY_IMPL(HCACHE_NS, CPU, lib) {
  lib.impl("decode_attention", &decode_attention);
}

// shapes only, for tracing: symbolic, so a compiled graph serves every batch
LIBRARY_IMPL(HCACHE_NS, Meta, lib) {
  lib.impl("decode_attention", [](const at::Tensor& q, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, double) {
    return at::empty_symint({q.sym_size(0), q.sym_size(1) * q.sym_size(2)}, q.options());
  });
}
