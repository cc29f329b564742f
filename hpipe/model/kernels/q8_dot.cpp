// Decode rows of K-quant weights (Q4_K, Q5_K, Q6_K) as integer dot products, as ggml computes them
// but with x in 15 bits (docs/decisions/int8-decode.md): hpipe's default since #62.
//
// A decode row of x is rounded per 256 values, once per call: to 15 bits by default (one float
// scale per 256, values to +-16383), or to 8 bits as ggml's Q8_K (HPIPE_DECODE_DOT=int8: Gemma 3
// 270M's greedy tokens then agree with float32 decode's at 96.6%, under the 99% of the fidelity
// rule; 15 bits: 99.7%). Each weight block then meets it as integers: with 8 bits, u8 x i8 pairs
// summed to 16 bits (AVX2's vpmaddubsw), those times the sub-blocks' 6- or 8-bit scales summed to
// 32 bits (vpmaddwd); with 15 bits, the weights times their scales in 16 bits (two vpmaddubsw per
// 32 weights, or vpmullw for Q6_K), then x's values (vpmaddwd). Exact integer sums. The block's
// float factors (d, dmin, the row's scale) are applied once per 256 values, in plain scalar code
// shared by every instruction set, in a fixed order. So a row's result is the same bits whatever
// rows share its call, whatever instruction set computes it (AVX-512 CPUs run the AVX2 loop;
// another CPU the scalar one), and float32's convert-and-multiply of every weight (a third of the
// memory's speed on AVX2) is gone: one row times 14336 x 4096 of Q4_K and Q6_K 1.9x float32's with
// 15 bits, 2.4x with 8 bits, capped at AVX2 (Zen 4, 2 threads; benchmarks/kquant_rows.py); about
// even with 15 bits at 16 rows.
#include "quant.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace hpipe {

bool integer_avx2() {
  static const bool avx2 = [] {
    const char* cap = std::getenv("HPIPE_CPU_ISA");
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    return !(cap && std::string(cap) == "portable") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#else
    (void)cap;
    return false;
#endif
  }();
  return avx2;
}

namespace {

constexpr int64_t QK = 256;
constexpr int64_t Q4_K = 12, Q5_K = 13, Q6_K = 14;

// The scales and minimums of a Q4_K / Q5_K block's 8 sub-blocks, as bytes 0-7 and 8-15 of `out`
// (ggml's unpacking of its 12 bytes of 6-bit values)
inline void scales_mins(const uint8_t* packed, uint8_t out[16]) {
  uint32_t u[4];
  std::memcpy(u, packed, 12);
  const uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
  u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
  const uint32_t mins_lo = u[1] & k1;
  u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
  u[2] = mins_lo;
  u[0] &= k1;
  std::memcpy(out, u, 16);
}

// ---- one weight row against R rows of x, in 8 lanes of sums per row -------------------------------
// Lane L of a row gathers, in every 32 consecutive values of a block, the products of values 4L to
// 4L + 3 (each times its sub-block's scale): exact integers. Per block, lane L of the offsets
// gathers (each 16 values' factor) x (their sum of x) for the 16-value groups 2L and 2L + 1.
// Each lane then goes to a float sum of its own, (d x row scale) x integer, multiplied and added
// in that order, and the 8 float sums are added in one fixed order at the end. The AVX2 loop keeps
// the lanes in a register; the scalar loop keeps them in arrays and must give the same bits.

constexpr int kLanes = 8;

// where value i of a block lies in Q8Rows::wide: each 32 values as their 16 even ones, then their
// 16 odd ones (what the AVX2 loop's two vpmaddubsw per 32 weights make)
inline int wide_at(int i) { return (i & ~31) + (i & 1) * 16 + ((i & 31) >> 1); }

// the block's float factors and its offsets' factors for each 16 values (Q6_K: 32 x its scale;
// Q4_K / Q5_K: the sub-block's minimum), and whether the offsets subtract from the integers (Q6_K)
// or go to a float sum of their own (times dmin)
struct Header {
  float d, dmin;
  int16_t per16[16];
  uint8_t sm[16];  // Q4_K / Q5_K: scales 0-7, minimums 8-15
};

inline void header(int64_t type, const uint8_t* b, Header& h) {
  if (type == Q6_K) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int s = 0; s < 16; ++s) h.per16[s] = static_cast<int16_t>(32 * sc[s]);
    h.d = f16_at(b + 208);
    h.dmin = 0.0f;
  } else {
    scales_mins(b + 4, h.sm);
    for (int j = 0; j < 8; ++j) h.per16[2 * j] = h.per16[2 * j + 1] = h.sm[8 + j];
    h.d = f16_at(b);
    h.dmin = f16_at(b + 2);
  }
}


