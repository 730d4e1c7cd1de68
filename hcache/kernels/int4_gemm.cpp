// Float32 or bfloat16 activations, quantized inside the call to two int8 passes, times 4-bit
// weight groups with AVX512-VNNI (`vpdpbusd`), or with AVX2 where it lacks (the same
// integers, below): the int4 linears of a decode step, a turn and a prefill.
//
// torch's int4 kernel widens each weight to float32 and multiplies with FMAs: at one row it
// streams the weights at under half the machine's read rate, and at 32 rows it is bound by
// the FMA rate. Here the weights lie in tiles of 16 output rows by 8 inputs (`pack`): one
// 64-byte load holds two steps of 4 inputs (low and high nibbles), each feeding one
// `vpdpbusd` per activation row, and a tile's 16 sums land in the 16 lanes of one register.
// Per group of 32 inputs the integer sum is exact; it meets the group's scale and zero in
// float32 (both products exact), and the groups add in input order. A result depends neither
// on the rows beside it, the threads, nor the blocking.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "act_quant.h"
#include "steal.h"
#include "vec_math.h"

namespace {

constexpr int64_t LANES = 16;   // output rows per tile
constexpr int64_t GROUP = 32;   // inputs per scale and zero
constexpr int64_t FEW = 1;      // up to these rows, one tile: the weights then stream in order
#ifdef __AVX512VNNI__
constexpr int NR_MAX = 2;  // tiles a micro-kernel streams at once, past FEW rows
// activation rows it holds (both passes of 4 rows): NR_MAX * MR_MAX int32 sums in registers,
// and as many float32 ones, which the compiler keeps partly in L1, touched once a group; each
// tile's nibbles are split once for 8 rows rather than 4
constexpr int MR_MAX = 8;
#else
// AVX2's 16 registers: a tile's two halves (8 rows each) as int16 sums for 4 activation rows
constexpr int NR_MAX = 1;
constexpr int MR_MAX = 4;
#endif
constexpr int64_t AHEAD = 2048;  // bytes of each tile's stream prefetched ahead: a row's step waits on DRAM latency

// `q` [N, K] in 0..15 -> uint8 [ceil(N/16), K/8, 16, 4]: tile t, pair p holds rows
// 16t..16t+15, inputs 8p..8p+3 in the low nibbles and 8p+4..8p+7 in the high ones
// (missing rows zero)
at::Tensor pack(const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte, "pack: uint8 [N, K] nibbles expected");
  const int64_t n = q.size(0), k = q.size(1), tiles = (n + LANES - 1) / LANES;
  TORCH_CHECK(k % GROUP == 0, "pack: K must be a multiple of ", GROUP, ", got ", k);
  TORCH_CHECK(q.max().item<int>() < 16, "pack: values past 15");
  at::Tensor qc = q.contiguous();
  at::Tensor out = at::zeros({tiles, k / 8, LANES, 4}, q.options());
  const uint8_t* src = qc.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, n, 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const uint8_t* row = src + i * k;
      uint8_t* base = dst + (i / LANES) * k * LANES / 2 + (i % LANES) * 4;
      for (int64_t p = 0; p < k / 8; ++p)
        for (int j = 0; j < 4; ++j) base[p * LANES * 4 + j] = uint8_t(row[8 * p + j] | (row[8 * p + 4 + j] << 4));
    }
  });
  return out;
}

struct Operands {
  const int8_t* a;      // [2M, K] activations: row i's first pass, row M + i its second
  const int32_t* asum;  // [2M, K / GROUP] `group_start` of each group of them
  const float* asumf;   // [2M, K / GROUP] and that sum
  const float* ascale;  // [2M] each row's scale
  const uint8_t* w;     // tiles
  const uint32_t* sz;   // [K / GROUP, N] bfloat16 (scale, zero) pairs
  float* out;           // [M, N]
  int64_t m, k, n, tiles;
};

#ifdef __AVX512VNNI__
// A group's 32 activations, as the sums of inputs 0-1 and 2-3 of every 4, as the micro-kernel
// takes them: 8 * their sum, the part of sum(a * q) that the weights' -8 removes
inline int32_t group_start(const int32_t (&half)[2]) { return 8 * (half[0] + half[1]); }

