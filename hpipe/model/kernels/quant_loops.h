// The hot loops of quant.cpp, included once per instruction set inside its own namespace, after
// `#pragma GCC target` names the instructions and HPIPE_V the floats per vector (16: AVX-512,
// 8: AVX2, 4: any CPU): written once, compiled three times. No include guard, on purpose.


// 16 floats as native vectors: one zmm, two ymm or four xmm (GCC lowers a 64-byte vector type
// through the stack where the instruction set has no 64-byte registers)
typedef Floats<HPIPE_V>::type fvec;
constexpr int kParts = 16 / HPIPE_V;
struct V16 {
  fvec p[kParts];
};
HPIPE_INLINE V16 operator+(V16 a, V16 b) {
  for (int i = 0; i < kParts; ++i) a.p[i] += b.p[i];
  return a;
}
HPIPE_INLINE V16 operator*(V16 a, V16 b) {
  for (int i = 0; i < kParts; ++i) a.p[i] *= b.p[i];
  return a;
}
HPIPE_INLINE V16 operator*(V16 a, float d) {
  for (int i = 0; i < kParts; ++i) a.p[i] *= d;
  return a;
}
HPIPE_INLINE V16 operator+(V16 a, float m) {
  for (int i = 0; i < kParts; ++i) a.p[i] += m;
  return a;
}
HPIPE_INLINE V16 operator-(V16 a, float m) { return a + (-m); }
HPIPE_INLINE V16& operator+=(V16& a, V16 b) { return a = a + b; }

// 16 bytes to 16 floats: GCC's generic conversions of bytes compile to a byte-by-byte loop, so the
// vector forms use the instructions (one widening, one conversion per vector)
#if HPIPE_V == 16
HPIPE_INLINE V16 to_floats(u8x16 q) {
  return V16{{reinterpret_cast<fvec>(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(reinterpret_cast<__m128i>(q))))}};
}
HPIPE_INLINE V16 to_floats(i8x16 q) {
  return V16{{reinterpret_cast<fvec>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(reinterpret_cast<__m128i>(q))))}};
}
#elif HPIPE_V == 8
HPIPE_INLINE V16 to_floats(u8x16 q) {
  const __m128i v = reinterpret_cast<__m128i>(q);
  return V16{{reinterpret_cast<fvec>(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))),
              reinterpret_cast<fvec>(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))))}};
}
HPIPE_INLINE V16 to_floats(i8x16 q) {
  const __m128i v = reinterpret_cast<__m128i>(q);
  return V16{{reinterpret_cast<fvec>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))),
              reinterpret_cast<fvec>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))))}};
}
#else
typedef int32_t i32x4 __attribute__((vector_size(16)));
template <class Bytes>
HPIPE_INLINE V16 to_floats(Bytes q) {
  typedef typename std::remove_reference<decltype(q[0])>::type byte;
  typedef byte b4 __attribute__((vector_size(4)));
  V16 out;
  for (int i = 0; i < 4; ++i) {
    b4 part;
    std::memcpy(&part, reinterpret_cast<const char*>(&q) + 4 * i, 4);
    out.p[i] = __builtin_convertvector(__builtin_convertvector(part, i32x4), fvec);
  }
  return out;
}
#endif

HPIPE_INLINE u8x16 load16(const uint8_t* p) {
  u8x16 v;
  std::memcpy(&v, p, 16);
  return v;
}

// one native vector at a time: a 64-byte copy compiles to 16-byte moves through the stack, and
// reading them back as wider vectors stalls on store forwarding
HPIPE_INLINE void store16(float* y, V16 v) {
  for (int i = 0; i < kParts; ++i) std::memcpy(y + i * HPIPE_V, &v.p[i], HPIPE_V * 4);
}

// d * (q[i] - offset) for 16 unsigned integers q below 64
HPIPE_INLINE V16 centred(u8x16 q, float d, int offset) {
  return to_floats(reinterpret_cast<i8x16>(q) - static_cast<int8_t>(offset)) * d;
}

