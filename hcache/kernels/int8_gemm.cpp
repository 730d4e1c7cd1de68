// Unsigned 8-bit activations times signed 8-bit weight rows with AVX512-VNNI (`vpdpbusd`),
// or with AVX2 where it lacks (the same integers, below),
// for the few activation rows of a decode step, and float activations quantized inside the
// call in two passes per row (`int8_linear`: 8-bit passes, or 7-bit ones for an LM head).
//
// A step of a larger model is bound by streaming its weights; oneDNN's u8s8 GEMM keeps its
// panels for many rows and streams them at about half of what the memory gives at one row.
// Here the weights lie in tiles of 16 output rows by 4 inputs (`pack`), so one 64-byte load
// feeds one `vpdpbusd` per activation row, against a broadcast of that row's 4 bytes, and
// a tile's 16 sums land in the 16 lanes of one register: no reductions across lanes. Each
// output is `(sum(a * w) - zero * sum(w)) * scale`, the integer part exact, so the result
// does not depend on the rows beside it, the threads, or the blocking.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "act_quant.h"
#include "steal.h"
#include "vec_math.h"

namespace {

constexpr int64_t LANES = 16;  // output rows per tile
#ifdef __AVX512VNNI__
constexpr int NR = 3;      // tiles a micro-kernel streams at once
constexpr int MR_MAX = 8;  // activation rows it holds: NR * MR_MAX accumulators
constexpr int8_t PASS_OFFSET = -128;  // `passes`' activation bytes: + 128, unsigned
#else
constexpr int NR = 1;  // AVX2's 16 registers: a tile's two halves for 4 activation rows
constexpr int MR_MAX = 4;
constexpr int8_t PASS_OFFSET = 0;  // `passes`' activation bytes: signed, for `sums<MR, true>`
#endif
constexpr int64_t AHEAD = 2048;  // bytes of each tile's stream prefetched ahead: a row's step waits on DRAM latency
constexpr int64_t ACT_BLOCK = 256 * 1024;  // bytes of activation rows a thread keeps in L2

// `w` [N, K] int8 -> [ceil(N/16), K/4, 16, 4]: tile t, step k holds rows 16t..16t+15 at
// inputs 4k..4k+3 (missing rows zero); and each row's sum, for the zero point.
std::tuple<at::Tensor, at::Tensor> pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar, "pack: int8 [N, K] expected");
  const int64_t n = w.size(0), k = w.size(1), tiles = (n + LANES - 1) / LANES;
  TORCH_CHECK(k % 4 == 0, "pack: K must be a multiple of 4, got ", k);
  // the AVX2 form's products need |w| <= 127; every form refuses the same weights
  TORCH_CHECK(w.numel() == 0 || w.min().item<int>() > -128, "pack: weights within +-127 expected, got -128");
  at::Tensor wc = w.contiguous();
  at::Tensor out = at::zeros({tiles, k / 4, LANES, 4}, w.options());
  at::Tensor sums = wc.sum(1, false, at::kInt);
  const int8_t* src = wc.data_ptr<int8_t>();
  int8_t* dst = out.data_ptr<int8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      for (int64_t r = 0; r < LANES && t * LANES + r < n; ++r) {
        const int8_t* row = src + (t * LANES + r) * k;
        int8_t* base = dst + t * k * LANES + r * 4;
        for (int64_t s = 0; s < k / 4; ++s) std::memcpy(base + s * LANES * 4, row + s * 4, 4);
      }
  });
  return {out, sums};
}

// What a tile's combined rows become: written as they are, plus a bias, or (`GLU`: each
// tile's lanes 0-7 the gate rows and 8-15 the up rows of 8 outputs, `quant.glu_rows`) those 8
// outputs' `silu(gate) * up`, 8 floats at column 8 * tile
enum class Epilogue { PLAIN, BIAS, GLU };