// the scalar form: what every CPU can compute, and what the AVX2 form must equal bit for bit
void row_dots_portable(int64_t type, const uint8_t* row, int64_t nb, const Q8Rows& q, int64_t k, int64_t m,
                       float* res) {
  const int64_t bytes = type == Q4_K ? 144 : type == Q5_K ? 176 : 210;
  std::vector<float> acc(m * kLanes, 0.0f), accm(m * kLanes, 0.0f);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * bytes;
    Header h;
    header(type, blk, h);
    // each value of the block unpacked (unsigned) with its scale
    int32_t v[256], sc[256];
    if (type == Q6_K) {
      const uint8_t *ql = blk, *qh = blk + 128;
      const int8_t* s8 = reinterpret_cast<const int8_t*>(blk + 192);
      for (int half = 0; half < 2; ++half, ql += 64, qh += 32, s8 += 8)
        for (int l = 0; l < 32; ++l) {
          const int at = 128 * half + l, g = l / 16;
          v[at] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
          v[at + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
          v[at + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
          v[at + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
          sc[at] = s8[g], sc[at + 32] = s8[2 + g], sc[at + 64] = s8[4 + g], sc[at + 96] = s8[6 + g];
        }
    } else {
      const bool five = type == Q5_K;
      const uint8_t* qh = blk + 16;
      const uint8_t* qs = blk + (five ? 48 : 16);
      for (int j = 0; j < 4; ++j, qs += 32)
        for (int l = 0; l < 32; ++l) {
          v[64 * j + l] = (qs[l] & 0xF) + (five ? (qh[l] >> (2 * j) & 1) << 4 : 0);
          v[64 * j + 32 + l] = (qs[l] >> 4) + (five ? (qh[l] >> (2 * j + 1) & 1) << 4 : 0);
          sc[64 * j + l] = h.sm[2 * j];
          sc[64 * j + 32 + l] = h.sm[2 * j + 1];
        }
    }
    const bool fifteen = !q.wide.empty();
    for (int64_t r = 0; r < m; ++r) {
      const int8_t* y = fifteen ? nullptr : q.q.data() + r * k + b * QK;
      const int16_t* y15 = fifteen ? q.wide.data() + r * k + b * QK : nullptr;
      const int16_t* bs = fifteen ? nullptr : q.bsums.data() + (r * nb + b) * 16;
      const int32_t* s32 = fifteen ? q.sums32.data() + (r * nb + b) * 8 : nullptr;
      const float d8 = q.d[r * nb + b];
      // exact sums in 64 bits; each lane's result (lane - offsets, for Q6_K) fits in 32 bits, as
      // the AVX2 loop's sums do (fifteen bits: 32 x 32 x 128 x 16383 < 2^31 for Q6_K)
      int64_t lane64[kLanes] = {}, off64[kLanes];
      const bool signed_values = fifteen && type == Q6_K;  // Q6_K's offset of 32 taken first
      for (int i = 0; i < 256; ++i)
        lane64[(i % 32) / 4] += int64_t{sc[i]} * (signed_values ? v[i] - 32 : v[i]) * (fifteen ? y15[wide_at(i)] : y[i]);
      for (int L = 0; L < kLanes; ++L) {  // lane L's offsets: the 16-value groups 2L and 2L + 1
        off64[L] = 0;
        if (fifteen && !signed_values) off64[L] = int64_t{h.per16[2 * L]} * s32[L];  // Q4_K / Q5_K: sub-block L's minimum
        for (int g = 2 * L; g < 2 * L + 2 && !fifteen; ++g) off64[L] += int64_t{h.per16[g]} * bs[g];
      }
      int32_t lane[kLanes], off[kLanes];
      for (int L = 0; L < kLanes; ++L) {
        lane[L] = type == Q6_K ? static_cast<int32_t>(lane64[L] - off64[L]) : static_cast<int32_t>(lane64[L]);
        off[L] = type == Q6_K ? 0 : static_cast<int32_t>(off64[L]);
      }
      float* a = acc.data() + r * kLanes;
      float* am = accm.data() + r * kLanes;
      for (int L = 0; L < kLanes; ++L) {
        if (type == Q6_K) {
          a[L] = a[L] + (h.d * d8) * static_cast<float>(lane[L]);
        } else {
          a[L] = a[L] + (h.d * d8) * static_cast<float>(lane[L]);
          am[L] = am[L] + (h.dmin * d8) * static_cast<float>(off[L]);
        }
      }
    }
  }
  for (int64_t r = 0; r < m; ++r) res[r] = sum_lanes(acc.data() + r * kLanes) - sum_lanes(accm.data() + r * kLanes);
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2"))) inline __m256i load(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}

// header() with vector instructions: the same integers and the same two floats (F16C converts a
// half exactly, as c10::Half does in software), without the 16 scalar stores and the software
// conversions per block (what that saves was not measured: this VM drifts more than the gain)
struct HeaderV {
  float d, dmin;
  __m256i per16;
  alignas(16) uint8_t sm[16];
};

__attribute__((target("avx2,f16c"))) inline void header_avx2(int64_t type, const uint8_t* b, HeaderV& h) {
  uint16_t half[2];
  if (type == Q6_K) {
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    h.per16 = _mm256_slli_epi16(_mm256_cvtepi8_epi16(sc), 5);  // 32 x scale
    std::memcpy(half, b + 208, 2);
    h.d = _cvtsh_ss(half[0]);
    h.dmin = 0.0f;
  } else {
    scales_mins(b + 4, h.sm);
    const __m128i mins = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(h.sm + 8));
    h.per16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mins, mins));  // each minimum for its two 16s
    std::memcpy(half, b, 4);
    h.d = _cvtsh_ss(half[0]);
    h.dmin = _cvtsh_ss(half[1]);
  }
}