// rows r..r+P of the activations, both passes of each (rows i and m + i), against tiles
// t0..t0+nt (nt <= NR): the two passes' sums meet as `y1 * s1 + y2 * s2` in registers.
// WHOLE (nt == NR, every group but perhaps the last) makes the tile tests compile away: a
// runtime nt left branches in the inner loop, around which gcc spilled accumulators.
template <int P, int NR, bool WHOLE>
void micro(const Operands& o, int64_t r, int64_t t0, int nt_) {
  const int nt = WHOLE ? NR : nt_;
  constexpr int MR = 2 * P;
  int64_t row[MR];
  for (int p = 0; p < P; ++p) row[2 * p] = r + p, row[2 * p + 1] = o.m + r + p;
  const int64_t tile = o.k * LANES / 2, groups = o.k / GROUP;
  const uint8_t* wt[NR];
  for (int j = 0; j < NR; ++j) wt[j] = o.w + (t0 + std::min(j, nt - 1)) * tile;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i high = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  __mmask16 mask[NR];
  for (int j = 0; j < NR; ++j) {
    const int64_t left = std::min<int64_t>(LANES, o.n - (t0 + j) * LANES);
    mask[j] = j < nt ? __mmask16((1u << left) - 1) : 0;
  }
  __m512 sum[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) sum[m][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[MR][NR];
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_setzero_si512();
    for (int64_t p = g * GROUP / 8; p < (g + 1) * GROUP / 8; ++p) {
      __m512i lo[NR], hi[NR];
      for (int j = 0; j < NR; ++j)
        if (j < nt) {
          _mm_prefetch(reinterpret_cast<const char*>(wt[j] + p * 64 + AHEAD), _MM_HINT_T0);
          const __m512i v = _mm512_loadu_si512(wt[j] + p * 64);
          lo[j] = _mm512_and_si512(v, low);
          hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
      for (int m = 0; m < MR; ++m) {
        const int32_t* four = reinterpret_cast<const int32_t*>(o.a + row[m] * o.k + p * 8);
        const __m512i a0 = _mm512_set1_epi32(four[0]), a1 = _mm512_set1_epi32(four[1]);
        for (int j = 0; j < NR; ++j)
          if (j < nt) {
            acc[m][j] = _mm512_dpbusd_epi32(acc[m][j], lo[j], a0);
            acc[m][j] = _mm512_dpbusd_epi32(acc[m][j], hi[j], a1);
          }
      }
    }
    // the next tiles' line of this group's scales, `n` pairs past the last group's: the
    // prefetchers do not follow that stride
    for (int j = 0; j < NR; ++j)
      _mm_prefetch(reinterpret_cast<const char*>(o.sz + g * o.n + std::min(t0 + NR + j, o.tiles - 1) * LANES),
                   _MM_HINT_T0);
    for (int j = 0; j < nt; ++j) {
      // the pairs of 16 lanes: the scale in the low half of each 32 bits, the zero in the high
      const __m512i v = _mm512_maskz_loadu_epi32(mask[j], o.sz + g * o.n + (t0 + j) * LANES);
      const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(v, high));
      for (int m = 0; m < MR; ++m) {
        const int64_t i = row[m] * groups + g;
        // weight = (q - 8) * scale + zero: sum(a * (q - 8)) is exact in 16 bits, so both
        // products are exact in float32 and only the two additions round
        const __m512i centred = _mm512_sub_epi32(acc[m][j], _mm512_set1_epi32(o.asum[i]));
        sum[m][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), scale, sum[m][j]);
        sum[m][j] = _mm512_fmadd_ps(_mm512_set1_ps(o.asumf[i]), zero, sum[m][j]);
      }
    }
  }
  for (int j = 0; j < nt; ++j)
    for (int p = 0; p < P; ++p) {
      // two products and one sum, as the Python computes them (no fused multiply-add)
      const __m512 f = _mm512_add_ps(_mm512_mul_ps(sum[2 * p][j], _mm512_set1_ps(o.ascale[row[2 * p]])),
                                     _mm512_mul_ps(sum[2 * p + 1][j], _mm512_set1_ps(o.ascale[row[2 * p + 1]])));
      _mm512_mask_storeu_ps(o.out + (r + p) * o.n + (t0 + j) * LANES, mask[j], f);
    }
}

#else
// A group's 32 activations (`half`: as above) as the AVX2 sums start: each 32-bit lane's two
// 16-bit halves sum the products of inputs 0-1 and 2-3 of every 4, and start at -8 times those
// inputs' sum. Every partial sum is then sum(a * (q - 8)) over the inputs added so far plus
// -8 * a over the rest: 16 terms of at most 127 * 8, within 16 bits in any order. The halves
// end as the group's sum(a * (q - 8)): no -8 * sum(a) is left to subtract per row and half tile.
inline int32_t group_start(const int32_t (&half)[2]) {
  return int32_t(uint16_t(-8 * half[0]) | uint32_t(uint16_t(-8 * half[1])) << 16);
}

