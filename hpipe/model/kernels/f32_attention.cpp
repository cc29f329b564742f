// hpipe's own float32 attention for prefill slices on CPUs whose widest vectors are AVX2's (the
// AMD EPYCs and most PCs hpipe is for, or a wider CPU capped with HPIPE_CPU_ISA=avx2): there
// prefill multiplies in float32, and SDPA's float32 kernel took a fifth of a prefill (SmolLM2, 850
// tokens, one thread: 0.53 of 2.6 s, at half the rate of the projections' GEMM), while a slice
// after the first, which needs an explicit mask, computes every masked block, over keys padded
// to whole splits of 512 so that its results do not depend on the slicing.
//
// Flash attention in float32 with FMA, bf16_attention.cpp's shape: a tile is 4 query positions in
// every head of one KV head's group (which share each block of keys and values from L1); blocks of
// 64 keys at absolute positions (keys 64 b .. 64 b + 63), the keys held transposed in groups of 16
// so that one FMA multiplies a query's broadcast value by 8 keys' values; an online softmax over
// the blocks; the probabilities times the values into float32 sums. A score is one chain of FMAs over the head's
// values in order, a block a query sees nothing of adds exact zeros and a factor of exactly one,
// and every reduction runs one fixed way: so a query's bits depend only on its position, its row
// and the keys it sees, not on how its prompt was sliced, nor on the queries beside it in a tile,
// nor on the threads. Blocks wholly past every query of a tile, or before every window, are
// never computed.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

using at::Tensor;

namespace {

constexpr int64_t kKeys = 16;   // keys a group packs and a pass scores: two vectors of 8
constexpr int64_t kBlock = 64;  // keys per block of the online softmax: four groups
constexpr int kRows = 4;        // queries a tile computes: 4 x 2 sums, 2 keys' vectors, a broadcast

#if defined(__x86_64__) && defined(__GNUC__)
#define HPIPE_AVX2 __attribute__((target("avx2,fma")))

// one kv head's keys [n, d] (row stride ld) of block b, transposed: out[c * 16 + j] = key j's value
// c; the keys past n are zeros (never read)
HPIPE_AVX2 void pack_keys(const float* k, int64_t ld, int64_t n, int64_t d, int64_t block, float* out) {
  for (int64_t j = 0; j < kKeys; ++j) {
    const int64_t key = block * kKeys + j;
    const float* row = k + key * ld;
    if (key < n) {
      for (int64_t c = 0; c < d; ++c) out[c * kKeys + j] = row[c];
    } else {
      for (int64_t c = 0; c < d; ++c) out[c * kKeys + j] = 0.0f;
    }
  }
}

HPIPE_AVX2 inline float hmax(__m256 v) {
  const __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(q, _mm_shuffle_ps(q, q, 1)));
}

HPIPE_AVX2 inline float hsum(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}