#ifdef __AVX512VNNI__
// The integer sums of activation rows `rows[0..MR]` (K bytes each) against tiles
// t0..t0+nt (nt <= NR) into `acc`
template <int MR>
inline void sums(const uint8_t* const* rows, int64_t k, const int8_t* w, int64_t t0, int nt, __m512i (&acc)[MR][NR]) {
  const int64_t steps = k / 4, tile = k * LANES;
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_setzero_si512();
  const int8_t* wt[NR];
  for (int j = 0; j < NR; ++j) wt[j] = w + (t0 + std::min(j, nt - 1)) * tile;
  for (int64_t s = 0; s < steps; ++s) {
    __m512i wv[NR];
    for (int j = 0; j < NR; ++j) {
      if (j < nt) {
        _mm_prefetch(reinterpret_cast<const char*>(wt[j] + s * 64 + AHEAD), _MM_HINT_T0);
        wv[j] = _mm512_loadu_si512(wt[j] + s * 64);
      }
    }
    for (int m = 0; m < MR; ++m) {
      int32_t four;
      std::memcpy(&four, rows[m] + s * 4, 4);
      const __m512i av = _mm512_set1_epi32(four);
      for (int j = 0; j < NR; ++j)
        if (j < nt) acc[m][j] = _mm512_dpbusd_epi32(acc[m][j], av, wv[j]);
    }
  }
}

// Tile t0 + j's outputs (16 lanes, `mask` of them real) as float32: (sum - zero * rowsum) * scale
struct TileOut {
  __mmask16 mask;
  __m512i zc;
  __m512 sc;
  TileOut(int64_t r0, int64_t n, const int32_t* comp, const uint16_t* scale, int32_t zero) {
    const int64_t left = std::min<int64_t>(LANES, n - r0);
    mask = left == LANES ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    zc = _mm512_mullo_epi32(_mm512_maskz_loadu_epi32(mask, comp + r0), _mm512_set1_epi32(zero));
    // bfloat16 scales: the upper half of a float32
    sc = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, scale + r0)), 16));
  }
  __m512 operator()(__m512i acc) const { return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc, zc)), sc); }
};

// rows 0..MR of `a` against tiles t0..t0+nt (nt <= NR), written to `out`
template <int MR>
void micro(const uint8_t* a, int64_t k, const int8_t* w, int64_t t0, int nt, int64_t n, const int32_t* comp,
           const uint16_t* scale, int32_t zero, float* out) {
  const uint8_t* rows[MR];
  for (int m = 0; m < MR; ++m) rows[m] = a + m * k;
  __m512i acc[MR][NR];
  sums<MR>(rows, k, w, t0, nt, acc);
  for (int j = 0; j < nt; ++j) {
    const int64_t r0 = (t0 + j) * LANES;
    const TileOut y(r0, n, comp, scale, zero);
    for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(out + m * n + r0, y.mask, y(acc[m][j]));
  }
}

// x * sigmoid(x) = x / (1 + 2**(-x * log2(e))): 0 where the power overflows to infinity
inline __m512 silu(__m512 x) {
  const __m512 e = hcache::exp2_ps(_mm512_mul_ps(x, _mm512_set1_ps(-1.4426950408889634f)));
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e));
}

