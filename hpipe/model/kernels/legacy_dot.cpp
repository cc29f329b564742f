// Decode rows of Q4_0, Q4_1 and Q8_0 weights whose rows hold 1,024 values or more (Q8_0 and Q4_0
// files of billion-parameter models, their Q8_0 heads, SmolLM2's down projections) as integer dot
// products with x in 15 bits per 32 values: q8_dot.cpp's arithmetic for K-quants, on blocks of 32
// (docs/decisions/int8-decode.md).
//
// In float32 a decode row converts every weight to a float and multiplies it once: one row of a
// 1B-shaped Q8_0 file decoded in 1.9x the time to read its weights (2 threads, capped at AVX2 on a
// Zen 4), Q4_1 rows 4,096 long ran at 8 GB/s of blocks a core against 29 for a sum over
// memory. Here a decode row of
// x is rounded once per call, each 32 values to integers of at most 16383 with one float scale
// (and, for Q4_1's minimum, that scale times their sum); a block's 32 weights are widened to 16
// bits (the nibbles less 8 for Q4_0) and meet x's values in two vpmaddwd, and vphaddd gathers each
// block's products into one exact integer. The float work then runs once for 8 blocks: block b
// goes to lane b % 8 of a float sum, (d x the row's scale) x integer, multiplied and added in that
// order (Q4_1's minimum times x's scaled sum to lanes of their own); the lanes are added in one
// fixed order at the end. So a row's result is the same bits whatever rows share its call and
// whatever instruction set computes it (AVX-512 CPUs run the AVX2 loop, others the scalar one),
// as for the K-quants.
#include "quant.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace hpipe {
namespace {

constexpr int64_t QB = 32;  // values per block, of the weights and of x's rounding
constexpr int64_t Q4_0 = 2, Q4_1 = 3, Q8_0 = 8;
constexpr int64_t kLanes = 8;  // blocks whose float work runs at once

int64_t block_bytes(int64_t type) { return type == Q4_0 ? 18 : type == Q4_1 ? 20 : 34; }
int64_t values_at(int64_t type) { return type == Q4_1 ? 4 : 2; }  // after d (and Q4_1's minimum)

// ---- the scalar form: what every CPU computes, and what the AVX2 form must equal bit for bit ----
// Per row of x: block b's exact integer sum S_b (the weights' integers times x's), then in float
// lane b % 8 of the sums: acc += (d_b x dx_b) x S_b, and for Q4_1 lane b % 8 of the minimums'
// sums: accm += m_b x (dx_b S'_b), where S'_b is x's own sum; blocks past the row's last, to a
// multiple of 8, add (0 x dx) x 0 and 0 x x's next values (the padding X32Rows keeps), as the
// AVX2 form's zeroed lanes do. The result: sum_lanes(acc) + sum_lanes(accm).
void rows_portable(int64_t type, const uint8_t* blocks, int64_t row_bytes, int64_t n0, int64_t n1, const X32Rows& q,
                   int64_t m, int64_t k, float* out, int64_t ldo) {
  const int64_t nb = k / QB, bytes = block_bytes(type), padded = (nb + kLanes - 1) / kLanes * kLanes;
  for (int64_t w = n0; w < n1; ++w) {
    const uint8_t* row = blocks + w * row_bytes;
    for (int64_t r = 0; r < m; ++r) {
      float acc[kLanes] = {}, accm[kLanes] = {};
      for (int64_t b = 0; b < padded; ++b) {
        int32_t sum = 0;
        float d = 0.0f, dmin = 0.0f;
        if (b < nb) {
          const uint8_t* blk = row + b * bytes;
          const uint8_t* qs = blk + values_at(type);
          const int16_t* y = q.v.data() + r * k + b * QB;
          for (int i = 0; i < QB; ++i) {
            const int32_t wv = type == Q8_0 ? static_cast<int8_t>(qs[i]) :
                               (i < 16 ? qs[i] & 0xF : qs[i - 16] >> 4) - (type == Q4_0 ? 8 : 0);
            sum += wv * y[i];
          }
          d = f16_at(blk);
          if (type == Q4_1) dmin = f16_at(blk + 2);
        }
        const int L = static_cast<int>(b % kLanes);
        acc[L] = acc[L] + (d * q.d[r * nb + b]) * static_cast<float>(sum);
        if (type == Q4_1) accm[L] = accm[L] + dmin * q.ds[r * nb + b];
      }
      out[r * ldo + w] = sum_lanes(acc) + sum_lanes(accm);
    }
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
// sum_lanes of a register, the same additions in the same order
__attribute__((target("avx2"))) inline float lane_sum(__m256 v) {
  const __m256 pairs = _mm256_add_ps(v, _mm256_permute_ps(v, 0xB1));
  const __m256 quads = _mm256_add_ps(pairs, _mm256_permute_ps(pairs, 0x4E));
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1)));
}

