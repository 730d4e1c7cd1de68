// A decode step's attention with AVX-512: one new token per sequence over its cached rows,
// read where they lie in the pool (a row index per key: no gather, no mask tensor).
//
// A KV head's G query heads share each key row, widened once to float32. Work items are
// (sequence, KV head, span of SPLIT keys): scores in float32, 16 keys' dot products summed
// together across lanes, a softmax in base 2, then P V; the spans merge by their maxima
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


// 16 float32 (or bfloat16, widened) values
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// Lane i of the result: the sum of v[i]'s 16 lanes (pairs, then quads within 128-bit
// lanes, then across them: 45 instructions for 16 sums)
inline __m512 sum16(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
}

struct Shape {
  int64_t g, width, kvh;           // query heads per KV head, keys per row of `rows`, KV heads
  int64_t qs0, qs1, ks0, ks1, vs0, vs1;  // strides (elements) of q [B,H,D] and the pools [N,KvH,D]
  float c;                         // scale * log2(e)
};

// Item: KV head h of a sequence over its keys k0..k1 (rows `rows[k0..k1]`), its query
// heads `q` [G][D] already times `c`. Leaves the unnormalized output `o` [G][D] and each
// head's maximum `m` and sum `l` (base 2). `sc` holds G * SPLIT scores.
template <int DV, typename KT>
void span(const Shape& sh, const float* q, const KT* kp, const KT* vp, const int64_t* rows, int64_t h, int64_t k0,
          int64_t k1, float* sc, float* o, float* m, float* l) {
  constexpr int64_t D = DV * 16;
  constexpr int HC = DV >= 16 ? 1 : 16 / DV;  // heads whose P V accumulators fit the registers
  const int64_t g = sh.g, n = k1 - k0;
  alignas(64) float kb[16][D];
  // scores, 16 keys at a time: each key widened once, every head's 16 dot products summed together
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t nk = std::min<int64_t>(16, n - j0);
    for (int64_t j = 0; j < nk; ++j) {
      const KT* kr = kp + rows[k0 + j0 + j] * sh.ks0 + h * sh.ks1;
      for (int c = 0; c < DV; ++c) _mm512_store_ps(kb[j] + 16 * c, load16(kr + 16 * c));
    }
    for (int64_t j = nk; j < 16; ++j)
      for (int c = 0; c < DV; ++c) _mm512_store_ps(kb[j] + 16 * c, _mm512_setzero_ps());
    for (int64_t hq = 0; hq < g; ++hq) {
      __m512 part[16];
      const float* qh = q + hq * D;
      for (int j = 0; j < 16; ++j) {
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qh), _mm512_load_ps(kb[j]));
        for (int c = 1; c < DV; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c), _mm512_load_ps(kb[j] + 16 * c), acc);
        part[j] = acc;
      }
      const __mmask16 real = nk == 16 ? __mmask16(0xFFFF) : __mmask16((1u << nk) - 1);
      _mm512_mask_storeu_ps(sc + hq * SPLIT + j0, real, sum16(part));
    }
  }
  // softmax in base 2, each head over its n scores in key order
  const int64_t full = n / 16 * 16;
  const __mmask16 tail = __mmask16((1u << (n - full)) - 1);
  for (int64_t hq = 0; hq < g; ++hq) {
    float* s = sc + hq * SPLIT;
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
      const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + full), mv);
      const __m512 p = hcache::exp2_ps(x, tail);
      _mm512_mask_storeu_ps(s + full, tail, p);
      sum = _mm512_add_ps(sum, p);
    }
    m[hq] = mh;
    l[hq] = _mm512_reduce_add_ps(sum);
  }
  // P V, HC heads at a time: each value row widened once per group of heads
  for (int64_t h0 = 0; h0 < g; h0 += HC) {
    const int hn = int(std::min<int64_t>(HC, g - h0));
    __m512 acc[HC][DV];
    for (int a = 0; a < HC; ++a)
      for (int c = 0; c < DV; ++c) acc[a][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const KT* vr = vp + rows[k0 + j] * sh.vs0 + h * sh.vs1;
      __m512 vv[DV];
      for (int c = 0; c < DV; ++c) vv[c] = load16(vr + 16 * c);
      for (int a = 0; a < HC; ++a) {
        if (a >= hn) break;
        const __m512 p = _mm512_set1_ps(sc[(h0 + a) * SPLIT + j]);
        for (int c = 0; c < DV; ++c) acc[a][c] = _mm512_fmadd_ps(p, vv[c], acc[a][c]);
      }
    }
    for (int a = 0; a < hn; ++a)
      for (int c = 0; c < DV; ++c) _mm512_storeu_ps(o + (h0 + a) * D + 16 * c, acc[a][c]);
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
      const int64_t s = it / (kvh * nsp), h = it / nsp % kvh, sp = it % nsp;
      const int64_t k0 = sp * SPLIT, k1 = std::min(lengths[s], k0 + SPLIT);
      if (k0 >= k1) continue;  // past this sequence's keys: the merge skips it
      for (int64_t hq = 0; hq < g; ++hq) {
        const QT* qr = q + s * sh.qs0 + (h * g + hq) * sh.qs1;
        for (int64_t e = 0; e < D; ++e) qf[hq * D + e] = static_cast<float>(qr[e]) * sh.c;
      }
      span<DV, KT>(sh, qf.data(), kp, vp, rows + s * sh.width, h, k0, k1, sc.data(), o.data() + it * g * D,
                   m.data() + it * g, l.data() + it * g);
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

TORCH_LIBRARY(hcache_decode, lib) {
  lib.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor rows, Tensor lengths, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(hcache_decode, CPU, lib) {
  lib.impl("decode_attention", &decode_attention);
}

// shapes only, for tracing: symbolic, so a compiled graph serves every batch
TORCH_LIBRARY_IMPL(hcache_decode, Meta, lib) {
  lib.impl("decode_attention", [](const at::Tensor& q, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, double) {
    return at::empty_symint({q.sym_size(0), q.sym_size(1) * q.sym_size(2)}, q.options());
  });
}