// Q6_K's 128 values of one half, 6 bits each, in four registers of 32 (ggml's layout)
__attribute__((target("avx2"))) inline void q6k_values(const uint8_t* ql, const uint8_t* qh, __m256i m4, __m256i m3,
                                                       __m256i v[4]) {
  const __m256i A = load(ql), C = load(ql + 32), H = load(qh);
  v[0] = _mm256_or_si256(_mm256_and_si256(A, m4), _mm256_slli_epi16(_mm256_and_si256(H, m3), 4));
  v[1] = _mm256_or_si256(_mm256_and_si256(C, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 2), m3), 4));
  v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 4), m4),
                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 4), m3), 4));
  v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(C, 4), m4),
                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 6), m3), 4));
}

// Q4_K / Q5_K: sub-blocks 2j (lo) and 2j + 1 (hi), 32 values each (Q5_K with its fifth bits)
__attribute__((target("avx2"))) inline void q45k_values(const uint8_t* qs, __m256i bits, bool five, int j, __m256i m4,
                                                        __m256i& lo, __m256i& hi) {
  const __m256i qv = load(qs);
  lo = _mm256_and_si256(qv, m4);
  hi = _mm256_and_si256(_mm256_srli_epi16(qv, 4), m4);
  if (five) {
    const __m256i b0 = _mm256_set1_epi8(static_cast<char>(1 << (2 * j)));
    const __m256i b1 = _mm256_set1_epi8(static_cast<char>(2 << (2 * j)));
    const __m256i sixteen = _mm256_set1_epi8(16);
    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bits, b0), b0), sixteen));
    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bits, b1), b1), sixteen));
  }
}