// rows r..r+P of the activations, both passes of each (rows i and m + i of `a`), against
// tiles t0..t0+nt (nt <= NR): each pass's output as `int8_mm` rounds it, then the two meet
// as `y1 * s1 + y2 * s2` in registers, so only the combined rows are written (`E`)
// (7-bit passes need nothing of their own here: `asum` is the AVX2 form's)
template <int P, Epilogue E, bool SEVEN>
void micro_passes(const uint8_t* a, int64_t m, int64_t k, const int8_t* w, int64_t r, int64_t t0, int nt, int64_t n,
                  const int32_t* comp, const uint16_t* scale, const float* ascale, const int32_t*, const float* bias,
                  float* out) {
  const uint8_t* rows[2 * P];
  for (int p = 0; p < P; ++p) rows[2 * p] = a + (r + p) * k, rows[2 * p + 1] = a + (m + r + p) * k;
  __m512i acc[2 * P][NR];
  sums<2 * P>(rows, k, w, t0, nt, acc);
  for (int j = 0; j < nt; ++j) {
    const int64_t r0 = (t0 + j) * LANES;
    const TileOut y(r0, n, comp, scale, 128);
    const __m512 b = E == Epilogue::BIAS ? _mm512_maskz_loadu_ps(y.mask, bias + r0) : _mm512_setzero_ps();
    for (int p = 0; p < P; ++p) {
      // two products and one sum, as the Python computes them (no fused multiply-add)
      __m512 f = _mm512_add_ps(_mm512_mul_ps(y(acc[2 * p][j]), _mm512_set1_ps(ascale[r + p])),
                               _mm512_mul_ps(y(acc[2 * p + 1][j]), _mm512_set1_ps(ascale[m + r + p])));
      if constexpr (E == Epilogue::GLU) {
        const __m512 up = _mm512_shuffle_f32x4(f, f, 0xEE);  // lanes 8-15 into 0-7
        _mm512_mask_storeu_ps(out + (r + p) * (n / 2) + r0 / 2, __mmask16(0xFF), _mm512_mul_ps(silu(f), up));
      } else {
        if constexpr (E == Epilogue::BIAS) f = _mm512_add_ps(f, b);
        _mm512_mask_storeu_ps(out + (r + p) * n + r0, y.mask, f);
      }
    }
  }
}

#else
// The same integers with AVX2, a tile's 16 rows as two halves of 8. `vpmaddubsw` multiplies
// unsigned by signed bytes and sums pairs in 16 bits: with |a - 128| as the unsigned operand
// (at most 128) and the weight carrying that sign (|w| <= 127, `pack`), a pair is at most
// 2 * 128 * 127, exact, and `vpmaddwd` widens it. The sums are of (a - 128) * w: `TileOut`'s
// zero-point term makes them VNNI's sum(a * w) - zero * sum(w), the same integers.
// SIGNED activations (the two passes' int8 values, within +-127) go the other way round: |w|
// unsigned, shared by every row, and the activation carrying w's sign, one operation fewer per
// row and half tile (-128 would have no positive to take, which the passes never hold).
// SEVEN-bit ones (within +-63) need no sign moved at all: w + 128 is the unsigned operand,
// shared by every row, a pair at most 2 * 255 * 63; the sums then hold 128 * sum(a) more,
// which `micro_passes` takes off. Two operations fewer per row and half tile than SIGNED.
enum class Bytes { UNSIGNED, SIGNED, SEVEN };

template <int MR, Bytes B = Bytes::UNSIGNED>
inline void sums(const uint8_t* const* rows, int64_t k, const int8_t* w, int64_t t0, int, __m256i (&acc)[MR][2]) {
  const int64_t steps = k / 4;
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(int8_t(0x80));
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
  const int8_t* wt = w + t0 * k * LANES;
  for (int64_t s = 0; s < steps; ++s) {
    _mm_prefetch(reinterpret_cast<const char*>(wt + s * 64 + AHEAD), _MM_HINT_T0);
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wt + s * 64));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wt + s * 64 + 32));
    // |w| or w + 128 serves every row of a signed step
    __m256i m0 = w0, m1 = w1;
    if constexpr (B == Bytes::SIGNED) m0 = _mm256_abs_epi8(w0), m1 = _mm256_abs_epi8(w1);
    if constexpr (B == Bytes::SEVEN) m0 = _mm256_xor_si256(w0, flip), m1 = _mm256_xor_si256(w1, flip);
    for (int m = 0; m < MR; ++m) {
      int32_t four;
      std::memcpy(&four, rows[m] + s * 4, 4);
      __m256i u0, u1, s0, s1;  // each half's unsigned and signed operands
      if constexpr (B == Bytes::SEVEN) {
        u0 = m0, u1 = m1, s0 = s1 = _mm256_set1_epi32(four);
      } else if constexpr (B == Bytes::SIGNED) {
        const __m256i av = _mm256_set1_epi32(four);
        u0 = m0, u1 = m1, s0 = _mm256_sign_epi8(av, w0), s1 = _mm256_sign_epi8(av, w1);
      } else {
        const __m256i av = _mm256_xor_si256(_mm256_set1_epi32(four), flip);  // a - 128, signed
        u0 = u1 = _mm256_abs_epi8(av), s0 = _mm256_sign_epi8(w0, av), s1 = _mm256_sign_epi8(w1, av);
      }
      acc[m][0] = _mm256_add_epi32(acc[m][0], _mm256_madd_epi16(_mm256_maddubs_epi16(u0, s0), ones));
      acc[m][1] = _mm256_add_epi32(acc[m][1], _mm256_madd_epi16(_mm256_maddubs_epi16(u1, s1), ones));
    }
  }
}