// rows of x up to which each weight row is multiplied as it is dequantized (fused_dots): the
// accumulators of more rows would not fit in the registers
constexpr int kFusedRows = HPIPE_V == 16 ? 4 : 2;
constexpr int64_t kPrefetchRows = 4;

// a weight row kPrefetchRows ahead on its way from memory while this one computes: with the
// hardware's prefetcher alone a decode step of SmolLM2 Q4_1 ran at 47 tokens/s, with this at 96
// (distances 1, 2, 4 and 8 measured 90, 82, 96 and 92; AVX-512 Xeon, 2 threads)
HPIPE_INLINE void prefetch_row(const uint8_t* row, int64_t bytes) {
  for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(row + c);
}

// bit 16 H + j of the 32 bits at qh (j < 16) as 16 or 0, in byte j
// (a byte shuffle spreads the bits' two bytes over the lanes; built lane by lane from scalars, it
// held SmolLM2's mostly-Q5_0 "Q4_K_M" file to 0.68 of llama.cpp's one-sequence decode rate, and
// 0.85 with the shuffle, before attention spread over KV heads)
#if HPIPE_V == 16
// (with AVX-512: the 16 bits as a mask, one masked move; SmolLM2's Q5_0 decode matrices, one row, went
// from 10.7 to 12.9-14.5 billion weights a second on a Zen 4 EPYC)
template <int H>
HPIPE_INLINE u8x16 high_bits(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  return reinterpret_cast<u8x16>(_mm_maskz_mov_epi8(static_cast<__mmask16>(bits >> (16 * H)), _mm_set1_epi8(16)));
}
#else
template <int H>
HPIPE_INLINE u8x16 high_bits(const uint8_t* qh) {
  const u8x16 mask = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
  u8x16 bytes = {};
  std::memcpy(&bytes, qh, 4);
  const u8x16 spread = __builtin_shufflevector(bytes, bytes, 2 * H, 2 * H, 2 * H, 2 * H, 2 * H, 2 * H, 2 * H, 2 * H,
                                               2 * H + 1, 2 * H + 1, 2 * H + 1, 2 * H + 1, 2 * H + 1, 2 * H + 1,
                                               2 * H + 1, 2 * H + 1);
  return reinterpret_cast<u8x16>((spread & mask) != 0) & 16;
}
#endif

// a 16-bit float: one instruction with F16C, else bit by bit
#if HPIPE_V >= 8
HPIPE_INLINE float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
#else
HPIPE_INLINE float f16(const uint8_t* p) { return half(p); }
#endif

