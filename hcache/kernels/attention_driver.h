// What every form of the turn attention kernel shares (attention_bf16.cpp, attention_avx2.cpp):
// the work items (KV head, block of rows, span of keys), the tile of keys each softmax step
// takes, and the merge of the spans. A form computes a span; with the same tiles and spans
// and the same per-lane arithmetic, every form gives the same bits.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "steal.h"

namespace hcache {

constexpr int64_t ROWS = 96;   // grouped query rows per work item: 6 vectors of 16
constexpr int64_t TILE = 128;   // keys per softmax step
constexpr int64_t SPLIT = 1024;  // keys per work item
constexpr float FLOOR = -115.f;  // 2**-115 and below: invisible beside a row's largest term
constexpr float NONE = -1e30f;   // a running maximum before any key was seen

// a bfloat16 pair's bits: the odd (high) element above the even one
inline uint32_t pair(const at::BFloat16* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

struct Shape {
  int64_t t, s, prefix, g, d, heads;  // new tokens, keys, keys before them, heads per KV head, head dim, heads
  int64_t qs0, qs1, ks0, ks1, vs0, vs1;  // strides (elements) of q [T,H,D], k/v [S,KvH,D]
  float c;  // scale * log2(e)
};

// One (KV head, row block)'s output from its spans' partials (`o` [nsp][ROWS][D], `m`, `l`
// [nsp][ROWS]), in span order: weights 2**(m_span - max); spans that saw nothing are skipped.
inline void merge(const Shape& sh, int64_t nsp, int64_t h, int64_t r0, int64_t nr, const float* o, const float* m,
           const float* l, at::BFloat16* out) {
  const int64_t d = sh.d;
  for (int64_t r = 0; r < nr; ++r) {
    float top = NONE;
    for (int64_t sp = 0; sp < nsp; ++sp) top = std::max(top, m[sp * ROWS + r]);
    float total = 0.f;
    alignas(64) float acc[128] = {};
    for (int64_t sp = 0; sp < nsp; ++sp) {
      const float x = m[sp * ROWS + r] - top;
      if (!(x >= FLOOR)) continue;
      const float wt = std::exp2(x);
      total += wt * l[sp * ROWS + r];
      const float* src = o + (sp * ROWS + r) * d;
      for (int64_t j = 0; j < d; ++j) acc[j] += wt * src[j];
    }
    const int64_t row = r0 + r, tk = row % sh.t, head = h * sh.g + row / sh.t;
    at::BFloat16* dst = out + (tk * sh.heads + head) * d;
    for (int64_t j = 0; j < d; ++j) dst[j] = at::BFloat16(acc[j] / total);
  }
}

// q [T, H, D], k/v [S, KvH, D] bfloat16 (rows of D contiguous); returns [T, H*D] bfloat16.
// `run_span(rv, shape, q, k, v, h, r0, nr, k0, k1, o, m, l)`: a form's work item over `rv`
// vectors of 16 rows
template <typename RunSpan>
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, RunSpan&& run_span) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [rows, heads, head_dim]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "q, k, v must be bfloat16");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "head_dim must be contiguous");
  const int64_t t = q.size(0), nh = q.size(1), d = q.size(2), s = k.size(0), kvh = k.size(1);
  TORCH_CHECK(d % 16 == 0 && d <= 128, "head_dim must be a multiple of 16, at most 128");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == d && nh % kvh == 0 && t <= s && t >= 1, "shapes disagree");
  Shape sh{t, s, s - t, nh / kvh, d, nh, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
           float(scale * 1.4426950408889634)};
  const int64_t rows = sh.g * t, nrb = (rows + ROWS - 1) / ROWS, nsp = (s + SPLIT - 1) / SPLIT, blocks = kvh * nrb;
  // a KV head's rows in blocks of even size (whole vectors): a block of 96 beside one of 3
  // left one thread with twice the other's work
  const int64_t per = ((rows + nrb - 1) / nrb + 15) / 16 * 16;
  const auto *qp = q.data_ptr<at::BFloat16>(), *kp = k.data_ptr<at::BFloat16>(), *vp = v.data_ptr<at::BFloat16>();
  at::Tensor out = at::empty({t, nh * d}, q.options());
  auto* outp = out.data_ptr<at::BFloat16>();
  auto f32 = q.options().dtype(at::kFloat);
  auto block = [&](int64_t hb, int64_t sp, float* o, float* m, float* l) {
    const int64_t h = hb / nrb, r0 = (hb % nrb) * per, nr = std::min(per, rows - r0);
    const int64_t k0 = sp * SPLIT, k1 = std::min(s, k0 + SPLIT);
    run_span(int((nr + 15) / 16), sh, qp, kp, vp, h, r0, nr, k0, k1, o + sp * ROWS * d, m + sp * ROWS, l + sp * ROWS);
  };
  auto finish = [&](int64_t hb, const float* o, const float* m, const float* l) {
    const int64_t r0 = (hb % nrb) * per;
    merge(sh, nsp, hb / nrb, r0, std::min(per, rows - r0), o, m, l, outp);
  };
  if (blocks >= 4 * at::get_num_threads()) {
    // enough blocks to share: a block's spans run in turn, partials in scratch of its own
    hcache::parallel_steal(blocks, [&](int64_t hb) {
      at::Tensor o = at::empty({nsp, ROWS, d}, f32), m = at::empty({nsp, ROWS}, f32), l = at::empty({nsp, ROWS}, f32);
      for (int64_t sp = 0; sp < nsp; ++sp) block(hb, sp, o.data_ptr<float>(), m.data_ptr<float>(), l.data_ptr<float>());
      finish(hb, o.data_ptr<float>(), m.data_ptr<float>(), l.data_ptr<float>());
    });
    return out;
  }
  // few blocks (a short turn): the spans are shared too, then merged (the same arithmetic)
  at::Tensor o = at::empty({blocks, nsp, ROWS, d}, f32), m = at::empty({blocks, nsp, ROWS}, f32);
  at::Tensor l = at::empty({blocks, nsp, ROWS}, f32);
  float *op = o.data_ptr<float>(), *mp = m.data_ptr<float>(), *lp = l.data_ptr<float>();
  hcache::parallel_steal(blocks * nsp, [&](int64_t it) {
    const int64_t hb = it / nsp;
    block(hb, it % nsp, op + hb * nsp * ROWS * d, mp + hb * nsp * ROWS, lp + hb * nsp * ROWS);
  });
  hcache::parallel_steal(blocks, [&](int64_t hb) {
    finish(hb, op + hb * nsp * ROWS * d, mp + hb * nsp * ROWS, lp + hb * nsp * ROWS);
  });
  return out;
}

}  // namespace hcache

// A form's `causal_attention_bf16` as the library `ns`: each form a library of its own, so
// that one process can load them all (the tests compare them)
#define HCACHE_ATTENTION_LIBRARY(ns)                                                         \
  TORCH_LIBRARY(ns, lib) {                                                                   \
    lib.def("causal_attention_bf16(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");   \
  }                                                                                          \
  TORCH_LIBRARY_IMPL(ns, CPU, lib) { lib.impl("causal_attention_bf16", &causal_attention_bf16); } \
  /* shapes only, for tracing */                                                             \
  TORCH_LIBRARY_IMPL(ns, Meta, lib) {                                                        \
    lib.impl("causal_attention_bf16",                                                        \
             [](const at::Tensor& q, const at::Tensor&, const at::Tensor&, double) {         \
               return at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());            \
             });                                                                             \
  }
