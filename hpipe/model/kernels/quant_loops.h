// The hot loops of quant.cpp, included once per instruction set inside its own namespace, after
// `#pragma GCC target` names the instructions and HPIPE_V the floats per vector (16: AVX-512,
// 8: AVX2, 4: any CPU): written once, compiled three times. No include guard, on purpose.


// 16 bytes to 16 floats: GCC's generic conversions of bytes compile to a byte-by-byte loop, so the
// vector forms use the instructions (one widening, one conversion per vector)
#if HPIPE_V == 16
HPIPE_INLINE f32x16 to_floats(u8x16 q) {
  return reinterpret_cast<f32x16>(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(reinterpret_cast<__m128i>(q))));
}
HPIPE_INLINE f32x16 to_floats(i8x16 q) {
  return reinterpret_cast<f32x16>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(reinterpret_cast<__m128i>(q))));
}
#elif HPIPE_V == 8
HPIPE_INLINE f32x16 halves(__m256 lo, __m256 hi) {
  f32x16 out;
  std::memcpy(&out, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&out) + 32, &hi, 32);
  return out;
}
HPIPE_INLINE f32x16 to_floats(u8x16 q) {
  const __m128i v = reinterpret_cast<__m128i>(q);
  return halves(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))));
}
HPIPE_INLINE f32x16 to_floats(i8x16 q) {
  const __m128i v = reinterpret_cast<__m128i>(q);
  return halves(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))));
}
#else
HPIPE_INLINE f32x16 to_floats(u8x16 q) { return __builtin_convertvector(__builtin_convertvector(q, i32x16), f32x16); }
HPIPE_INLINE f32x16 to_floats(i8x16 q) { return __builtin_convertvector(__builtin_convertvector(q, i32x16), f32x16); }
#endif

HPIPE_INLINE u8x16 load16(const uint8_t* p) {
  u8x16 v;
  std::memcpy(&v, p, 16);
  return v;
}

HPIPE_INLINE void store16(float* y, f32x16 v) { std::memcpy(y, &v, 64); }

// y[i] = d * q[i] + m for 16 small unsigned integers q
HPIPE_INLINE void scaled(float* y, u8x16 q, float d, float m) {
  store16(y, to_floats(q) * d + m);
}

// y[i] = d * (q[i] - offset) for 16 unsigned integers q below 64
HPIPE_INLINE void scaled_centred(float* y, u8x16 q, float d, int offset) {
  const i8x16 c = reinterpret_cast<i8x16>(q) - static_cast<int8_t>(offset);
  store16(y, to_floats(c) * d);
}

// bit j of `bits` (j < 16) as 16 or 0, in byte j
HPIPE_INLINE u8x16 high_bits(uint32_t bits) {
  static const u8x16 mask = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
  const uint8_t lo = bits & 0xff, hi = (bits >> 8) & 0xff;
  const u8x16 spread = {lo, lo, lo, lo, lo, lo, lo, lo, hi, hi, hi, hi, hi, hi, hi, hi};
  return reinterpret_cast<u8x16>((spread & mask) != 0) & 16;
}

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