// f(i, u, j, v) for every 32 values of one row of k values stored in a block type: u the 16 values
// at i .. i + 15, v those at j .. j + 15 (ggml's dequantize_row_* in ggml-quants.c, the same
// arithmetic: the results are equal bit for bit). Two at a time, so that the sums over them can
// go to two accumulators without indexing one at run time (which would put them in memory).
template <class F>
HPIPE_INLINE void each32(int64_t type, const uint8_t* src, int64_t k, F&& f) {
  switch (type) {
    case Q8_0:
      for (int64_t i = 0; i < k; i += 32, src += 34) {
        const float d = f16(src);
        i8x16 q0, q1;
        std::memcpy(&q0, src + 2, 16);
        std::memcpy(&q1, src + 18, 16);
        f(i, to_floats(q0) * d, i + 16, to_floats(q1) * d);
      }
      return;
    case Q4_0:
      for (int64_t i = 0; i < k; i += 32, src += 18) {
        const float d = f16(src);
        const u8x16 q = load16(src + 2);
        f(i, centred(q & 0xF, d, 8), i + 16, centred(q >> 4, d, 8));
      }
      return;
    case Q4_1:
      for (int64_t i = 0; i < k; i += 32, src += 20) {
        const float d = f16(src), m = f16(src + 2);
        const u8x16 q = load16(src + 4);
        f(i, to_floats(q & 0xF) * d + m, i + 16, to_floats(q >> 4) * d + m);
      }
      return;
    case Q5_0:
      for (int64_t i = 0; i < k; i += 32, src += 22) {
        const float d = f16(src);
        const u8x16 q = load16(src + 6);
        f(i, centred((q & 0xF) | high_bits<0>(src + 2), d, 16), i + 16, centred((q >> 4) | high_bits<1>(src + 2), d, 16));
      }
      return;
    case Q5_1:
      for (int64_t i = 0; i < k; i += 32, src += 24) {
        const float d = f16(src), m = f16(src + 2);
        const u8x16 q = load16(src + 8);
        f(i, to_floats((q & 0xF) | high_bits<0>(src + 4)) * d + m, i + 16,
          to_floats((q >> 4) | high_bits<1>(src + 4)) * d + m);
      }
      return;
    case Q4_K:
    case Q5_K: {
      const bool five = type == Q5_K;
      for (int64_t i = 0; i < k; i += 256, src += five ? 176 : 144) {
        const float d = f16(src), dmin = f16(src + 2);
        const uint8_t* scales = src + 4;
        const uint8_t* qh = src + 16;  // Q5_K's fifth bits
        const uint8_t* q = src + (five ? 48 : 16);
        uint8_t u1 = 1, u2 = 2;
        for (int is = 0; is < 8; is += 2, q += 32, u1 <<= 2, u2 <<= 2) {
          uint8_t sc, m;
          scale_min(is, scales, sc, m);
          const float d1 = d * sc, m1 = dmin * m;
          scale_min(is + 1, scales, sc, m);
          const float d2 = d * sc, m2 = dmin * m;
          const int64_t at = i + 32 * is;
          const u8x16 v0 = load16(q), v1 = load16(q + 16);
          u8x16 lo0 = v0 & 0xF, lo1 = v1 & 0xF, hi0 = v0 >> 4, hi1 = v1 >> 4;
          if (five) {
            const u8x16 b0 = load16(qh), b1 = load16(qh + 16);
            lo0 += reinterpret_cast<u8x16>((b0 & u1) != 0) & 16;
            lo1 += reinterpret_cast<u8x16>((b1 & u1) != 0) & 16;
            hi0 += reinterpret_cast<u8x16>((b0 & u2) != 0) & 16;
            hi1 += reinterpret_cast<u8x16>((b1 & u2) != 0) & 16;
          }
          f(at, to_floats(lo0) * d1 - m1, at + 16, to_floats(lo1) * d1 - m1);
          f(at + 32, to_floats(hi0) * d2 - m2, at + 48, to_floats(hi1) * d2 - m2);
        }
      }
      return;
    }
    case Q6_K:
      for (int64_t i = 0; i < k; i += 256, src += 210) {
        const float d = f16(src + 208);
        const uint8_t* ql = src;
        const uint8_t* qh = src + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(src + 192);
        for (int64_t at = i; at < i + 256; at += 128, ql += 64, qh += 32, sc += 8) {
          // l = 0 .. 15 and 16 .. 31 of each quarter: one scale per 16 values
          const u8x16 a0 = load16(ql), a1 = load16(ql + 16), c0 = load16(ql + 32), c1 = load16(ql + 48);
          const u8x16 h0 = load16(qh), h1 = load16(qh + 16);
          f(at, centred((a0 & 0xF) | ((h0 & 3) << 4), d * sc[0], 32),
            at + 16, centred((a1 & 0xF) | ((h1 & 3) << 4), d * sc[1], 32));
          f(at + 32, centred((c0 & 0xF) | (((h0 >> 2) & 3) << 4), d * sc[2], 32),
            at + 48, centred((c1 & 0xF) | (((h1 >> 2) & 3) << 4), d * sc[3], 32));
          f(at + 64, centred((a0 >> 4) | (((h0 >> 4) & 3) << 4), d * sc[4], 32),
            at + 80, centred((a1 >> 4) | (((h1 >> 4) & 3) << 4), d * sc[5], 32));
          f(at + 96, centred((c0 >> 4) | (((h0 >> 6) & 3) << 4), d * sc[6], 32),
            at + 112, centred((c1 >> 4) | (((h1 >> 6) & 3) << 4), d * sc[7], 32));
        }
      }
      return;
    default: TORCH_CHECK(false, "ggml type ", type, " is not supported by hpipe's quantized kernels");
  }
}