// a block's 32 weights as two registers of 16-bit integers: values 0-15, 16-31
template <int64_t type>
__attribute__((target("avx2"))) inline void widen(const uint8_t* qs, __m256i& lo, __m256i& hi) {
  if constexpr (type == Q8_0) {
    lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16)));
  } else {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    lo = _mm256_cvtepu8_epi16(_mm_and_si128(packed, low4));
    hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), low4));
    if constexpr (type == Q4_0) {
      const __m256i eight = _mm256_set1_epi16(8);
      lo = _mm256_sub_epi16(lo, eight);
      hi = _mm256_sub_epi16(hi, eight);
    }
  }
}

// block j's d (and Q4_1's minimum) of 8 blocks `bytes` apart, as floats (F16C converts exactly,
// as c10::Half): one 32-bit load a block, where all 8 blocks are there (no stores to reload)
template <int64_t type>
__attribute__((target("avx2,f16c"))) inline void factors(const uint8_t* blk0, int64_t count, __m256& d, __m256& dmin) {
  constexpr int64_t bytes = type == Q4_0 ? 18 : type == Q4_1 ? 20 : 34;
  int32_t w[kLanes] = {};
  if (count == kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) std::memcpy(w + j, blk0 + j * bytes, 4);
  } else {
    for (int64_t j = 0; j < count; ++j) std::memcpy(w + j, blk0 + j * bytes, type == Q4_1 ? 4 : 2);
  }
  const __m256i both = _mm256_setr_epi32(w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]);
  // d in the low 16 bits of each, the minimum in the high: [d0-3 m0-3 | d4-7 m4-7], then in order
  const __m256i packed = _mm256_packus_epi32(_mm256_and_si256(both, _mm256_set1_epi32(0xFFFF)), _mm256_srli_epi32(both, 16));
  const __m256i ordered = _mm256_permute4x64_epi64(packed, 0xD8);
  d = _mm256_cvtph_ps(_mm256_castsi256_si128(ordered));
  dmin = type == Q4_1 ? _mm256_cvtph_ps(_mm256_extracti128_si256(ordered, 1)) : _mm256_setzero_ps();
}

// one weight row against rows r0 to r0 + n of x (n a constant, so that their sums stay in
// registers), 8 blocks at a time: each block's 32 weights widened once for every row, its 8 lanes
// of products gathered by vphaddd into one integer a block (exact), the float work once for 8
// blocks (no FMA: a multiply, then an add, as the scalar form rounds; the target has no "fma", so
// the compiler fuses none)
template <int64_t type, int n>
__attribute__((target("avx2,f16c"))) void row_avx2(const uint8_t* row, int64_t nb, const X32Rows& q, int64_t k,
                                                   int64_t r0, float* res) {
  constexpr int64_t bytes = type == Q4_0 ? 18 : type == Q4_1 ? 20 : 34, at = type == Q4_1 ? 4 : 2;
  __m256 acc[n], accm[n];
  for (int r = 0; r < n; ++r) acc[r] = accm[r] = _mm256_setzero_ps();
  for (int64_t b0 = 0; b0 < nb; b0 += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, nb - b0);
    const uint8_t* blk0 = row + b0 * bytes;
    __m128i half[n][2];
    for (int64_t j = 0; j < kLanes; j += 4) {  // 4 blocks: their sums by vphaddd, one per lane
      if (j >= count) {  // a row's last group of 4 blocks or fewer
        for (int r = 0; r < n; ++r) half[r][1] = _mm_setzero_si128();
        break;
      }
      __m256i p[n][4];
      for (int64_t i = 0; i < 4; ++i) {
        if (j + i >= count) {
          for (int r = 0; r < n; ++r) p[r][i] = _mm256_setzero_si256();
          continue;
        }
        __m256i lo, hi;
        widen<type>(blk0 + (j + i) * bytes + at, lo, hi);
        for (int r = 0; r < n; ++r) {
          const int16_t* y = q.v.data() + (r0 + r) * k + (b0 + j + i) * QB;
          p[r][i] = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y))),
                                     _mm256_madd_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y + 16))));
        }
      }
      for (int r = 0; r < n; ++r) {
        const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(p[r][0], p[r][1]), _mm256_hadd_epi32(p[r][2], p[r][3]));
        half[r][j / 4] = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
      }
    }
    __m256 d, dmin;
    factors<type>(blk0, count, d, dmin);
    for (int r = 0; r < n; ++r) {
      const int64_t at_x = (r0 + r) * nb + b0;
      const __m256 f = _mm256_mul_ps(d, _mm256_loadu_ps(q.d.data() + at_x));
      const __m256i sums = _mm256_set_m128i(half[r][1], half[r][0]);
      acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(f, _mm256_cvtepi32_ps(sums)));
      if constexpr (type == Q4_1) accm[r] = _mm256_add_ps(accm[r], _mm256_mul_ps(dmin, _mm256_loadu_ps(q.ds.data() + at_x)));
    }
  }
  for (int r = 0; r < n; ++r) res[r] = lane_sum(acc[r]) + lane_sum(accm[r]);
}