// vpshufb controls: word s of each 128 bits in every word; word 2i of the low 128 and 2i + 1 of
// the high 128 in every word of their half
__attribute__((target("avx2"))) inline __m256i pick_word(int s) {
  return _mm256_set1_epi16(static_cast<int16_t>(((2 * s + 1) << 8) | (2 * s)));
}
__attribute__((target("avx2"))) inline __m256i pick_pair(int i) {
  return _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(((4 * i + 3) << 8) | (4 * i + 2))),
                          _mm_set1_epi16(static_cast<int16_t>(((4 * i + 1) << 8) | (4 * i))));
}

// the weights 4 KB ahead of a block (the next rows' when the row ends): one row of x of a long row
// (14336 values, 28 KB in 15 bits) does not stay in L1 beside the weights streaming through, and
// the hardware's prefetch alone then read Q4_K at 7-8 GB/s a core, against 12-14 with this
// (capped at AVX2, Zen 4; a 4096-long row's 14-15 either way)
__attribute__((target("avx2"))) inline void prefetch_ahead(const uint8_t* blk) {
  const char* at = reinterpret_cast<const char*>(blk) + 4096;
  _mm_prefetch(at, _MM_HINT_T0);
  _mm_prefetch(at + 64, _MM_HINT_T0);
  _mm_prefetch(at + 128, _MM_HINT_T0);
}

// each row's 8 lanes of sums, less its 8 of offsets, added in the scalar form's fixed order
template <int n>
__attribute__((target("avx2"))) inline void store_results(const __m256* acc, const __m256* accm, int64_t r0, float* res) {
  for (int r = 0; r < n; ++r) {
    float a[kLanes], am[kLanes];
    _mm256_storeu_ps(a, acc[r]);
    _mm256_storeu_ps(am, accm[r]);
    res[r0 + r] = sum_lanes(a) - sum_lanes(am);
  }
}

// sum_lanes of a register, the same additions in the same order: ((v0 + v1) + (v2 + v3)) +
// ((v4 + v5) + (v6 + v7)) (a + b and b + a are the same float)
__attribute__((target("avx2"))) inline float lane_sum(__m256 v) {
  const __m256 pairs = _mm256_add_ps(v, _mm256_permute_ps(v, 0xB1));               // v0 + v1, ..., v6 + v7
  const __m256 quads = _mm256_add_ps(pairs, _mm256_permute_ps(pairs, 0x4E));       // (v0 + v1) + (v2 + v3), ...
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1)));
}

// the same with AVX2, 8 bits (ggml's arithmetic): 32 weights a vpmaddubsw, the unpacked weights
// serving every row (no FMA: a multiply, then an add, as the scalar form rounds)
// n: rows r0 to r0 + n of x (a constant, so that their sums stay in registers)
template <int n>
__attribute__((target("avx2,f16c"))) void rows8_avx2(int64_t type, const uint8_t* row, int64_t nb, const Q8Rows& q,
                                                   int64_t k, int64_t r0, float* res) {
  const int64_t bytes = type == Q4_K ? 144 : type == Q5_K ? 176 : 210;
  const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
  __m256 acc[n], accm[n];
  for (int r = 0; r < n; ++r) acc[r] = accm[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * bytes;
    HeaderV h;
    header_avx2(type, blk, h);
    const __m256i per16 = h.per16;
    __m256i lane[n];
    for (int r = 0; r < n; ++r) lane[r] = _mm256_setzero_si256();
    if (type == Q6_K) {
      const uint8_t *ql = blk, *qh = blk + 128;
      const int8_t* s8 = reinterpret_cast<const int8_t*>(blk + 192);
      for (int half = 0; half < 2; ++half, ql += 64, qh += 32, s8 += 8) {
        __m256i v[4];
        q6k_values(ql, qh, m4, m3, v);
        for (int i = 0; i < 4; ++i) {
          const __m256i s = _mm256_set_m128i(_mm_set1_epi16(s8[2 * i + 1]), _mm_set1_epi16(s8[2 * i]));
          for (int r = 0; r < n; ++r) {
            const int64_t at = (r0 + r) * k + b * QK + 128 * half + 32 * i;
            lane[r] = _mm256_add_epi32(lane[r], _mm256_madd_epi16(_mm256_maddubs_epi16(v[i], load(q.q.data() + at)), s));
          }
        }
      }
    } else {
      const bool five = type == Q5_K;
      const __m256i bits = load(blk + 16);  // Q5_K's fifth bits
      const uint8_t* qs = blk + (five ? 48 : 16);
      for (int j = 0; j < 4; ++j, qs += 32) {
        __m256i lo, hi;
        q45k_values(qs, bits, five, j, m4, lo, hi);
        const __m256i s0 = _mm256_set1_epi16(h.sm[2 * j]), s1 = _mm256_set1_epi16(h.sm[2 * j + 1]);
        for (int r = 0; r < n; ++r) {
          const int8_t* y = q.q.data() + (r0 + r) * k + b * QK + 64 * j;
          const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load(y)), s0);
          const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load(y + 32)), s1);
          lane[r] = _mm256_add_epi32(lane[r], _mm256_add_epi32(p0, p1));
        }
      }
    }
    for (int r = 0; r < n; ++r) {
      const int64_t at = (r0 + r) * nb + b;
      const float d8 = q.d[at];
      const __m256i off = _mm256_madd_epi16(per16, load(q.bsums.data() + at * 16));
      if (type == Q6_K) {
        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_set1_ps(h.d * d8),
                                                     _mm256_cvtepi32_ps(_mm256_sub_epi32(lane[r], off))));
      } else {
        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_set1_ps(h.d * d8), _mm256_cvtepi32_ps(lane[r])));
        accm[r] = _mm256_add_ps(accm[r], _mm256_mul_ps(_mm256_set1_ps(h.dmin * d8), _mm256_cvtepi32_ps(off)));
      }
    }
  }
  store_results<n>(acc, accm, r0, res);
}