// A tile's outputs (two halves of 8, `mask` of each real) as float32: (sum - zero * rowsum) * scale
struct TileOut {
  __m256i mask[2], zc[2];
  __m256 sc[2];
  TileOut(int64_t r0, int64_t n, const int32_t* comp, const uint16_t* scale, int32_t zero) {
    const int64_t left = std::min<int64_t>(LANES, n - r0);
    alignas(32) uint16_t s16[LANES] = {};
    std::memcpy(s16, scale + r0, 2 * left);
    for (int h = 0; h < 2; ++h) {
      mask[h] = hcache::first8(left - 8 * h);
      // the sums are of a - 128: 128 * rowsum of the zero point's term is in them already
      zc[h] = _mm256_mullo_epi32(_mm256_maskload_epi32(comp + r0 + 8 * h, mask[h]), _mm256_set1_epi32(zero - 128));
      const __m256i b = _mm256_cvtepu16_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(s16 + 8 * h)));
      sc[h] = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
    }
  }
  __m256 operator()(__m256i acc, int h) const {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc, zc[h])), sc[h]);
  }
};

// rows 0..MR of `a` against tile t0, written to `out`
template <int MR>
void micro(const uint8_t* a, int64_t k, const int8_t* w, int64_t t0, int nt, int64_t n, const int32_t* comp,
           const uint16_t* scale, int32_t zero, float* out) {
  const uint8_t* rows[MR];
  for (int m = 0; m < MR; ++m) rows[m] = a + m * k;
  __m256i acc[MR][2];
  sums<MR>(rows, k, w, t0, nt, acc);
  const int64_t r0 = t0 * LANES;
  const TileOut y(r0, n, comp, scale, zero);
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < 2; ++h) _mm256_maskstore_ps(out + m * n + r0 + 8 * h, y.mask[h], y(acc[m][h], h));
}

inline __m256 silu(__m256 x) {  // as the AVX-512 form computes it
  const __m256 e = hcache::exp2_ps(_mm256_mul_ps(x, _mm256_set1_ps(-1.4426950408889634f)));
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e));
}