// rows [n0, n1) of one part against the m rows of x, up to 4 rows of x at a time against each
// weight row (its blocks stay in L1 meanwhile)
template <int64_t type>
__attribute__((target("avx2,f16c"))) void rows_avx2(const uint8_t* blocks, int64_t row_bytes, int64_t n0, int64_t n1,
                                                  const X32Rows& q, int64_t m, int64_t k, float* out, int64_t ldo) {
  const int64_t nb = k / QB;
  float res[4];
  for (int64_t w = n0; w < n1; ++w) {
    const uint8_t* row = blocks + w * row_bytes;
    for (int64_t r0 = 0; r0 < m; r0 += 4) {
      switch (std::min<int64_t>(4, m - r0)) {
        case 4: row_avx2<type, 4>(row, nb, q, k, r0, res); break;
        case 3: row_avx2<type, 3>(row, nb, q, k, r0, res); break;
        case 2: row_avx2<type, 2>(row, nb, q, k, r0, res); break;
        default: row_avx2<type, 1>(row, nb, q, k, r0, res); break;
      }
      for (int64_t r = r0; r < std::min<int64_t>(m, r0 + 4); ++r) out[r * ldo + w] = res[r - r0];
    }
  }
}
#endif

}  // namespace

// rows shorter than this keep float32: a weight row's fixed work (the lanes' sums, a last group of
// blocks) outweighs what the integers save. Capped at AVX2 on the Zen 4, one thread, one row of x
// (benchmarks/kquant_rows.py): Q4_1 576 values long 1.02x float32's speed, 1,536 long 1.32x, 4,096
// long 1.60x (Q8_0 2.02x); at 6 rows of x 0.81x, 1.09x and 1.35x.
constexpr int64_t kMinRow = 1024;

bool legacy_decode_part(int64_t type, int64_t k) {
  return (type == Q4_0 || type == Q4_1 || type == Q8_0) && k >= kMinRow && k % QB == 0;
}

// x's rows per 32 values: to 16383 (ties to even), each 32's scale and the float of their sum
X32Rows quantize_x32(const float* x, int64_t m, int64_t k) {
  TORCH_CHECK(k % QB == 0, "a row of ", k, " values is not whole blocks of ", QB);
  const int64_t nb = k / QB;
  X32Rows q;
  q.v.resize(m * k);
  q.d.assign(m * nb + kLanes, 0.0f);  // past the last row: what a last group of 8 blocks reads
  q.ds.assign(m * nb + kLanes, 0.0f);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      int32_t v[QB];
      const float iscale = rounded(x + r * k + b * QB, QB, 16383.0f, v);
      int32_t sum = 0;
      for (int64_t i = 0; i < QB; ++i) {
        q.v[r * k + b * QB + i] = static_cast<int16_t>(v[i]);
        sum += v[i];
      }
      q.d[r * nb + b] = iscale > 0.0f ? 1.0f / iscale : 0.0f;
      q.ds[r * nb + b] = q.d[r * nb + b] * static_cast<float>(sum);  // the sum exact: at most 32 x 16383
    }
  return q;
}

void legacy_rows_times_x(int64_t type, const uint8_t* blocks, int64_t row_bytes, int64_t n0, int64_t n1,
                         const X32Rows& q, int64_t m, int64_t k, float* out, int64_t ldo) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (integer_avx2()) {
    if (type == Q4_0) return rows_avx2<Q4_0>(blocks, row_bytes, n0, n1, q, m, k, out, ldo);
    if (type == Q4_1) return rows_avx2<Q4_1>(blocks, row_bytes, n0, n1, q, m, k, out, ldo);
    return rows_avx2<Q8_0>(blocks, row_bytes, n0, n1, q, m, k, out, ldo);
  }
#endif
  rows_portable(type, blocks, row_bytes, n0, n1, q, m, k, out, ldo);
}

}  // namespace hpipe