// the same with x in 15 bits: each 32 weights times their scale in 16 bits (Q4_K / Q5_K: two
// vpmaddubsw, the even values' and the odd ones', against the scale in every other byte; Q6_K:
// its values less 32, times the scale by vpmullw), then x's values, laid out even-then-odd per 32
// (quantize_q8k), in vpmaddwd. The scales are picked from one register per block by vpshufb; the
// minimums meet x's sums of 32 in one vpmulld. Same integers, lanes and float order as the scalar
// form. Capped at AVX2 on a Zen 4, one thread, one row of x times 14336 x 4096 of Q4_K: 14 GB/s
// of blocks, 8 GB/s before (docs/decisions/int8-decode.md).
template <int n>
__attribute__((target("avx2,f16c"))) void rows15_avx2(int64_t type, const uint8_t* blocks, int64_t row_bytes, int64_t n0,
                                                    int64_t n1, const Q8Rows& q, int64_t k, int64_t r0, float* out,
                                                    int64_t ldo) {
  // (one function for the three types: templated on the type, the Q4_K loop ran 10.7 ns a block
  // against this one's 9.4, capped at AVX2 on a Zen 4, the same instructions in another order)
  const int64_t bytes = type == Q4_K ? 144 : type == Q5_K ? 176 : 210;
  const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
  const int16_t* wide = q.wide.data() + r0 * k;
  const int64_t nb = q.blocks;
  const int32_t* sums = q.sums32.data() + r0 * nb * 8;
  const float* xd = q.d.data() + r0 * nb;
  for (int64_t w = n0; w < n1; ++w) {
    const uint8_t* row = blocks + w * row_bytes;
    __m256 acc[n], accm[n];
    for (int r = 0; r < n; ++r) acc[r] = accm[r] = _mm256_setzero_ps();
    if (type == Q6_K) {
      const __m256i low_bytes = _mm256_set1_epi16(0xFF), thirty_two = _mm256_set1_epi16(32);
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + b * bytes;
        prefetch_ahead(blk);
        uint16_t half_d;
        std::memcpy(&half_d, blk + 208, 2);
        const float d = _cvtsh_ss(half_d);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
        const __m256i scales[2] = {_mm256_permute2x128_si256(sc16, sc16, 0x00), _mm256_permute2x128_si256(sc16, sc16, 0x11)};
        __m256i lane[n];
        for (int r = 0; r < n; ++r) lane[r] = _mm256_setzero_si256();
        for (int half = 0; half < 2; ++half) {
          __m256i v[4];
          q6k_values(blk + 64 * half, blk + 128 + 32 * half, m4, m3, v);
          for (int i = 0; i < 4; ++i) {
            // the 16 even values' (the first 16 scale 2i, the next 2i + 1), then the odd ones'
            const __m256i s = _mm256_shuffle_epi8(scales[half], pick_pair(i));
            const __m256i w0 = _mm256_mullo_epi16(_mm256_sub_epi16(_mm256_and_si256(v[i], low_bytes), thirty_two), s);
            const __m256i w1 = _mm256_mullo_epi16(_mm256_sub_epi16(_mm256_srli_epi16(v[i], 8), thirty_two), s);
            for (int r = 0; r < n; ++r) {
              const int16_t* y = wide + r * k + b * QK + 128 * half + 32 * i;
              lane[r] = _mm256_add_epi32(lane[r], _mm256_add_epi32(_mm256_madd_epi16(w0, load(y)),
                                                                   _mm256_madd_epi16(w1, load(y + 16))));
            }
          }
        }
        for (int r = 0; r < n; ++r)
          acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_set1_ps(d * xd[r * nb + b]), _mm256_cvtepi32_ps(lane[r])));
      }
    } else {
      const bool five = type == Q5_K;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + b * bytes;
        prefetch_ahead(blk);
        alignas(16) uint8_t sm[16];
        scales_mins(blk + 4, sm);
        const __m128i smv = _mm_load_si128(reinterpret_cast<const __m128i*>(sm));
        const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(smv));  // words 0-7: the scales
        const __m256i mins = _mm256_cvtepu8_epi32(_mm_srli_si128(smv, 8));
        uint16_t halves[2];
        std::memcpy(halves, blk, 4);
        const float d = _cvtsh_ss(halves[0]), dmin = _cvtsh_ss(halves[1]);
        const __m256i bits = five ? load(blk + 16) : _mm256_setzero_si256();  // Q5_K's fifth bits
        const uint8_t* qs = blk + (five ? 48 : 16);
        __m256i lane[n];
        for (int r = 0; r < n; ++r) lane[r] = _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j, qs += 32) {
          __m256i lo, hi;
          q45k_values(qs, bits, five, j, m4, lo, hi);
          // each sub-block's scale in the even bytes (the even values' products), then the odd
          const __m256i e0 = _mm256_shuffle_epi8(scales, pick_word(2 * j)), e1 = _mm256_shuffle_epi8(scales, pick_word(2 * j + 1));
          const __m256i w0 = _mm256_maddubs_epi16(lo, e0), w1 = _mm256_maddubs_epi16(lo, _mm256_slli_epi16(e0, 8));
          const __m256i w2 = _mm256_maddubs_epi16(hi, e1), w3 = _mm256_maddubs_epi16(hi, _mm256_slli_epi16(e1, 8));
          for (int r = 0; r < n; ++r) {
            const int16_t* y = wide + r * k + b * QK + 64 * j;
            const __m256i p0 = _mm256_add_epi32(_mm256_madd_epi16(w0, load(y)), _mm256_madd_epi16(w1, load(y + 16)));
            const __m256i p1 = _mm256_add_epi32(_mm256_madd_epi16(w2, load(y + 32)), _mm256_madd_epi16(w3, load(y + 48)));
            lane[r] = _mm256_add_epi32(lane[r], _mm256_add_epi32(p0, p1));
          }
        }
        for (int r = 0; r < n; ++r) {
          const float d8 = xd[r * nb + b];
          const __m256i off = _mm256_mullo_epi32(mins, load(sums + (r * nb + b) * 8));
          acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_set1_ps(d * d8), _mm256_cvtepi32_ps(lane[r])));
          accm[r] = _mm256_add_ps(accm[r], _mm256_mul_ps(_mm256_set1_ps(dmin * d8), _mm256_cvtepi32_ps(off)));
        }
      }
    }
    for (int r = 0; r < n; ++r) out[(r0 + r) * ldo + w] = lane_sum(acc[r]) - lane_sum(accm[r]);
  }
}

