// hpipe's own bfloat16 attention for prefill slices, on the CPUs where hpipe's own bfloat16 GEMM
// runs (AVX512-BF16 without MKL's kernels in hardware: AMD's Zen 4). There SDPA's bfloat16 kernel
// is no faster than its float32 one (75 against 82 ms for 2,000 queries over 2,048 keys, one
// thread), and a slice after the first, which needs an explicit mask, computes every masked block.
//
// Flash attention with VDPBF16PS: queries rounded to bfloat16, keys held as two bfloat16 parts
// (pack_keys says why), scores summed in float32 over the head's pairs; an online softmax in
// float32 over blocks of 32 keys; the probabilities rounded to bfloat16 and multiplied by the
// values (bfloat16) into float32 sums; results float32. Blocks sit at absolute positions (keys
// 32 b .. 32 b + 31) and a query visits them in order from the first it sees to the one holding
// its own position; a block a query sees nothing of adds exact zeros and a factor of exactly one
// (VDPBF16PS flushes denormal sums to zero, so a sum that small would not survive it; attention's
// sums are not that small). So a query's bits depend only on its position, its row and the keys
// it sees: not on how its prompt was sliced, nor on the queries beside it in a tile, nor on the
// threads (the slicing invariance of docs/decisions/quantized-kernels.md), and blocks wholly past
// every query of a tile, or before every window, are never computed.
#include "quant.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

using at::Tensor;

namespace {

constexpr int64_t kKeys = 32;  // keys per block
constexpr int kRows = 4;       // queries a tile computes: 4 x 4 float32 sums of values + 4 values + 1 broadcast

#if defined(__x86_64__) && defined(__GNUC__)
#define HPIPE_BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16")))

// 16 floats of a row (zeros past the last key) rounded to bfloat16
HPIPE_BF16 inline __m256i rounded(const float* x, bool real) {
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(real ? _mm512_loadu_ps(x) : _mm512_setzero_ps()));
}

// the keys of one kv head, [n, d] (row stride ld), as blocks [n / 32][d / 2][2 parts][32 keys][2]:
// one VDPBF16PS multiplies a query's broadcast pair by 16 keys' pairs. A key is two bfloat16
// parts, its rounding and the rounding of what that left (16 bits of its float32 mantissa's 24):
// rounding keys to bfloat16 doubled the divergence of the model's next-token distribution from
// float32's (the queries' rounding added a third). The keys past n are zeros. The rows are
// rounded into `rows` ([2][32][d] bfloat16) and transposed by pairs, 16 keys a gather.
HPIPE_BF16 void pack_keys(const float* k, int64_t ld, int64_t n, int64_t d, int64_t block, uint16_t* out,
                          uint16_t* rows) {
  uint16_t* lo = rows + kKeys * d;
  for (int64_t j = 0; j < kKeys; ++j) {
    const bool real = block * kKeys + j < n;
    const float* key = k + (block * kKeys + j) * ld;
    for (int64_t c = 0; c < d; c += 16) {
      const __m256i hi = rounded(key + c, real);
      const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
      const __m512 x = real ? _mm512_loadu_ps(key + c) : _mm512_setzero_ps();
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(rows + j * d + c), hi);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + j * d + c),  // the rest is exact in float32
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_sub_ps(x, back))));
    }
  }
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i stride = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>(d / 2)));
  for (int64_t p = 0; p < d / 2; ++p) {
    for (int part = 0; part < 2; ++part) {
      const int* words = reinterpret_cast<const int*>(part ? lo : rows);
      for (int h = 0; h < 2; ++h) {
        const __m512i index = _mm512_add_epi32(stride, _mm512_set1_epi32(static_cast<int32_t>(16 * h * (d / 2) + p)));
        _mm512_storeu_si512(out + p * 4 * kKeys + part * 2 * kKeys + h * kKeys, _mm512_i32gather_epi32(index, words, 4));
      }
    }
  }
}

// the values of one kv head as blocks [16 key pairs][d][2]: one VDPBF16PS multiplies a query's
// broadcast pair of probabilities by 16 columns' pairs of values; the keys past n are zeros
HPIPE_BF16 void pack_values(const float* v, int64_t ld, int64_t n, int64_t d, int64_t block, uint16_t* out) {
  alignas(64) int16_t order[32];  // 16-bit lanes 2i and 2i + 1: lane i of the first row and of the second
  for (int i = 0; i < 16; ++i) order[2 * i] = static_cast<int16_t>(i), order[2 * i + 1] = static_cast<int16_t>(32 + i);
  const __m512i pairs = _mm512_load_si512(order);
  for (int64_t jp = 0; jp < kKeys / 2; ++jp) {
    const int64_t j = block * kKeys + 2 * jp;
    const float *a = v + j * ld, *b = v + (j + 1) * ld;
    for (int64_t c = 0; c < d; c += 16) {
      const __m512i x = _mm512_castsi256_si512(rounded(a + c, j < n)), y = _mm512_castsi256_si512(rounded(b + c, j + 1 < n));
      _mm512_storeu_si512(out + jp * 2 * d + 2 * c, _mm512_permutex2var_epi16(x, pairs, y));
    }
  }
}