// one row of k values, stored as `type`, into y (ggml's dequantize_row_* in ggml-quants.c, the
// same arithmetic: the results are equal bit for bit)
HPIPE_INLINE void dequant_row(int64_t type, const uint8_t* src, float* y, int64_t k) {
  switch (type) {
    case F32: std::memcpy(y, src, k * 4); return;
    case F16: for (int64_t i = 0; i < k; ++i) y[i] = f16(src + 2 * i); return;
    case BF16: for (int64_t i = 0; i < k; ++i) y[i] = bfloat(src + 2 * i); return;
    case Q8_0:
      for (int64_t b = 0; b < k / 32; ++b, src += 34, y += 32) {
        const float d = f16(src);
        for (int h = 0; h < 2; ++h) {
          i8x16 q;
          std::memcpy(&q, src + 2 + 16 * h, 16);
          store16(y + 16 * h, to_floats(q) * d);
        }
      }
      return;
    case Q4_0:
      for (int64_t b = 0; b < k / 32; ++b, src += 18, y += 32) {
        const float d = f16(src);
        const u8x16 q = load16(src + 2);
        scaled_centred(y, q & 0xF, d, 8);
        scaled_centred(y + 16, q >> 4, d, 8);
      }
      return;
    case Q4_1:
      for (int64_t b = 0; b < k / 32; ++b, src += 20, y += 32) {
        const float d = f16(src), m = f16(src + 2);
        const u8x16 q = load16(src + 4);
        scaled(y, q & 0xF, d, m);
        scaled(y + 16, q >> 4, d, m);
      }
      return;
    case Q5_0:
    case Q5_1: {
      const bool with_min = type == Q5_1;
      const int off = with_min ? 4 : 2;
      for (int64_t b = 0; b < k / 32; ++b, src += off + 20, y += 32) {
        const float d = f16(src), m = with_min ? f16(src + 2) : 0.f;
        uint32_t qh;
        std::memcpy(&qh, src + off, 4);
        const u8x16 q = load16(src + off + 4);
        const u8x16 q0 = (q & 0xF) | high_bits(qh), q1 = (q >> 4) | high_bits(qh >> 16);
        if (with_min) {
          scaled(y, q0, d, m);
          scaled(y + 16, q1, d, m);
        } else {
          scaled_centred(y, q0, d, 16);
          scaled_centred(y + 16, q1, d, 16);
        }
      }
      return;
    }
    case Q4_K:
    case Q5_K: {
      const bool five = type == Q5_K;
      for (int64_t b = 0; b < k / 256; ++b, src += five ? 176 : 144) {
        const float d = f16(src), dmin = f16(src + 2);
        const uint8_t* scales = src + 4;
        const uint8_t* qh = src + 16;  // Q5_K's fifth bits
        const uint8_t* q = src + (five ? 48 : 16);
        uint8_t u1 = 1, u2 = 2;
        for (int is = 0; is < 8; is += 2, q += 32, y += 64, u1 <<= 2, u2 <<= 2) {
          uint8_t sc, m;
          scale_min(is, scales, sc, m);
          const float d1 = d * sc, m1 = dmin * m;
          scale_min(is + 1, scales, sc, m);
          const float d2 = d * sc, m2 = dmin * m;
          for (int h = 0; h < 2; ++h) {
            const u8x16 v = load16(q + 16 * h);
            u8x16 lo = v & 0xF, hi = v >> 4;
            if (five) {
              const u8x16 bits = load16(qh + 16 * h);
              lo += reinterpret_cast<u8x16>((bits & u1) != 0) & 16;
              hi += reinterpret_cast<u8x16>((bits & u2) != 0) & 16;
            }
            scaled(y + 16 * h, lo, d1, -m1);
            scaled(y + 32 + 16 * h, hi, d2, -m2);
          }
        }
      }
      return;
    }
    case Q6_K:
      for (int64_t b = 0; b < k / 256; ++b, src += 210) {
        const float d = f16(src + 208);
        const uint8_t* ql = src;
        const uint8_t* qh = src + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(src + 192);
        for (int n = 0; n < 256; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
          for (int h = 0; h < 2; ++h) {  // l = 16 h .. 16 h + 15: one scale per quarter
            const u8x16 a = load16(ql + 16 * h), c = load16(ql + 32 + 16 * h), hb = load16(qh + 16 * h);
            scaled_centred(y + 16 * h, (a & 0xF) | ((hb & 3) << 4), d * sc[h], 32);
            scaled_centred(y + 32 + 16 * h, (c & 0xF) | (((hb >> 2) & 3) << 4), d * sc[h + 2], 32);
            scaled_centred(y + 64 + 16 * h, (a >> 4) | (((hb >> 4) & 3) << 4), d * sc[h + 4], 32);
            scaled_centred(y + 96 + 16 * h, (c >> 4) | (((hb >> 6) & 3) << 4), d * sc[h + 6], 32);
          }
        }
      }
      return;
    default: TORCH_CHECK(false, "ggml type ", type, " is not supported by hpipe's quantized kernels");
  }
}

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
    std::memcpy(&wv, w + i, U * V * 4);
    for (int r = 0; r < R; ++r) {
      vec xv[U];
      std::memcpy(&xv, x + r * ldx + i, U * V * 4);
      for (int u = 0; u < U; ++u) acc[r][u] += wv[u] * xv[u];
    }
  }
  for (int r = 0; r < R; ++r) {
    vec a = acc[r][0];
    for (int u = 1; u < U; ++u) a += acc[r][u];
    float s = 0.f;
    for (int j = 0; j < V; ++j) s += a[j];
    for (int64_t t = i; t < k; ++t) s += w[t] * x[r * ldx + t];
    res[r] = s;
  }
}

// output columns [n0, n1) of one part for all m rows of x: each weight row dequantized once, then
// multiplied by every row of x; out[row, n] with row stride ldo
void rows_times_x(int64_t type, const uint8_t* blocks, int64_t row_bytes, int64_t n0, int64_t n1,
                               const float* x, int64_t m, int64_t k, float* out, int64_t ldo, float* w) {
  float res[4];
  for (int64_t n = n0; n < n1; ++n) {
    dequant_row(type, blocks + n * row_bytes, w, k);
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) {
      dots<4, 2>(w, x + r * k, k, k, res);
      for (int i = 0; i < 4; ++i) out[(r + i) * ldo + n] = res[i];
    }
    for (; r < m; ++r) {
      dots<1, 4>(w, x + r * k, k, k, res);
      out[r * ldo + n] = res[0];
    }
  }
}

void dequant_rows(int64_t type, const uint8_t* blocks, int64_t row_bytes, int64_t n0, int64_t n1,
                               int64_t k, float* out) {
  for (int64_t n = n0; n < n1; ++n) dequant_row(type, blocks + n * row_bytes, out + (n - n0) * k, k);
}