// rows [n0, n1) of one part against the m rows of x: up to 4 rows of x, each weight row in turn;
// more, 4 rows of x at a time against each weight row (its blocks stay in L1 meanwhile)
__attribute__((target("avx2,f16c"))) void rows15_dots(int64_t type, const uint8_t* blocks, int64_t row_bytes, int64_t n0,
                                                    int64_t n1, const Q8Rows& q, int64_t m, int64_t k, float* out,
                                                    int64_t ldo) {
  if (m <= 4) {
    switch (m) {
      case 4: return rows15_avx2<4>(type, blocks, row_bytes, n0, n1, q, k, 0, out, ldo);
      case 3: return rows15_avx2<3>(type, blocks, row_bytes, n0, n1, q, k, 0, out, ldo);
      case 2: return rows15_avx2<2>(type, blocks, row_bytes, n0, n1, q, k, 0, out, ldo);
      case 1: return rows15_avx2<1>(type, blocks, row_bytes, n0, n1, q, k, 0, out, ldo);
      default: return;
    }
  }
  for (int64_t w = n0; w < n1; ++w) {
    int64_t r0 = 0;
    for (; r0 + 4 <= m; r0 += 4) rows15_avx2<4>(type, blocks, row_bytes, w, w + 1, q, k, r0, out, ldo);
    switch (m - r0) {
      case 3: rows15_avx2<3>(type, blocks, row_bytes, w, w + 1, q, k, r0, out, ldo); break;
      case 2: rows15_avx2<2>(type, blocks, row_bytes, w, w + 1, q, k, r0, out, ldo); break;
      case 1: rows15_avx2<1>(type, blocks, row_bytes, w, w + 1, q, k, r0, out, ldo); break;
      default: break;
    }
  }
}