// e^x for x <= 0 (x below -87 gives 0 or a denormal's worth): 2^(x log2 e) as 2^n times a degree-6
// polynomial in the fraction, one way for every lane and call
HPIPE_BF16 inline __m512 exp_neg(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

struct Tile {
  const uint16_t* q;  // [rows][d] bfloat16
  int rows;
  int64_t first;      // the position of the tile's first query
  int64_t window;     // keys a query sees, its own included; 0: all before it
  float scale;
  float* sums;        // [kRows][d] float32: the values' sums
  float* max;         // [kRows]
  float* total;       // [kRows]: the probabilities' sums
  uint16_t* probs;    // [kRows][32] bfloat16
};

// one block of 32 keys (its packed keys kb and values vb) into the tile's running sums
HPIPE_BF16 void visit(const Tile& t, int64_t block, const uint16_t* kb, const uint16_t* vb, int64_t d) {
  __m512 s[kRows][2];
  for (int r = 0; r < kRows; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < d / 2; ++p) {
    const uint16_t* kp = kb + p * 4 * kKeys;
    const __m512bh k0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kp));
    const __m512bh k1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kp + kKeys));
    const __m512bh l0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kp + 2 * kKeys));
    const __m512bh l1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kp + 3 * kKeys));
    for (int r = 0; r < kRows; ++r) {
      int32_t pair;
      std::memcpy(&pair, t.q + r * d + 2 * p, 4);
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      s[r][0] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(s[r][0], a, k0), a, l0);
      s[r][1] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(s[r][1], a, k1), a, l1);
    }
  }
  float alpha[kRows];
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int r = 0; r < kRows; ++r) {
    const int64_t pos = t.first + r, low = t.window > 0 ? pos - t.window + 1 : 0;
    __mmask16 seen[2];
    for (int h = 0; h < 2; ++h) {
      const __m512i key = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>(block * kKeys + 16 * h)));
      seen[h] = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(static_cast<int32_t>(pos))) &
                _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(static_cast<int32_t>(low)));
      s[r][h] = _mm512_mask_mul_ps(minus_inf, seen[h], s[r][h], _mm512_set1_ps(t.scale));
    }
    const float top = std::max(t.max[r], _mm512_reduce_max_ps(_mm512_max_ps(s[r][0], s[r][1])));
    __m512 p0 = _mm512_setzero_ps(), p1 = _mm512_setzero_ps();
    alpha[r] = 1.0f;
    if (top != -std::numeric_limits<float>::infinity()) {  // else nothing seen yet: all stays zero
      const __m512 m = _mm512_set1_ps(top);
      p0 = _mm512_maskz_mov_ps(seen[0], exp_neg(_mm512_sub_ps(s[r][0], m)));
      p1 = _mm512_maskz_mov_ps(seen[1], exp_neg(_mm512_sub_ps(s[r][1], m)));
      alpha[r] = std::exp(t.max[r] - top);  // exactly 1 where the maximum holds, 0 from -inf
      t.max[r] = top;
      t.total[r] = t.total[r] * alpha[r] + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
    }
    _mm512_storeu_si512(t.probs + r * kKeys, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p1, p0)));
  }
  for (int64_t c = 0; c < d; c += 64) {  // 64 columns of the values at a time
    __m512 acc[kRows][4];
    for (int r = 0; r < kRows; ++r)
      for (int h = 0; h < 4; ++h) acc[r][h] = _mm512_mul_ps(_mm512_loadu_ps(t.sums + r * d + c + 16 * h), _mm512_set1_ps(alpha[r]));
    for (int64_t j = 0; j < kKeys / 2; ++j) {
      __m512bh v[4];
      for (int h = 0; h < 4; ++h) v[h] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(vb + j * 2 * d + 2 * (c + 16 * h)));
      for (int r = 0; r < kRows; ++r) {
        int32_t pair;
        std::memcpy(&pair, t.probs + r * kKeys + 2 * j, 4);
        const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
        for (int h = 0; h < 4; ++h) acc[r][h] = _mm512_dpbf16_ps(acc[r][h], a, v[h]);
      }
    }
    for (int r = 0; r < kRows; ++r)
      for (int h = 0; h < 4; ++h) _mm512_storeu_ps(t.sums + r * d + c + 16 * h, acc[r][h]);
  }
}
#endif