HPIPE_INLINE bool float_type(int64_t type) { return type == F32 || type == F16 || type == BF16; }

// one row of k values, stored as `type`, into y
HPIPE_INLINE void dequant_row(int64_t type, const uint8_t* src, float* y, int64_t k) {
  switch (type) {
    case F32: std::memcpy(y, src, k * 4); return;
    case F16: for (int64_t i = 0; i < k; ++i) y[i] = f16(src + 2 * i); return;
    case BF16: for (int64_t i = 0; i < k; ++i) y[i] = bfloat(src + 2 * i); return;
    default:
      each32(type, src, k, [&](int64_t i, V16 u, int64_t j, V16 v) HPIPE_LAMBDA_INLINE {
        store16(y + i, u);
        store16(y + j, v);
      });
  }
}

HPIPE_INLINE V16 load16f(const float* p) {
  V16 v;
  for (int i = 0; i < kParts; ++i) std::memcpy(&v.p[i], p + i * HPIPE_V, HPIPE_V * 4);
  return v;
}

// the sum of a vector's lanes, halving it until four are left (a chain of scalar additions, what
// a loop over the lanes compiles to, cost as much as a short row's products)
HPIPE_INLINE float sum4(Floats<4>::type v) { return (v[0] + v[2]) + (v[1] + v[3]); }
HPIPE_INLINE float sum8(Floats<8>::type v) {
  return sum4(__builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7));
}
HPIPE_INLINE float sum_lanes(Floats<16>::type v) {
  return sum8(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
              __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
}
HPIPE_INLINE float sum_lanes(Floats<8>::type v) { return sum8(v); }
HPIPE_INLINE float sum_lanes(Floats<4>::type v) { return sum4(v); }
HPIPE_INLINE float sum16(V16 v) {
  fvec a = v.p[0];
  for (int i = 1; i < kParts; ++i) a += v.p[i];
  return sum_lanes(a);
}

// res[r] = (row of a block type) . x[r] for R rows of x (row stride ldx), each 16 values used as
// they are dequantized, in registers: for a few rows, no pass through memory at all
template <int R>
HPIPE_INLINE void fused_dots(int64_t type, const uint8_t* src, const float* x, int64_t ldx, int64_t k, float* res) {
  V16 even[R] = {}, odd[R] = {};
  each32(type, src, k, [&](int64_t i, V16 u, int64_t j, V16 v) HPIPE_LAMBDA_INLINE {
    for (int r = 0; r < R; ++r) {
      even[r] += u * load16f(x + r * ldx + i);
      odd[r] += v * load16f(x + r * ldx + j);
    }
  });
  for (int r = 0; r < R; ++r) res[r] = sum16(even[r] + odd[r]);
}

#if HPIPE_V == 8
// fused_dots for 3 or 4 rows with AVX2's 16 registers: one 8-lane half of each 16 values per pass
// over the row (the other half's conversions are dead code), so that the sums of 4 rows fit. The
// lanes' sums are independent: each row gets fused_dots<1>'s bits. Through half_dots2 (the row
// dequantized to memory first), 3 and 4 rows of SmolLM2's Q4_1 matrices cost 2-2.8 times one row.
template <int R, int P>
HPIPE_INLINE void fused_half(int64_t type, const uint8_t* src, const float* x, int64_t ldx, int64_t k, fvec* sums) {
  fvec e[R] = {}, o[R] = {};
  each32(type, src, k, [&](int64_t i, V16 u, int64_t j, V16 v) HPIPE_LAMBDA_INLINE {
    for (int r = 0; r < R; ++r) {
      fvec xu, xv;
      std::memcpy(&xu, x + r * ldx + i + P * HPIPE_V, HPIPE_V * 4);
      std::memcpy(&xv, x + r * ldx + j + P * HPIPE_V, HPIPE_V * 4);
      e[r] += u.p[P] * xu;
      o[r] += v.p[P] * xv;
    }
  });
  for (int r = 0; r < R; ++r) sums[2 * r + P] = e[r] + o[r];
}

template <int R>
HPIPE_INLINE void fused_dots_halves(int64_t type, const uint8_t* src, const float* x, int64_t ldx, int64_t k,
                                    float* res) {
  fvec sums[2 * R];
  fused_half<R, 0>(type, src, x, ldx, k, sums);
  fused_half<R, 1>(type, src, x, ldx, k, sums);
  for (int r = 0; r < R; ++r) {
    fvec a = sums[2 * r];
    a += sums[2 * r + 1];
    res[r] = sum_lanes(a);
  }
}
#endif

// fused_dots from a row dequantized into w (dequant_row: the same values): each 32 values' first
// 16 into one sum per row, the next 16 into another. A row of x gets the same bits as fused_dots
// gives it, with any number of rows beside it: what a decode row's result must not depend on (a
// speculative decode verifies several tokens of one sequence as one entry, and its answers must be
// those of decoding one token at a time). AVX-512's and the portable form's way; AVX2's is
// tile_dots, from 5 rows. Two weight rows at a time, so that each vector of x read
// serves both; one native vector of the 16 lanes at a time (the lanes' sums are independent, so
// the order of the parts changes no bit): with AVX2's 16 registers, the four sums of 16 lanes for
// each of 4 rows spilled to memory, and 3 to 8 decode rows of SmolLM2's Q4_1 matrices cost 2 to
// 4.3 times one row (capped at AVX2, Zen 4; benchmarks/kquant_rows.py --types Q4_1).
template <int R>
HPIPE_INLINE void half_dots2(const float* w0, const float* w1, const float* x, int64_t ldx, int64_t k, float* res0,
                             float* res1) {
  constexpr int V = HPIPE_V;
  fvec s0[R][kParts], s1[R][kParts];  // per row and part: even + odd, as sum16 adds them
  for (int p = 0; p < kParts; ++p) {
    fvec e0[R] = {}, o0[R] = {}, e1[R] = {}, o1[R] = {};
    for (int64_t i = p * V; i < k; i += 32) {
      fvec u0, v0, u1, v1;
      std::memcpy(&u0, w0 + i, V * 4);
      std::memcpy(&v0, w0 + i + 16, V * 4);
      std::memcpy(&u1, w1 + i, V * 4);
      std::memcpy(&v1, w1 + i + 16, V * 4);
      for (int r = 0; r < R; ++r) {
        fvec xu, xv;
        std::memcpy(&xu, x + r * ldx + i, V * 4);
        std::memcpy(&xv, x + r * ldx + i + 16, V * 4);
        e0[r] += u0 * xu;
        o0[r] += v0 * xv;
        e1[r] += u1 * xu;
        o1[r] += v1 * xv;
      }
    }
    for (int r = 0; r < R; ++r) {
      s0[r][p] = e0[r] + o0[r];
      s1[r][p] = e1[r] + o1[r];
    }
  }
  for (int r = 0; r < R; ++r) {
    fvec a0 = s0[r][0], a1 = s1[r][0];
    for (int p = 1; p < kParts; ++p) {
      a0 += s0[r][p];
      a1 += s1[r][p];
    }
    res0[r] = sum_lanes(a0);
    res1[r] = sum_lanes(a1);
  }
}

#if HPIPE_V == 8
// fused_dots<1>'s sums for NB weight rows (dequantized, row stride k, at w) against RB rows of x
// (row stride ldx), into res[r * NB + n]. Each of fused_dots' independent sums (one per native
// vector of each 32 values' first 16, and of their next 16) is one pass over a stretch of kTileK
// values, the NB x RB sums of that pass in registers, so that a vector of x read serves NB products
// and one of w serves RB (half_dots2, before, gave every 4 products 4 loads); the stretch keeps the
// passes' rows in L1, and the sums wait in `chains` between passes. Every sum is the same chain of
// multiply-adds in the same order as in fused_dots<1>, and the final additions are its: every row
// of x gets the same bits, however many share the call.
constexpr int64_t kTileK = 512;  // (256, 512, 1024 and 2048 measured: 2048 lost the gain at k = 1536)
template <int NB, int RB>  // (not inlined: inside rows_times_x its loop spilled sums to the stack)
__attribute__((noinline)) void tile_dots(const float* w, const float* x, int64_t ldx, int64_t k, float* res) {
  constexpr int V = HPIPE_V, C = 2 * kParts;  // sum c: values 16 (c / kParts) + V (c % kParts) on, of every 32
  alignas(64) float chains[C][NB][RB][V];  // each sum between its passes and stretches
  std::memset(chains, 0, sizeof(chains));
  for (int64_t k0 = 0; k0 < k; k0 += kTileK) {
    const int64_t k1 = std::min(k, k0 + kTileK);
    for (int c = 0; c < C; ++c) {
      fvec acc[NB][RB];
#pragma GCC unroll 8
      for (int n = 0; n < NB; ++n)
#pragma GCC unroll 8
        for (int r = 0; r < RB; ++r) std::memcpy(&acc[n][r], chains[c][n][r], V * 4);
      for (int64_t i = k0 + 16 * (c / kParts) + V * (c % kParts); i < k1; i += 32) {
        fvec wv[NB];  // (the loops unrolled on request: left to GCC, the loads of w went through the stack)
#pragma GCC unroll 8
        for (int n = 0; n < NB; ++n) std::memcpy(&wv[n], w + n * k + i, V * 4);
#pragma GCC unroll 8
        for (int r = 0; r < RB; ++r) {
          fvec xv;
          std::memcpy(&xv, x + r * ldx + i, V * 4);
#pragma GCC unroll 8
          for (int n = 0; n < NB; ++n) acc[n][r] += wv[n] * xv;
        }
      }
#pragma GCC unroll 8
      for (int n = 0; n < NB; ++n)
#pragma GCC unroll 8
        for (int r = 0; r < RB; ++r) std::memcpy(chains[c][n][r], &acc[n][r], V * 4);
    }
  }
  for (int n = 0; n < NB; ++n)
    for (int r = 0; r < RB; ++r) {
      fvec a, e, o;  // per native vector p: even + odd, added up in p's order, as sum16 does
      for (int p = 0; p < kParts; ++p) {
        std::memcpy(&e, chains[p][n][r], V * 4);
        std::memcpy(&o, chains[kParts + p][n][r], V * 4);
        if (p == 0)
          a = e + o;
        else
          a += e + o;
      }
      res[r * NB + n] = sum_lanes(a);
    }
}

// tile_dots' shape on AVX2: 3 weight rows by 3 rows of x, the 9 sums, 3 vectors of w and one of x
// in 13 of the 16 registers (measured on SmolLM2's Q4_1 shapes, one thread: 3 x 4 about 10% slower,
// 2 x 6 and 4 x 2 10-25% slower)
constexpr int kTileW = 3, kTileX = 3;

// tile_dots<kTileW, R> for the R < kTileX rows of x left over
HPIPE_INLINE void tile_rest(const float* w, const float* x, int64_t ldx, int64_t k, int rows, float* res) {
  switch (rows) {
    case 1: return tile_dots<kTileW, 1>(w, x, ldx, k, res);
    case 2: return tile_dots<kTileW, 2>(w, x, ldx, k, res);
    default: TORCH_CHECK(false, "tile_rest: ", rows, " rows");
  }
}
#endif

// rows of x half_dots2 takes at a time: its 4 x R sums of one native vector fit in the registers
// (AVX-512: 32 of them, AVX2 and the portable form's: 16)
constexpr int kHalfRows = HPIPE_V == 16 ? 4 : 2;

// res[r] = w . x[r] for R rows of x (row stride ldx): two vectors of V floats per row at a time
// (U vectors per row at a time: enough independent sums to hide the latency of a multiply-add)
template <int R, int U>
HPIPE_INLINE void dots(const float* w, const float* x, int64_t ldx, int64_t k, float* res) {
  constexpr int V = HPIPE_V;
  typedef Floats<V>::type vec;
  vec acc[R][U] = {};
  int64_t i = 0;
  for (; i + U * V <= k; i += U * V) {
    vec wv[U];
    for (int u = 0; u < U; ++u) std::memcpy(&wv[u], w + i + u * V, V * 4);  // one vector at a time: see store16
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < U; ++u) {
        vec xv;
        std::memcpy(&xv, x + r * ldx + i + u * V, V * 4);
        acc[r][u] += wv[u] * xv;
      }
  }
  for (int r = 0; r < R; ++r) {
    vec a = acc[r][0];
    for (int u = 1; u < U; ++u) a += acc[r][u];
    float s = sum_lanes(a);
    for (int64_t t = i; t < k; ++t) s += w[t] * x[r * ldx + t];
    res[r] = s;
  }
}