// `micro_passes` of the AVX-512 form: a tile's halves are a GLU's gate and up rows. SEVEN:
// 7-bit passes, whose sums hold 128 times their row's `asum` (the sum of its bytes) more
template <int P, Epilogue E, bool SEVEN>
void micro_passes(const uint8_t* a, int64_t m, int64_t k, const int8_t* w, int64_t r, int64_t t0, int nt, int64_t n,
                  const int32_t* comp, const uint16_t* scale, const float* ascale, const int32_t* asum,
                  const float* bias, float* out) {
  const uint8_t* rows[2 * P];
  for (int p = 0; p < P; ++p) rows[2 * p] = a + (r + p) * k, rows[2 * p + 1] = a + (m + r + p) * k;
  __m256i acc[2 * P][2];
  sums<2 * P, SEVEN ? Bytes::SEVEN : Bytes::SIGNED>(rows, k, w, t0, nt, acc);  // `passes` quantized them signed
  if constexpr (SEVEN)
    for (int p = 0; p < 2 * P; ++p) {
      const __m256i extra = _mm256_set1_epi32(128 * asum[p % 2 == 0 ? r + p / 2 : m + r + p / 2]);
      acc[p][0] = _mm256_sub_epi32(acc[p][0], extra), acc[p][1] = _mm256_sub_epi32(acc[p][1], extra);
    }
  const int64_t r0 = t0 * LANES;
  const TileOut y(r0, n, comp, scale, 128);
  for (int p = 0; p < P; ++p) {
    __m256 f[2];
    for (int h = 0; h < 2; ++h)
      f[h] = _mm256_add_ps(_mm256_mul_ps(y(acc[2 * p][h], h), _mm256_set1_ps(ascale[r + p])),
                           _mm256_mul_ps(y(acc[2 * p + 1][h], h), _mm256_set1_ps(ascale[m + r + p])));
    if constexpr (E == Epilogue::GLU) {
      _mm256_storeu_ps(out + (r + p) * (n / 2) + r0 / 2, _mm256_mul_ps(silu(f[0]), f[1]));
    } else {
      for (int h = 0; h < 2; ++h) {
        if constexpr (E == Epilogue::BIAS) f[h] = _mm256_add_ps(f[h], _mm256_maskload_ps(bias + r0 + 8 * h, y.mask[h]));
        _mm256_maskstore_ps(out + (r + p) * n + r0 + 8 * h, y.mask[h], f[h]);
      }
    }
  }
}
#endif

// `f(rows, r, t0, nt)` over every block of `rows` (<= RMAX) activation rows from r and group
// of nt (<= NR) tiles from t0. The work items are (block of `block` rows, group of tiles), by
// row block: for many rows (a prefill) a block stays in L2 while a thread's tiles stream past
template <int RMAX, typename F>
void over_tiles(int64_t m, int64_t tiles, int64_t block, F&& f) {
  const int64_t groups = (tiles + NR - 1) / NR, blocks = (m + block - 1) / block;
  hcache::parallel_steal(blocks * groups, [&](int64_t item) {
    const int64_t r0 = item / groups * block, g = item % groups;
    const int nt = int(std::min<int64_t>(NR, tiles - g * NR));
    for (int64_t r = r0; r < std::min(m, r0 + block); r += RMAX)
      hcache::with_rows<RMAX>(int(std::min<int64_t>(RMAX, m - r)), [&](auto rows) { f(rows, r, g * NR, nt); });
  });
}

// `(a - zero) @ w.T * scale`: a uint8 [M, K], w packed by `pack` for N rows, comp its row
// sums, scale bfloat16 [N] -> float32 [M, N]
at::Tensor int8_mm(const at::Tensor& a, const at::Tensor& w, const at::Tensor& comp, const at::Tensor& scale,
                   int64_t zero) {
  TORCH_CHECK(a.dim() == 2 && a.scalar_type() == at::kByte && a.is_contiguous(), "int8_mm: uint8 [M, K] rows");
  TORCH_CHECK(comp.is_contiguous() && scale.is_contiguous() && w.is_contiguous(), "int8_mm: contiguous operands");
  TORCH_CHECK(w.dim() == 4 && w.size(2) == LANES && w.size(3) == 4 && w.scalar_type() == at::kChar, "int8_mm: packed weights");
  const int64_t m = a.size(0), k = a.size(1), n = scale.size(0), tiles = w.size(0);
  TORCH_CHECK(w.size(1) * 4 == k && (n + LANES - 1) / LANES == tiles && comp.size(0) == n, "int8_mm: shapes differ");
  TORCH_CHECK(comp.scalar_type() == at::kInt && scale.scalar_type() == at::kBFloat16, "int8_mm: int32 sums, bfloat16 scales");
  at::Tensor out = at::empty({m, n}, a.options().dtype(at::kFloat));
  const uint8_t* ap = a.data_ptr<uint8_t>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const int32_t* cp = comp.data_ptr<int32_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::BFloat16>());
  float* op = out.data_ptr<float>();
  const int64_t block = std::max<int64_t>(MR_MAX, (ACT_BLOCK / k) / MR_MAX * MR_MAX);
  over_tiles<MR_MAX>(m, tiles, block, [&](auto rows, int64_t r, int64_t t0, int nt) {
    micro<decltype(rows)::value>(ap + r * k, k, wp, t0, nt, n, cp, sp, int32_t(zero), op + r * n);
  });
  return out;
}

