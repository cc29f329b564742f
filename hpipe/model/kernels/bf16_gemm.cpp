// hpipe's own bfloat16 GEMM with float32 sums, for CPUs with AVX512-BF16 where MKL's is slow: MKL
// multiplies bfloat16 in hardware only on Intel's CPUs, and on an AMD EPYC (Zen 4) its
// cblas_gemm_bf16bf16f32 ran slower than float32 while torch's oneDNN bfloat16 matmul (bfloat16
// results, so not usable here) ran 2.2 times float32. quant.cpp's prefill GEMM calls this there.
//
// The weights are packed once per panel, 32 output columns at a time, as pairs of bfloat16 values
// along k ([n / 32][k / 2][32][2]), so that one VDPBF16PS multiplies a broadcast pair of an
// activation row by 32 columns' pairs and adds to 16 float32 sums per vector. Every output is the
// float32 sum over its k pairs in the same order whatever m, the row's place in a tile or the tile's
// in the panel: a row's bits do not depend on the rows beside it (what MKL gives from two rows up
// on Intel, and the prefill's slicing invariance needs).
#include "quant.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kCols = 32;  // output columns a tile computes (two vectors of 16 sums)
constexpr int kTileRows = 8;   // activation rows a tile computes: 16 sums + 2 weights + 1 broadcast of 32 registers

#if defined(__x86_64__) && defined(__GNUC__)
// out[r, 0 .. cols) = sum over k pairs p of x[r, 2p .. 2p+1] . w[p][c][0 .. 1] for R rows of x
template <int R>
__attribute__((target("avx512f,avx512bf16"))) void tile(const uint16_t* x, int64_t ldx, const uint16_t* w,
                                                        int64_t pairs, float* out, int64_t ldo, int64_t cols) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p, w += 2 * kCols) {
    const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w));
    const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + kCols));
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * p, 4);
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
    }
  }
  const __mmask16 m0 = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(out + r * ldo, m0, acc[r][0]);
    _mm512_mask_storeu_ps(out + r * ldo + 16, m1, acc[r][1]);
  }
}

using Tile = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, float*, int64_t, int64_t);
constexpr Tile kTiles[kTileRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>, tile<7>, tile<8>};
#endif

}  // namespace

namespace hpipe {

bool bf16_dot_available() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool available = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    __builtin_cpu_init();
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 5 & 1u) && __builtin_cpu_supports("avx512f");
  }();
  return available;
#else
  return false;
#endif
}

int64_t bf16_packed_values(int64_t rows, int64_t k) { return (rows + kCols - 1) / kCols * kCols * k; }

void bf16_pack_row(const uint16_t* row, int64_t k, int64_t r, uint16_t* packed) {
  uint16_t* dst = packed + r / kCols * (k * kCols) + r % kCols * 2;
  for (int64_t p = 0; p < k / 2; ++p) std::memcpy(dst + p * 2 * kCols, row + 2 * p, 4);
}

void bf16_gemm(const uint16_t* x, int64_t m, int64_t k, const uint16_t* packed, int64_t rows, float* out,
               int64_t ldo) {
#if defined(__x86_64__) && defined(__GNUC__)
  TORCH_CHECK(bf16_dot_available() && k % 2 == 0, "bf16_gemm needs AVX512-BF16 and an even k");
  const int64_t pairs = k / 2, blocks = (rows + kCols - 1) / kCols;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint16_t* w = packed + b * pairs * 2 * kCols;
      const int64_t cols = std::min(kCols, rows - b * kCols);
      for (int64_t r = 0; r < m; r += kTileRows) {
        const int n = static_cast<int>(std::min<int64_t>(kTileRows, m - r));
        kTiles[n](x + r * k, k, w, pairs, out + r * ldo + b * kCols, ldo, cols);
      }
    }
  });
#else
  TORCH_CHECK(false, "bf16_gemm needs AVX512-BF16");
#endif
}

}  // namespace hpipe