// res0[r] = w0 . x[r] and res1[r] = w1 . x[r] for R rows of x (row stride ldx): two weight rows at
// a time, so that each vector of x read from the cache serves two products (one weight row at a
// time, with dots<4, 2>, SmolLM2's decode matrices for 16 rows ran at 40 billion multiply-adds a
// second on a Zen 4 EPYC, 2 threads: loads of x, not arithmetic, bound it)
template <int R>
HPIPE_INLINE void dots2(const float* w0, const float* w1, const float* x, int64_t ldx, int64_t k, float* res0,
                        float* res1) {
  constexpr int V = HPIPE_V;
  typedef Floats<V>::type vec;
  vec a0[R] = {}, a1[R] = {};
  int64_t i = 0;
  for (; i + V <= k; i += V) {
    vec u, v;
    std::memcpy(&u, w0 + i, V * 4);
    std::memcpy(&v, w1 + i, V * 4);
    for (int r = 0; r < R; ++r) {
      vec xv;
      std::memcpy(&xv, x + r * ldx + i, V * 4);
      a0[r] += u * xv;
      a1[r] += v * xv;
    }
  }
  for (int r = 0; r < R; ++r) {
    float s0 = sum_lanes(a0[r]), s1 = sum_lanes(a1[r]);
    for (int64_t t = i; t < k; ++t) {
      s0 += w0[t] * x[r * ldx + t];
      s1 += w1[t] * x[r * ldx + t];
    }
    res0[r] = s0;
    res1[r] = s1;
  }
}