// q [s, heads, d] (the queries at positions start ..), k and v [kv_heads, n >= start + s, d], all
// float32 with unit stride along d: the attention's output [s, heads, d] float32 (see the top)
Tensor bf16_attention(const Tensor& q, const Tensor& k, const Tensor& v, int64_t start, double scale, int64_t window) {
#if defined(__x86_64__) && defined(__GNUC__)
  TORCH_CHECK(hpipe::bf16_dot_available(), "bf16_attention needs AVX512-BF16");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.scalar_type() == at::kFloat &&
                  k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "bf16_attention takes float32 q [s, heads, d], k and v [kv_heads, n, d]");
  const int64_t s = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k.size(0), n = start + s;
  TORCH_CHECK(d % 64 == 0 && k.size(2) == d && v.size(2) == d && v.size(0) == kv_heads && kv_heads > 0 &&
                  heads % kv_heads == 0 && k.size(1) >= n && v.size(1) >= n && start >= 0,
              "bf16_attention: head size a multiple of 64, keys and values for every position");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "bf16_attention: unit stride along d");
  Tensor out = at::empty({s, heads, d}, q.options());
  if (s == 0) return out;
  const int64_t blocks = (n + kKeys - 1) / kKeys, block_values = kKeys * d;
  std::vector<uint16_t> keys(2 * kv_heads * blocks * block_values), values(kv_heads * blocks * block_values);
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>(), *qp = q.data_ptr<float>();
  at::parallel_for(0, kv_heads * blocks, 1, [&](int64_t i0, int64_t i1) {
    std::vector<uint16_t> rows(2 * block_values);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t h = i / blocks, b = i % blocks;
      pack_keys(kp + h * k.stride(0), k.stride(1), n, d, b, keys.data() + 2 * i * block_values, rows.data());
      pack_values(vp + h * v.stride(0), v.stride(1), n, d, b, values.data() + i * block_values);
    }
  });
  const int64_t tiles = (s + kRows - 1) / kRows, items = tiles * heads, group = heads / kv_heads;
  const int threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  float* op = out.data_ptr<float>();
  // thread t takes items t, t + threads, ...: a tile's work grows with its position, so taking
  // them in turn balances the threads
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> sums(kRows * d);
    std::vector<uint16_t> qb(kRows * d), probs(kRows * kKeys);
    float max[kRows], total[kRows];
    for (int64_t worker = t0; worker < t1; ++worker) {
      for (int64_t item = worker; item < items; item += threads) {
        const int64_t tile = item / heads, h = item % heads, i0 = tile * kRows;
        const int rows = static_cast<int>(std::min<int64_t>(kRows, s - i0));
        std::fill(qb.begin(), qb.end(), 0);
        for (int r = 0; r < rows; ++r) hpipe::to_bf16(qp + (i0 + r) * q.stride(0) + h * q.stride(1), qb.data() + r * d, d);
        std::fill(sums.begin(), sums.end(), 0.0f);
        std::fill(max, max + kRows, -std::numeric_limits<float>::infinity());
        std::fill(total, total + kRows, 0.0f);
        Tile t{qb.data(), rows, start + i0, window, static_cast<float>(scale), sums.data(), max, total, probs.data()};
        const int64_t last = std::min(start + i0 + rows - 1, n - 1) / kKeys;
        const int64_t first = window > 0 ? std::max<int64_t>(0, start + i0 - window + 1) / kKeys : 0;
        const int64_t base = (h / group) * blocks * block_values;
        for (int64_t b = first; b <= last; ++b)
          visit(t, b, keys.data() + 2 * (base + b * block_values), values.data() + base + b * block_values, d);
        for (int r = 0; r < rows; ++r) {
          float* dst = op + ((i0 + r) * heads + h) * d;
          const float inv = 1.0f / total[r];
          for (int64_t c = 0; c < d; ++c) dst[c] = sums[r * d + c] * inv;
        }
      }
    }
  });
  return out;
#else
  TORCH_CHECK(false, "bf16_attention needs AVX512-BF16");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hpipe, m) {
  m.def("bf16_attention(Tensor q, Tensor k, Tensor v, int start, float scale, int window) -> Tensor", &bf16_attention);
}