// One group's integer sums of activation rows a[0..2P] (32 bytes each from `at`) against a
// tile's 32 inputs (256 bytes at w), added to acc as int16 pairs per lane. In assembly: at
// P = 2 both halves of a tile for 4 rows (8 registers), the nibbles (4), their mask, a
// broadcast and a product fill 15 of AVX2's 16 registers, and gcc's allocation of the same
// intrinsics spilled sums to the stack at every step. It reads the weights and the rows
// through its pointers: hence "memory".
#define I4_UNPACK(W)                                                                            \
  "vmovdqu " #W "(%[w]), %[lo0]\n\tvpsrlw $4, %[lo0], %[hi0]\n\t"                             \
  "vpand %[low], %[lo0], %[lo0]\n\tvpand %[low], %[hi0], %[hi0]\n\t"                          \
  "vmovdqu " #W "+32(%[w]), %[lo1]\n\tvpsrlw $4, %[lo1], %[hi1]\n\t"                          \
  "vpand %[low], %[lo1], %[lo1]\n\tvpand %[low], %[hi1], %[hi1]\n\t"
#define I4_ROW(ROW, A, S0, S1)                                                                  \
  "vpbroadcastd " #A "(%[" #ROW "]), %[b]\n\t"                                                  \
  "vpmaddubsw %[b], %[lo0], %[t]\n\tvpaddw %[t], %[" #S0 "], %[" #S0 "]\n\t"                  \
  "vpmaddubsw %[b], %[lo1], %[t]\n\tvpaddw %[t], %[" #S1 "], %[" #S1 "]\n\t"                  \
  "vpbroadcastd " #A "+4(%[" #ROW "]), %[b]\n\t"                                                \
  "vpmaddubsw %[b], %[hi0], %[t]\n\tvpaddw %[t], %[" #S0 "], %[" #S0 "]\n\t"                  \
  "vpmaddubsw %[b], %[hi1], %[t]\n\tvpaddw %[t], %[" #S1 "], %[" #S1 "]\n\t"
#define I4_STEP1(W, A) I4_UNPACK(W) I4_ROW(r0, A, s00, s01) I4_ROW(r1, A, s10, s11)
#define I4_STEP2(W, A) I4_STEP1(W, A) I4_ROW(r2, A, s20, s21) I4_ROW(r3, A, s30, s31)
#define I4_GROUP(STEP) STEP(0, 0) STEP(64, 8) STEP(128, 16) STEP(192, 24)

template <int P>
__attribute__((always_inline)) inline void group_sums(const uint8_t* w, const int8_t* const* a, int64_t at,
                                                      __m256i (&acc)[2 * P][2]) {
  static_assert(P == 1 || P == 2, "AVX2 holds the sums of at most 4 rows");
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256i lo0, hi0, lo1, hi1, b, t;
  const int8_t *r0 = a[0] + at, *r1 = a[1] + at;
  if constexpr (P == 1) {
    asm(I4_GROUP(I4_STEP1)
        : [s00] "+x"(acc[0][0]), [s01] "+x"(acc[0][1]), [s10] "+x"(acc[1][0]), [s11] "+x"(acc[1][1]),
          [lo0] "=&x"(lo0), [hi0] "=&x"(hi0), [lo1] "=&x"(lo1), [hi1] "=&x"(hi1), [b] "=&x"(b), [t] "=&x"(t)
        : [w] "r"(w), [r0] "r"(r0), [r1] "r"(r1), [low] "x"(low)
        : "memory");
  } else {
    const int8_t *r2 = a[2] + at, *r3 = a[3] + at;
    asm(I4_GROUP(I4_STEP2)
        : [s00] "+x"(acc[0][0]), [s01] "+x"(acc[0][1]), [s10] "+x"(acc[1][0]), [s11] "+x"(acc[1][1]),
          [s20] "+x"(acc[2][0]), [s21] "+x"(acc[2][1]), [s30] "+x"(acc[3][0]), [s31] "+x"(acc[3][1]),
          [lo0] "=&x"(lo0), [hi0] "=&x"(hi0), [lo1] "=&x"(lo1), [hi1] "=&x"(hi1), [b] "=&x"(b), [t] "=&x"(t)
        : [w] "r"(w), [r0] "r"(r0), [r1] "r"(r1), [r2] "r"(r2), [r3] "r"(r3), [low] "x"(low)
        : "memory");
  }
}