// the 8-bit loop, one weight row at a time
__attribute__((target("avx2,f16c"))) void rows8_dots(int64_t type, const uint8_t* blocks, int64_t row_bytes, int64_t n0,
                                                   int64_t n1, const Q8Rows& q, int64_t m, int64_t k, float* out,
                                                   int64_t ldo) {
  std::vector<float> res(m);
  for (int64_t w = n0; w < n1; ++w) {
    const uint8_t* row = blocks + w * row_bytes;
    int64_t r0 = 0;
    for (; r0 + 4 <= m; r0 += 4) rows8_avx2<4>(type, row, q.blocks, q, k, r0, res.data());
    switch (m - r0) {
      case 3: rows8_avx2<3>(type, row, q.blocks, q, k, r0, res.data()); break;
      case 2: rows8_avx2<2>(type, row, q.blocks, q, k, r0, res.data()); break;
      case 1: rows8_avx2<1>(type, row, q.blocks, q, k, r0, res.data()); break;
      default: break;
    }
    for (int64_t r = 0; r < m; ++r) out[r * ldo + w] = res[r];
  }
}
#endif

// rows [n0, n1) of a part's blocks against the m rows of x: out[r * ldo + n]
using RowDots = void (*)(int64_t, const uint8_t*, int64_t, int64_t, int64_t, const Q8Rows&, int64_t, int64_t, float*,
                         int64_t);

void portable_dots(int64_t type, const uint8_t* blocks, int64_t row_bytes, int64_t n0, int64_t n1, const Q8Rows& q,
                   int64_t m, int64_t k, float* out, int64_t ldo) {
  std::vector<float> res(m);
  for (int64_t w = n0; w < n1; ++w) {
    row_dots_portable(type, blocks + w * row_bytes, q.blocks, q, k, m, res.data());
    for (int64_t r = 0; r < m; ++r) out[r * ldo + w] = res[r];
  }
}


RowDots row_dots(bool fifteen) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (integer_avx2()) return fifteen ? &rows15_dots : &rows8_dots;
#endif
  return &portable_dots;
}

}  // namespace

bool integer_decode_type(int64_t type) { return type == Q4_K || type == Q5_K || type == Q6_K; }