// output columns [n0, n1) of one part for all m rows of x: each weight row dequantized once, then
// multiplied by every row of x; out[row, n] with row stride ldo; w: room for four rows of k floats
void rows_times_x(int64_t type, const uint8_t* blocks, int64_t row_bytes, int64_t n0, int64_t n1,
                               const float* x, int64_t m, int64_t k, float* out, int64_t ldo, float* w) {
  float res[4];
#if HPIPE_V == 8
  if (!float_type(type) && (m == 3 || m == 4)) {  // a short verification entry's rows
    // (5 and 6 rows this way spilled their sums; tile_dots, from 5 rows, ran 0.7-0.9x this at 3 and 4)
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* src = blocks + n * row_bytes;
      if (n + kPrefetchRows < n1) prefetch_row(src + kPrefetchRows * row_bytes, row_bytes);
      if (m == 3)
        fused_dots_halves<3>(type, src, x, k, k, res);
      else
        fused_dots_halves<4>(type, src, x, k, k, res);
      for (int r = 0; r < m; ++r) out[r * ldo + n] = res[r];
    }
    return;
  }
#endif
  if (!float_type(type) && m <= kFusedRows) {  // a decode step's few rows: dequantized in registers
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* src = blocks + n * row_bytes;
      if (n + kPrefetchRows < n1) prefetch_row(src + kPrefetchRows * row_bytes, row_bytes);
      int64_t r = 0;
      for (; r + kFusedRows <= m; r += kFusedRows) {
        fused_dots<kFusedRows>(type, src, x + r * k, k, k, res);
        for (int i = 0; i < kFusedRows; ++i) out[(r + i) * ldo + n] = res[i];
      }
      for (; r < m; ++r) {
        fused_dots<1>(type, src, x + r * k, k, k, res);
        out[r * ldo + n] = res[0];
      }
    }
    return;
  }
  int64_t n = n0;