// The same sums with AVX2 (`vpmaddubsw`): a nibble times an int8 activation, summed in pairs
// into 16 bits, is at most 2 * 15 * 127; a group's 8 such pairs per lane stay within 16 bits,
// so the group sums in 16-bit lanes exactly and widens once (`vpmaddwd`), to the VNNI form's
// integers. The floating-point steps are the VNNI form's, lane for lane: the same bits.
template <int P, int NR, bool WHOLE>
void micro(const Operands& o, int64_t r, int64_t t0, int) {
  static_assert(NR == 1, "one tile at a time in AVX2's registers");
  constexpr int MR = 2 * P;
  int64_t row[MR];
  for (int p = 0; p < P; ++p) row[2 * p] = r + p, row[2 * p + 1] = o.m + r + p;
  const int64_t groups = o.k / GROUP;
  const uint8_t* wt = o.w + t0 * (o.k * LANES / 2);
  const int8_t* a[MR];
  for (int m = 0; m < MR; ++m) a[m] = o.a + row[m] * o.k;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i high = _mm256_set1_epi32(int32_t(0xFFFF0000u));
  const int64_t left = std::min<int64_t>(LANES, o.n - t0 * LANES);
  __m256i mask[2];
  for (int h = 0; h < 2; ++h)
    mask[h] = hcache::first8(left - 8 * h);
  __m256 sum[MR][2];
  for (int m = 0; m < MR; ++m) sum[m][0] = sum[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i acc[MR][2];
    for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_set1_epi32(o.asum[row[m] * groups + g]);
    // the tile streams from memory for its first rows only; later ones find it in L1
    if (r == 0)
      for (int64_t line = 0; line < GROUP * LANES / 2; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wt + g * GROUP * LANES / 2 + line + AHEAD), _MM_HINT_T0);
    group_sums<P>(wt + g * GROUP * LANES / 2, a, g * GROUP, acc);
    _mm_prefetch(reinterpret_cast<const char*>(o.sz + g * o.n + std::min(t0 + 1, o.tiles - 1) * LANES), _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_maskload_epi32(reinterpret_cast<const int*>(o.sz + g * o.n + t0 * LANES + 8 * h), mask[h]);
      const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      const __m256 zero = _mm256_castsi256_ps(_mm256_and_si256(v, high));
      for (int m = 0; m < MR; ++m) {
        const __m256i centred = _mm256_madd_epi16(acc[m][h], ones);
        sum[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred), scale, sum[m][h]);
        sum[m][h] = _mm256_fmadd_ps(_mm256_set1_ps(o.asumf[row[m] * groups + g]), zero, sum[m][h]);
      }
    }
  }
  for (int h = 0; h < 2; ++h)
    for (int p = 0; p < P; ++p) {
      const __m256 f = _mm256_add_ps(_mm256_mul_ps(sum[2 * p][h], _mm256_set1_ps(o.ascale[row[2 * p]])),
                                     _mm256_mul_ps(sum[2 * p + 1][h], _mm256_set1_ps(o.ascale[row[2 * p + 1]])));
      _mm256_maskstore_ps(o.out + (r + p) * o.n + t0 * LANES + 8 * h, mask[h], f);
    }
}
#endif