// `x @ w.T (+ bias)` for float32 or bfloat16 x [M, K]: each row quantized on its own to two
// passes of `bits` (8, or 7: act_quant.h) around the zero point 2^(bits-1), each pass summed as
// `int8_mm` sums it, and the two results meet as `y1 * s1 + y2 * s2`: the bits of
// `quant.int8_rows_mm` around `int8_mm`, with only the combined rows written out (then
// `+ bias`, float32 [N], as torch adds it). With `glu`, w's rows are `quant.glu_rows` of a gate
// and an up matrix: [M, N / 2] of `silu(x @ gate.T) * (x @ up.T)`
at::Tensor passes(const at::Tensor& x, const at::Tensor& w, const at::Tensor& comp, const at::Tensor& scale,
                  const std::optional<at::Tensor>& bias, bool glu, int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "int8_linear: float32 or bfloat16 [M, K] activations");
  TORCH_CHECK(w.dim() == 4 && w.size(2) == LANES && w.size(3) == 4 && w.scalar_type() == at::kChar && w.is_contiguous(),
              "int8_linear: packed weights");
  TORCH_CHECK(w.size(1) * 4 == x.size(1), "int8_linear: K differs from the packed weights'");
  TORCH_CHECK(comp.is_contiguous() && scale.is_contiguous() && comp.scalar_type() == at::kInt &&
                  scale.scalar_type() == at::kBFloat16,
              "int8_linear: contiguous int32 sums and bfloat16 scales");
  const int64_t m = x.size(0), k = x.size(1), n = scale.size(0), tiles = w.size(0);
  TORCH_CHECK((n + LANES - 1) / LANES == tiles && comp.size(0) == n, "int8_linear: N differs");
  TORCH_CHECK(!glu || n % LANES == 0, "int8_glu: gate and up rows of a multiple of 8 each");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n),
              "int8_linear: a contiguous float32 bias of N");
  TORCH_CHECK(bits == 7 || bits == 8, "int8_linear: activations of 7 or 8 bits, got ", bits);
  const at::Tensor xc = x.contiguous();
  at::Tensor a = at::empty({2 * m, k}, xc.options().dtype(at::kByte));
  std::vector<float> scales(2 * m);
  // VNNI's unsigned form around the zero point (+ 128 as a byte); AVX2's `sums` take them signed
  hcache::quantize_rows(xc, reinterpret_cast<int8_t*>(a.data_ptr<uint8_t>()), scales.data(), PASS_OFFSET, int(bits));
  const bool seven = bits == 7;
  std::vector<int32_t> asum;  // each pass row's sum of bytes: what AVX2's 7-bit sums hold 128 times too many
#ifndef __AVX512VNNI__
  if (seven) {
    asum.resize(2 * m);
    const int8_t* q = reinterpret_cast<const int8_t*>(a.data_ptr<uint8_t>());
    for (int64_t row = 0; row < 2 * m; ++row) {
      int32_t total = 0;
      for (int64_t j = 0; j < k; ++j) total += q[row * k + j];
      asum[row] = total;
    }
  }