#if HPIPE_V == 8
  if (!float_type(type)) {  // 5 rows and more: kTileW weight rows at a time against kTileX rows of x
    float tile[kTileW * kTileX];
    for (; n < n1; n += kTileW) {
      const int64_t rows = std::min<int64_t>(kTileW, n1 - n);
      for (int64_t a = n + kTileW; a < std::min(n + 2 * kTileW, n1); ++a) prefetch_row(blocks + a * row_bytes, row_bytes);
      for (int64_t i = 0; i < kTileW; ++i)  // a short last block: its last row again
        dequant_row(type, blocks + (n + std::min(i, rows - 1)) * row_bytes, w + i * k, k);
      for (int64_t r = 0; r < m; r += kTileX) {
        const int left = static_cast<int>(std::min<int64_t>(kTileX, m - r));
        if (left == kTileX)
          tile_dots<kTileW, kTileX>(w, x + r * k, k, k, tile);
        else
          tile_rest(w, x + r * k, k, k, left, tile);
        for (int j = 0; j < left; ++j)
          for (int64_t i = 0; i < rows; ++i) out[(r + j) * ldo + n + i] = tile[j * kTileW + i];
      }
    }
    return;
  }
#endif
  if (!float_type(type)) {  // block types: each row's bits as fused_dots gives them, whatever m
    for (; n < n1; n += 2) {
      const int64_t second = n + 1 < n1 ? n + 1 : n;  // an odd last row: itself twice
      for (int64_t a = n + kPrefetchRows; a < std::min(n + kPrefetchRows + 2, n1); ++a)
        prefetch_row(blocks + a * row_bytes, row_bytes);
      dequant_row(type, blocks + n * row_bytes, w, k);
      dequant_row(type, blocks + second * row_bytes, w + k, k);
      float res1[4];
      int64_t r = 0;
      for (; r + kHalfRows <= m; r += kHalfRows) {
        half_dots2<kHalfRows>(w, w + k, x + r * k, k, k, res, res1);
        for (int i = 0; i < kHalfRows; ++i) {
          out[(r + i) * ldo + n] = res[i];
          out[(r + i) * ldo + second] = res1[i];
        }
      }
      for (; r < m; ++r) {
        half_dots2<1>(w, w + k, x + r * k, k, k, res, res1);
        out[r * ldo + n] = res[0];
        out[r * ldo + second] = res1[0];
      }
    }
    return;
  }
  for (; n + 2 <= n1; n += 2) {  // two weight rows at a time
    for (int64_t a = n + kPrefetchRows; a < std::min(n + kPrefetchRows + 2, n1); ++a)
      prefetch_row(blocks + a * row_bytes, row_bytes);
    dequant_row(type, blocks + n * row_bytes, w, k);
    dequant_row(type, blocks + (n + 1) * row_bytes, w + k, k);
    float res1[4];
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) {
      dots2<4>(w, w + k, x + r * k, k, k, res, res1);
      for (int i = 0; i < 4; ++i) {
        out[(r + i) * ldo + n] = res[i];
        out[(r + i) * ldo + n + 1] = res1[i];
      }
    }
    for (; r < m; ++r) {
      dots2<1>(w, w + k, x + r * k, k, k, res, res1);
      out[r * ldo + n] = res[0];
      out[r * ldo + n + 1] = res1[0];
    }
  }
  for (; n < n1; ++n) {
    dequant_row(type, blocks + n * row_bytes, w, k);
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) {
      dots<4, 2>(w, x + r * k, k, k, res);
      for (int i = 0; i < 4; ++i) out[(r + i) * ldo + n] = res[i];
    }
    for (; r < m; ++r) {  // the same sums as the rows beside it: U = 2 alike
      dots<1, 2>(w, x + r * k, k, k, res);
      out[r * ldo + n] = res[0];
    }
  }
}

void dequant_rows(int64_t type, const uint8_t* blocks, int64_t row_bytes, int64_t n0, int64_t n1,
                               int64_t k, float* out) {
  for (int64_t n = n0; n < n1; ++n) dequant_row(type, blocks + n * row_bytes, out + (n - n0) * k, k);
}