// `x @ w.T`, float32 [M, N], for float32 or bfloat16 x [M, K] and the int4 groups `w = (q - 8) * scale +
// zero` of [N, K], the nibbles packed by `pack`, scale_zeros bfloat16 [K / 32, N, 2]. Each row
// of x is quantized on its own in two int8 passes (act_quant.h), and the two results meet as
// `y1 * s1 + y2 * s2` before they are written.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale_zeros) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "int4_linear: float32 or bfloat16 [M, K] activations");
  TORCH_CHECK(w.dim() == 4 && w.size(2) == LANES && w.size(3) == 4 && w.scalar_type() == at::kByte,
              "int4_linear: packed weights");
  TORCH_CHECK(scale_zeros.dim() == 3 && scale_zeros.size(2) == 2 && scale_zeros.scalar_type() == at::kBFloat16,
              "int4_linear: bfloat16 [K/32, N, 2] scales and zeros");
  const int64_t m = x.size(0), k = x.size(1), n = scale_zeros.size(1), tiles = w.size(0), groups = k / GROUP;
  TORCH_CHECK(k % GROUP == 0 && w.size(1) * 8 == k && scale_zeros.size(0) == groups, "int4_linear: K differs");
  TORCH_CHECK((n + LANES - 1) / LANES == tiles, "int4_linear: N differs");
  const at::Tensor xc = x.contiguous(), szc = scale_zeros.contiguous(), wc = w.contiguous();
  const auto f32 = xc.options().dtype(at::kFloat);
  // rows 0..M-1 the first pass, M..2M-1 the second: int8 values, each group's sum (times 8
  // and as a float), and each row's two scales
  at::Tensor q = at::empty({2 * m, k}, xc.options().dtype(at::kChar));
  at::Tensor sum8 = at::empty({2 * m, groups}, xc.options().dtype(at::kInt));
  at::Tensor sumf = at::empty({2 * m, groups}, f32);
  std::vector<float> scales(2 * m);
  int8_t* qp = q.data_ptr<int8_t>();
  hcache::quantize_rows(xc, qp, scales.data(), 0);
  {
    int32_t* s8 = sum8.data_ptr<int32_t>();
    float* sf = sumf.data_ptr<float>();
    at::parallel_for(0, 2 * m, 16, [&](int64_t b, int64_t e) {
      for (int64_t row = b; row < e; ++row)
        for (int64_t g = 0; g < groups; ++g) {
          // inputs 0-1 and 2-3 of every 4 apart: what AVX2's sums start from
          const int8_t* a = qp + row * k + g * GROUP;
          int32_t half[2] = {0, 0};
          for (int j = 0; j < GROUP; j += 4) half[0] += a[j] + a[j + 1], half[1] += a[j + 2] + a[j + 3];
          s8[row * groups + g] = group_start(half);
          sf[row * groups + g] = float(half[0] + half[1]);
        }
    });
  }
  at::Tensor y = at::empty({m, n}, f32);
  const Operands o{q.data_ptr<int8_t>(), sum8.data_ptr<int32_t>(), sumf.data_ptr<float>(), scales.data(),
                   wc.data_ptr<uint8_t>(), reinterpret_cast<const uint32_t*>(szc.data_ptr<at::BFloat16>()),
                   y.data_ptr<float>(), m, k, n, tiles};
  constexpr int P_MAX = MR_MAX / 2;
  auto group = [&](auto nr, int64_t t) {
    constexpr int R = decltype(nr)::value;
    const int nt = int(std::min<int64_t>(R, tiles - t * R));
    for (int64_t r = 0; r < m; r += P_MAX)
      hcache::with_rows<P_MAX>(int(std::min<int64_t>(P_MAX, m - r)),
                               [&](auto p) {
                                 constexpr int P = decltype(p)::value;
                                 if (nt == R)
                                   micro<P, R, true>(o, r, t * R, nt);
                                 else
                                   micro<P, R, false>(o, r, t * R, nt);
                               });
  };
  // a few rows are bound by reading the weights, which one tile at a time reads in order
  // (two interleaved tiles' streams read slower), in a fixed split: a tile is too little work
  // to claim on its own. More rows reuse each load for NR_MAX tiles, and threads take groups
  // of them as they come free
  if (m <= FEW)
    at::parallel_for(0, tiles, 1, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) group(std::integral_constant<int, 1>{}, t);
    });
  else
    hcache::parallel_steal((tiles + NR_MAX - 1) / NR_MAX,
                           [&](int64_t t) { group(std::integral_constant<int, NR_MAX>{}, t); });
  return y;
}

}  // namespace

#ifdef __AVX512VNNI__
#define HCACHE_NS hcache_int4
#else
#define HCACHE_NS hcache_int4_avx2
#endif
#define LIBRARY(ns, lib) TORCH_LIBRARY(ns, lib)
#define LIBRARY_IMPL(ns, key, lib) TORCH_LIBRARY_IMPL(ns, key, lib)

LIBRARY(HCACHE_NS, lib) {
  lib.def("pack(Tensor q) -> Tensor");
  lib.def("int4_linear(Tensor x, Tensor w, Tensor scale_zeros) -> Tensor");
}

LIBRARY_IMPL(HCACHE_NS, CPU, lib) {
  lib.impl("pack", &pack);
  lib.impl("int4_linear", &int4_linear);
}

// shapes only, for tracing: symbolic, so a compiled graph serves every row count
LIBRARY_IMPL(HCACHE_NS, Meta, lib) {
  lib.impl("int4_linear", [](const at::Tensor& x, const at::Tensor&, const at::Tensor& scale_zeros) {
    return at::empty_symint({x.sym_size(0), scale_zeros.sym_size(1)}, x.options().dtype(at::kFloat));
  });
}