#endif
  at::Tensor out = at::empty({m, glu ? n / 2 : n}, xc.options().dtype(at::kFloat));
  const uint8_t* ap = a.data_ptr<uint8_t>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const int32_t* cp = comp.data_ptr<int32_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::BFloat16>());
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  constexpr int P_MAX = MR_MAX / 2;
  const int64_t block = std::max<int64_t>(P_MAX, (ACT_BLOCK / (2 * k)) / P_MAX * P_MAX);  // both passes in L2
  const int32_t* sa = asum.data();
  over_tiles<P_MAX>(m, tiles, block, [&](auto rows, int64_t r, int64_t t0, int nt) {
    constexpr int P = decltype(rows)::value;
    const float* as = scales.data();
    if (glu)
      micro_passes<P, Epilogue::GLU, false>(ap, m, k, wp, r, t0, nt, n, cp, sp, as, sa, bp, op);
    else if (seven && bp != nullptr)
      micro_passes<P, Epilogue::BIAS, true>(ap, m, k, wp, r, t0, nt, n, cp, sp, as, sa, bp, op);
    else if (seven)
      micro_passes<P, Epilogue::PLAIN, true>(ap, m, k, wp, r, t0, nt, n, cp, sp, as, sa, bp, op);
    else if (bp != nullptr)
      micro_passes<P, Epilogue::BIAS, false>(ap, m, k, wp, r, t0, nt, n, cp, sp, as, sa, bp, op);
    else
      micro_passes<P, Epilogue::PLAIN, false>(ap, m, k, wp, r, t0, nt, n, cp, sp, as, sa, bp, op);
  });
  return out;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& comp, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias, int64_t bits) {
  return passes(x, w, comp, scale, bias, false, bits);
}

at::Tensor int8_glu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& comp, const at::Tensor& scale) {
  return passes(x, w, comp, scale, std::nullopt, true, 8);
}

}  // namespace

#ifdef __AVX512VNNI__
#define HCACHE_NS hcache_int8
#else
#define HCACHE_NS hcache_int8_avx2
#endif
#define LIBRARY(ns, lib) TORCH_LIBRARY(ns, lib)
#define LIBRARY_IMPL(ns, key, lib) TORCH_LIBRARY_IMPL(ns, key, lib)

LIBRARY(HCACHE_NS, lib) {
  lib.def("pack(Tensor w) -> (Tensor, Tensor)");
  lib.def("int8_mm(Tensor a, Tensor w, Tensor comp, Tensor scale, int zero) -> Tensor");
  lib.def("int8_linear(Tensor x, Tensor w, Tensor comp, Tensor scale, Tensor? bias=None, int bits=8) -> Tensor");
  lib.def("int8_glu(Tensor x, Tensor w, Tensor comp, Tensor scale) -> Tensor");
}

LIBRARY_IMPL(HCACHE_NS, CPU, lib) {
  lib.impl("pack", &pack);
  lib.impl("int8_mm", &int8_mm);
  lib.impl("int8_linear", &int8_linear);
  lib.impl("int8_glu", &int8_glu);
}

// shapes only, for tracing: symbolic, so a compiled graph serves every row count
LIBRARY_IMPL(HCACHE_NS, Meta, lib) {
  lib.impl("int8_mm", [](const at::Tensor& a, const at::Tensor&, const at::Tensor&, const at::Tensor& scale, int64_t) {
    return at::empty_symint({a.sym_size(0), scale.sym_size(0)}, a.options().dtype(at::kFloat));
  });
  lib.impl("int8_linear", [](const at::Tensor& x, const at::Tensor&, const at::Tensor&, const at::Tensor& scale,
                             const std::optional<at::Tensor>&, int64_t) {
    return at::empty_symint({x.sym_size(0), scale.sym_size(0)}, x.options().dtype(at::kFloat));
  });
  lib.impl("int8_glu", [](const at::Tensor& x, const at::Tensor&, const at::Tensor&, const at::Tensor& scale) {
    return at::empty_symint({x.sym_size(0), scale.sym_size(0) / 2}, x.options().dtype(at::kFloat));
  });
}