// int15 unless HPIPE_DECODE_DOT says float32 or int8 (docs/decisions/int8-decode.md)
std::atomic<int>& decode_dot_mode() {
  static std::atomic<int> mode{[] {
    const char* env = std::getenv("HPIPE_DECODE_DOT");
    const std::string chosen = env != nullptr ? env : "";
    return chosen == "int8" ? kInt8Dot : chosen == "float32" ? kFloatDot : kInt15Dot;
  }()};
  return mode;
}

namespace {

// n values of x rounded to integers of at most `top`: their scale (0 for all zeros)
float rounded_portable(const float* xb, int64_t n, float top, int32_t* v) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(xb[i]));
  const float iscale = amax > 0.0f ? top / amax : 0.0f;
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<int32_t>(std::nearbyint(xb[i] * iscale));
  return iscale;
}

#if defined(__x86_64__) && defined(__GNUC__)
// the same bits with AVX2 (the same maximum, NaN ignored as std::max does; vcvtps2dq rounds to
// nearest even, as nearbyint in the default mode): a row of 14336 values took 55 us in the scalar
// form, in the decode step's path before its threads start
__attribute__((target("avx2"))) float rounded_avx2(const float* xb, int64_t n, float top, int32_t* v) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 mx = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) mx = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)), mx);
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const float amax = _mm_cvtss_f32(m4);
  const float iscale = amax > 0.0f ? top / amax : 0.0f;
  const __m256 scale = _mm256_set1_ps(iscale);
  for (int64_t i = 0; i < n; i += 8)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(v + i), _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i), scale)));
  return iscale;
}
#endif

}  // namespace

float rounded(const float* xb, int64_t n, float top, int32_t* v) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (integer_avx2()) return rounded_avx2(xb, n, top, v);
#endif
  return rounded_portable(xb, n, top, v);
}

// x's rows per 256 values: int8 (ggml's Q8_K, to 127, with the sums of every 16), or fifteen bits
// (to 16383; each 32 laid out even values first, with the sums of every 32)
Q8Rows quantize_q8k(const float* x, int64_t m, int64_t k, bool fifteen) {
  TORCH_CHECK(k % QK == 0, "a row of ", k, " values is not whole blocks of ", QK);
  const int64_t nb = k / QK;
  const float top = fifteen ? 16383.0f : 127.0f;
  Q8Rows q;
  q.blocks = nb;
  q.d.resize(m * nb);
  if (fifteen) {
    q.wide.resize(m * k);
    q.sums32.resize(m * k / 32);
  } else {
    q.q.resize(m * k);
    q.bsums.resize(m * k / 16);
  }
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * k + b * QK;
      const int64_t at = r * k + b * QK;
      int32_t v[QK];
      const float iscale = rounded(xb, QK, top, v);
      q.d[r * nb + b] = iscale > 0.0f ? 1.0f / iscale : 0.0f;
      if (fifteen) {
        for (int64_t i = 0; i < QK; ++i) q.wide[at + wide_at(static_cast<int>(i))] = static_cast<int16_t>(v[i]);
        for (int64_t s = 0; s < QK / 32; ++s) {
          int32_t sum = 0;
          for (int64_t i = 0; i < 32; ++i) sum += v[32 * s + i];
          q.sums32[(r * nb + b) * (QK / 32) + s] = sum;
        }
        continue;
      }
      for (int64_t i = 0; i < QK; ++i) q.q[at + i] = static_cast<int8_t>(v[i]);
      for (int64_t s = 0; s < QK / 16; ++s) {
        int32_t sum = 0;
        for (int64_t i = 0; i < 16; ++i) sum += v[16 * s + i];
        q.bsums[(r * nb + b) * (QK / 16) + s] = static_cast<int16_t>(sum);
      }
    }
  }
  return q;
}

void integer_rows_times_x(int64_t type, const uint8_t* blocks, int64_t row_bytes, int64_t n0, int64_t n1,
                          const Q8Rows& q, int64_t m, int64_t k, float* out, int64_t ldo) {
  row_dots(!q.wide.empty())(type, blocks, row_bytes, n0, n1, q, m, k, out, ldo);
}

}  // namespace hpipe