// e^x for x <= 0 (x below -87 gives about 1e-38; callers mask what is not seen): 2^(x log2 e) as 2^n
// times a degree-6 polynomial in the fraction, one way for every lane and call
HPIPE_AVX2 inline __m256 exp_neg(__m256 x) {
  const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(1.5403530393381606e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  // 2^n for n in [-126, 0]: n + 127 in the exponent's bits
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

struct Tile {
  const float* q;     // [kRows][d] float32 (rows past the slice: zeros)
  int rows;
  int64_t first;      // the position of the tile's first query
  int64_t window;     // keys a query sees, its own included; 0: all before it
  float scale;
  float* sums;        // [kRows][d]: the values' sums
  float* max;         // [kRows]
  float* total;       // [kRows]: the probabilities' sums
  float* scores;      // [kRows][kBlock]: a block's scores, then its probabilities
};

// one block of kBlock keys (kb: its kBlock / 16 packed groups of 16; values v [n, d], row stride
// ldv, of which the block's keys before n are read) into the tile's running sums
HPIPE_AVX2 void visit(const Tile& t, int64_t block, const float* kb, const float* v, int64_t ldv, int64_t n,
                      int64_t d) {
  const int64_t base = block * kBlock, last = t.first + t.rows - 1;  // the tile's last query's position
  const int64_t low = t.window > 0 ? std::max<int64_t>(0, t.first - t.window + 1) : 0;  // its first row's first key
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  // groups of 16 keys wholly past every query's position, or before every window, are not
  // computed: no query sees them
  const int64_t g0 = std::max<int64_t>(0, low - base) / kKeys;
  const int64_t g1 = std::min<int64_t>(kBlock, last - base + 1 + kKeys - 1) / kKeys;
  for (int64_t g = 0; g < kBlock / kKeys; ++g) {
    if (g < g0 || g >= g1) {
      for (int r = 0; r < kRows; ++r) {
        _mm256_storeu_ps(t.scores + r * kBlock + g * kKeys, minus_inf);
        _mm256_storeu_ps(t.scores + r * kBlock + g * kKeys + 8, minus_inf);
      }
      continue;
    }
    const float* kg = kb + g * kKeys * d;
    __m256 s[kRows][2];
    for (int r = 0; r < kRows; ++r) s[r][0] = s[r][1] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; ++c) {
      const __m256 k0 = _mm256_loadu_ps(kg + c * kKeys), k1 = _mm256_loadu_ps(kg + c * kKeys + 8);
      for (int r = 0; r < kRows; ++r) {
        const __m256 a = _mm256_broadcast_ss(t.q + r * d + c);
        s[r][0] = _mm256_fmadd_ps(a, k0, s[r][0]);
        s[r][1] = _mm256_fmadd_ps(a, k1, s[r][1]);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      _mm256_storeu_ps(t.scores + r * kBlock + g * kKeys, s[r][0]);
      _mm256_storeu_ps(t.scores + r * kBlock + g * kKeys + 8, s[r][1]);
    }
  }
  float alpha[kRows];
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 scale = _mm256_set1_ps(t.scale);
  constexpr int kVectors = kBlock / 8;
  for (int r = 0; r < kRows; ++r) {
    const int64_t pos = t.first + r, from = t.window > 0 ? pos - t.window + 1 : 0;
    const bool whole = base + kBlock - 1 <= pos && base >= from;  // the row sees every key of the block
    float* row = t.scores + r * kBlock;
    __m256 x[kVectors], seen[kVectors];
    for (int i = 0; i < kVectors; ++i) {
      x[i] = _mm256_mul_ps(_mm256_loadu_ps(row + 8 * i), scale);
      if (whole) {
        seen[i] = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
        continue;
      }
      const __m256i key = _mm256_add_epi32(lanes, _mm256_set1_epi32(static_cast<int32_t>(base + 8 * i)));
      const __m256i in = _mm256_andnot_si256(
          _mm256_cmpgt_epi32(key, _mm256_set1_epi32(static_cast<int32_t>(pos))),       // not past its position
          _mm256_cmpgt_epi32(key, _mm256_set1_epi32(static_cast<int32_t>(from - 1))));  // within its window
      seen[i] = _mm256_castsi256_ps(in);
      x[i] = _mm256_blendv_ps(minus_inf, x[i], seen[i]);
    }
    __m256 m = x[0];
    for (int i = 1; i < kVectors; ++i) m = _mm256_max_ps(m, x[i]);
    const float top = std::max(t.max[r], hmax(m));
    alpha[r] = 1.0f;
    if (top == -std::numeric_limits<float>::infinity()) {  // nothing seen yet: all stays zero
      for (int i = 0; i < kVectors; ++i) _mm256_storeu_ps(row + 8 * i, _mm256_setzero_ps());
      continue;
    }
    const __m256 mt = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    for (int i = 0; i < kVectors; ++i) {
      const __m256 p = _mm256_and_ps(seen[i], exp_neg(_mm256_sub_ps(x[i], mt)));
      sum = _mm256_add_ps(sum, p);
      _mm256_storeu_ps(row + 8 * i, p);
    }
    alpha[r] = std::exp(t.max[r] - top);  // exactly 1 where the maximum holds, 0 from -inf
    t.max[r] = top;
    t.total[r] = t.total[r] * alpha[r] + hsum(sum);
  }
  // keys past n have no values to read, and keys past every query's position or before every
  // window add exact zeros: neither is visited
  const int64_t j0 = std::max<int64_t>(0, low - base), j1 = std::min({kBlock, n - base, last - base + 1});
  const float* vb = v + base * ldv;
  for (int64_t c = 0; c < d; c += 16) {  // 16 columns of the values at a time: 4 x 2 sums
    __m256 acc[kRows][2];
    for (int r = 0; r < kRows; ++r)
      for (int h = 0; h < 2; ++h)
        acc[r][h] = _mm256_mul_ps(_mm256_loadu_ps(t.sums + r * d + c + 8 * h), _mm256_set1_ps(alpha[r]));
    for (int64_t j = j0; j < j1; ++j) {
      const __m256 v0 = _mm256_loadu_ps(vb + j * ldv + c), v1 = _mm256_loadu_ps(vb + j * ldv + c + 8);
      for (int r = 0; r < kRows; ++r) {
        const __m256 a = _mm256_broadcast_ss(t.scores + r * kBlock + j);
        acc[r][0] = _mm256_fmadd_ps(a, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(a, v1, acc[r][1]);
      }
    }
    for (int r = 0; r < kRows; ++r)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(t.sums + r * d + c + 8 * h, acc[r][h]);
  }
}

bool avx2_fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#endif

// whether float32 prefill slices take this kernel here: a CPU with AVX2 and FMA whose widest
// vectors they are (no AVX-512, or HPIPE_CPU_ISA=avx2 capping a wider one), as the decode kernel's
// attention loops are chosen; elsewhere SDPA's float32 kernel runs on the wider vectors
bool f32_attention_fits() {
#if defined(__x86_64__) && defined(__GNUC__)
  const char* cap_env = std::getenv("HPIPE_CPU_ISA");
  const std::string cap = cap_env ? cap_env : "";
  if (cap == "portable" || !avx2_fma()) return false;
  return cap == "avx2" || !__builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

// q [s, heads, d] (the queries at positions start ..), k and v [kv_heads, n >= start + s, d], all
// float32 with unit stride along d, d a multiple of 16: the attention's output [s, heads, d]
// float32 (see the top)
Tensor f32_attention(const Tensor& q, const Tensor& k, const Tensor& v, int64_t start, double scale, int64_t window) {
#if defined(__x86_64__) && defined(__GNUC__)
  TORCH_CHECK(avx2_fma(), "f32_attention needs AVX2 and FMA");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.scalar_type() == at::kFloat &&
                  k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "f32_attention takes float32 q [s, heads, d], k and v [kv_heads, n, d]");
  const int64_t s = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k.size(0), n = start + s;
  TORCH_CHECK(d % 16 == 0 && d > 0 && k.size(2) == d && v.size(2) == d && v.size(0) == kv_heads && kv_heads > 0 &&
                  heads % kv_heads == 0 && k.size(1) >= n && v.size(1) >= n && start >= 0,
              "f32_attention: head size a multiple of 16, keys and values for every position");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "f32_attention: unit stride along d");
  Tensor out = at::empty({s, heads, d}, q.options());
  if (s == 0) return out;
  const int64_t blocks = (n + kBlock - 1) / kBlock, groups = blocks * (kBlock / kKeys), group_values = kKeys * d;
  std::vector<float> keys(kv_heads * groups * group_values);
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>(), *qp = q.data_ptr<float>();
  at::parallel_for(0, kv_heads * groups, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t h = i / groups, b = i % groups;
      pack_keys(kp + h * k.stride(0), k.stride(1), n, d, b, keys.data() + i * group_values);
    }
  });
  // an item: a tile of queries in every head of one kv head's group, so that each block of keys
  // and values, read once from memory, serves them all from L1
  const int64_t tiles = (s + kRows - 1) / kRows, items = tiles * kv_heads, group = heads / kv_heads;
  const int threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  float* op = out.data_ptr<float>();
  // thread t takes items t, t + threads, ...: a tile's work grows with its position, so taking
  // them in turn balances the threads
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> sums(group * kRows * d), qb(group * kRows * d), scores(kRows * kBlock);
    std::vector<float> max(group * kRows), total(group * kRows);
    std::vector<Tile> tiles_of(group);
    for (int64_t worker = t0; worker < t1; ++worker) {
      for (int64_t item = worker; item < items; item += threads) {
        const int64_t tile = item / kv_heads, kv = item % kv_heads, i0 = tile * kRows;
        const int rows = static_cast<int>(std::min<int64_t>(kRows, s - i0));
        std::fill(qb.begin(), qb.end(), 0.0f);
        std::fill(sums.begin(), sums.end(), 0.0f);
        std::fill(max.begin(), max.end(), -std::numeric_limits<float>::infinity());
        std::fill(total.begin(), total.end(), 0.0f);
        for (int64_t g = 0; g < group; ++g) {
          const int64_t h = kv * group + g;
          for (int r = 0; r < rows; ++r)
            std::memcpy(qb.data() + (g * kRows + r) * d, qp + (i0 + r) * q.stride(0) + h * q.stride(1),
                        d * sizeof(float));
          tiles_of[g] = Tile{qb.data() + g * kRows * d, rows, start + i0, window, static_cast<float>(scale),
                             sums.data() + g * kRows * d, max.data() + g * kRows, total.data() + g * kRows,
                             scores.data()};
        }
        const int64_t last = std::min(start + i0 + rows - 1, n - 1) / kBlock;
        const int64_t first = window > 0 ? std::max<int64_t>(0, start + i0 - window + 1) / kBlock : 0;
        const float* values = vp + kv * v.stride(0);
        for (int64_t b = first; b <= last; ++b)
          for (int64_t g = 0; g < group; ++g)
            visit(tiles_of[g], b, keys.data() + (kv * groups + b * (kBlock / kKeys)) * group_values, values,
                  v.stride(1), n, d);
        for (int64_t g = 0; g < group; ++g)
          for (int r = 0; r < rows; ++r) {
            float* dst = op + ((i0 + r) * heads + kv * group + g) * d;
            const float inv = 1.0f / total[g * kRows + r];
            for (int64_t c = 0; c < d; ++c) dst[c] = sums[(g * kRows + r) * d + c] * inv;
          }
      }
    }
  });
  return out;
#else
  TORCH_CHECK(false, "f32_attention needs an x86-64 CPU with AVX2");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hpipe, m) {
  m.def("f32_attention_fits() -> bool", &f32_attention_fits);
  m.def("f32_attention(Tensor q, Tensor k, Tensor v, int start, float scale, int window) -> Tensor", &f32_attention);
}
