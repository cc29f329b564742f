// Linear layers and embedding lookups over GGUF's quantized blocks, on the CPU. Python reaches
// them as torch.ops.hpipe.qlinear / qembedding / dequantize (hpipe/model/weights/blocks.py); decode.cpp calls
// qlinear for a weight stored as blocks.
//
// How it computes (docs/decisions/quantized-kernels.md). In float32: a micro-batch of a few rows
// multiplies each weight row as it is dequantized, 16 values at a time in registers; one of 5 to
// 23 rows dequantizes each weight row once into a buffer in L1 and multiplies it by every
// activation row there: either way the weights are read from memory once, as stored. From 24 rows
// a panel of weight rows is dequantized at a time and handed to MKL's GEMM, so the arithmetic runs
// at GEMM speed and the copy of a panel is all that exists at once. The rows the caller marks as
// prefill's (qlinear_rows' `low`), where the CPU multiplies bfloat16 in hardware (AVX512-BF16 or
// AMX), are multiplied in bfloat16 with float32 sums and results instead: each weight row
// dequantized and rounded to bfloat16 in L1, panels to MKL's cblas_gemm_bf16bf16f32 on an Intel
// CPU (5-6 times float32's speed with AMX), to hpipe's own (bf16_gemm.cpp, about twice float32's)
// on another vendor's, where MKL's is no faster than float32; HPIPE_PREFILL_GEMM=float32 or
// torch.ops.hpipe.prefill_gemm("float32") keeps float32.
// The other rows (decode tokens, the head's) stay float32 whatever shares the call.
//
// The hot loops are written once, plainly, and compiled three times, for AVX-512, for AVX2 with
// FMA and for any x86-64 (or other) CPU; the first call picks the widest the CPU has.
#include "quant.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#endif

using at::Tensor;

// MKL's bfloat16 GEMM with float32 sums and results, as libtorch_cpu exports it on x86-64; weak,
// so a torch without it leaves the pointer null and prefill slices stay float32
extern "C" void cblas_gemm_bf16bf16f32(int layout, int transa, int transb, int m, int n, int k, float alpha,
                                       const uint16_t* a, int lda, const uint16_t* b, int ldb, float beta, float* c,
                                       int ldc) __attribute__((weak));

namespace {

// ggml's type ids (ggml.h) and their blocks: values per block, bytes per block
enum GgmlType : int64_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30,
};

struct Format {
  int64_t values, bytes;
};

Format format_of(int64_t type) {
  switch (type) {
    case F32: return {1, 4};
    case F16: return {1, 2};
    case BF16: return {1, 2};
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q5_0: return {32, 22};
    case Q5_1: return {32, 24};
    case Q8_0: return {32, 34};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    case Q6_K: return {256, 210};
    default: TORCH_CHECK(false, "ggml type ", type, " is not supported by hpipe's quantized kernels");
  }
}

#define HPIPE_INLINE inline __attribute__((always_inline))
#define HPIPE_LAMBDA_INLINE __attribute__((always_inline))

HPIPE_INLINE float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    const float f = static_cast<float>(mant) * (1.0f / 16777216.0f);  // subnormal: mant * 2^-24
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

HPIPE_INLINE float bfloat(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// the 6-bit scale and min of sub-block j of a Q4_K / Q5_K block (ggml's get_scale_min_k4)
HPIPE_INLINE void scale_min(int j, const uint8_t* q, uint8_t& sc, uint8_t& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// 16 bytes and 16 floats as vectors (GCC's vector extensions: one zmm, two ymm or four xmm,
// whichever the function they are inlined into is compiled for)
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));

// a vector of V floats
template <int V>
struct Floats;
template <>
struct Floats<16> {
  typedef float type __attribute__((vector_size(64)));
};
template <>
struct Floats<8> {
  typedef float type __attribute__((vector_size(32)));
};
template <>
struct Floats<4> {
  typedef float type __attribute__((vector_size(16)));
};

// the hot loops compiled for each instruction set (quant_loops.h)
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#define HPIPE_V 16
namespace avx512 {
#include "quant_loops.h"
}  // namespace avx512
#undef HPIPE_V
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define HPIPE_V 8
namespace avx2 {
#include "quant_loops.h"
}  // namespace avx2
#undef HPIPE_V
#pragma GCC pop_options
#endif
#define HPIPE_V 4
namespace portable {
#include "quant_loops.h"
}  // namespace portable
#undef HPIPE_V

using RowsTimesX = void (*)(int64_t, const uint8_t*, int64_t, int64_t, int64_t, const float*, int64_t, int64_t,
                            float*, int64_t, float*);
using DequantRows = void (*)(int64_t, const uint8_t*, int64_t, int64_t, int64_t, int64_t, float*);

struct Variant {
  const char* name;
  RowsTimesX rows_times_x;
  DequantRows dequant_rows;
};

const Variant& variant() {
  static const Variant chosen = [] {
    // HPIPE_CPU_ISA=avx2 or portable caps the choice (to test and measure the narrower paths)
    const char* cap_env = std::getenv("HPIPE_CPU_ISA");
    const std::string cap = cap_env ? cap_env : "";
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (cap != "avx2" && cap != "portable" && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
      return Variant{"avx512", avx512::rows_times_x, avx512::dequant_rows};
    if (cap != "portable" && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
      return Variant{"avx2", avx2::rows_times_x, avx2::dequant_rows};
#endif
    return Variant{"portable", portable::rows_times_x, portable::dequant_rows};
  }();
  return chosen;
}

struct Part {
  int64_t type, rows, row_bytes, offset;
};

std::vector<Part> parts_of(const Tensor& blocks, const Tensor& parts, int64_t k) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous() && blocks.dim() == 1,
              "quantized blocks are one contiguous uint8 tensor");
  TORCH_CHECK(parts.scalar_type() == at::kLong && parts.dim() == 2 && parts.size(1) == 4 && parts.is_contiguous(),
              "parts is int64 [P, 4]: (type, rows, bytes per row, offset)");
  std::vector<Part> out;
  const int64_t* p = parts.data_ptr<int64_t>();
  for (int64_t i = 0; i < parts.size(0); ++i) {
    Part part{p[4 * i], p[4 * i + 1], p[4 * i + 2], p[4 * i + 3]};
    const Format f = format_of(part.type);
    TORCH_CHECK(k % f.values == 0 && part.row_bytes == k / f.values * f.bytes,
                "a row of ", k, " values of ggml type ", part.type, " is not ", part.row_bytes, " bytes");
    TORCH_CHECK(part.offset >= 0 && part.offset + part.rows * part.row_bytes <= blocks.numel(),
                "a part runs past the end of its blocks");
    out.push_back(part);
  }
  return out;
}

int64_t total_rows(const std::vector<Part>& parts) {
  int64_t n = 0;
  for (const Part& p : parts) n += p.rows;
  return n;
}

// rows of x from which a panel of dequantized weights and MKL's GEMM beat one pass over the blocks
constexpr int64_t kGemmRows = 24;
constexpr int64_t kPanelValues = int64_t{1} << 20;  // a panel: 4 MiB of float32 weights (1, 4, 8 and 16 MiB measured; 4 best)
constexpr int64_t kBf16PanelValues = int64_t{1} << 21;  // and 4 MiB of bfloat16 ones (2, 4 and 8 MiB measured; 4 best)

// whether this CPU has AVX512-BF16 (the CPUID is read in bf16_gemm.cpp)
bool cpu_has_avx512_bf16() { return hpipe::bf16_dot_available(); }

// whether this CPU multiplies bfloat16 in hardware: AVX512-BF16 or AMX-BF16 (CPUID.7.0:EDX[22]);
// elsewhere MKL would emulate it, slower than float32
bool cpu_has_bf16() {
#if defined(__x86_64__) && defined(__GNUC__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 22 & 1u)) return true;
#endif
  return cpu_has_avx512_bf16();
}

// whether the CPU is Intel's: MKL runs its bfloat16 kernels in hardware only there. On an AMD
// EPYC with AVX512-BF16 (Zen 4) cblas_gemm_bf16bf16f32 ran at 150-161 GFLOP/s against float32's
// 170-183 (576 x 1536, 2,048 rows, 2 threads), and a row's bits changed between 1-3 rows and more
bool cpu_is_intel() {
#if defined(__x86_64__) && defined(__GNUC__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
  char vendor[13] = {};
  std::memcpy(vendor, &b, 4);
  std::memcpy(vendor + 4, &d, 4);
  std::memcpy(vendor + 8, &c, 4);
  return std::string(vendor) == "GenuineIntel";
#else
  return false;
#endif
}

// MKL's bfloat16 GEMM, where it runs in hardware
bool mkl_bf16() {
  static const bool available = cblas_gemm_bf16bf16f32 != nullptr && cpu_has_bf16() && cpu_is_intel();
  return available;
}

// hpipe's own (bf16_gemm.cpp) elsewhere: AVX512-BF16 on another vendor's CPU (or on an Intel one
// with HPIPE_BF16_GEMM=hpipe, how the tests reach it there), unless HPIPE_CPU_ISA caps the
// instruction sets below AVX-512
bool own_bf16() {
  static const bool available = [] {
    const char* env = std::getenv("HPIPE_BF16_GEMM");
    const bool asked = env != nullptr && std::string(env) == "hpipe";
    return (asked || !mkl_bf16()) && hpipe::bf16_dot_available() && std::string(variant().name) == "avx512";
  }();
  return available;
}

// whose bfloat16 GEMM the prefill would use: "hpipe", "mkl" or "none"
std::string bf16_gemm_kernel() { return own_bf16() ? "hpipe" : mkl_bf16() ? "mkl" : "none"; }

bool bf16_gemm_available() { return mkl_bf16() || own_bf16(); }

// the process's own choice: bfloat16 where available, unless HPIPE_PREFILL_GEMM=float32
bool bf16_by_default() {
  const char* env = std::getenv("HPIPE_PREFILL_GEMM");
  return bf16_gemm_available() && !(env != nullptr && std::string(env) == "float32");
}

// the prefill GEMM's precision: true while bfloat16
std::atomic<bool>& bf16_prefill() {
  static std::atomic<bool> on{bf16_by_default()};
  return on;
}

// a panel's room, kept by the calling thread from one call to the next: allocated per call,
// SmolLM2's matrices at 24 rows took 63 ms, or 164 ms after other calls (most likely a 4 MiB panel
// from a fresh mmap, faulted in page by page, whenever glibc's mmap threshold had not risen)
template <class T>
T* panel_room(int64_t values) {
  thread_local std::vector<T> room;
  if (static_cast<int64_t>(room.size()) < values) room.resize(values);
  return room.data();
}

// rows [0, n) to the threads in chunks each takes when it is free, not in equal shares: a decode
// step streams its weights from memory, and where one thread runs slower (its core shared, its
// memory channel busier) the other waited for it at the end of every projection, 10-12% of an 8B
// step on two cores. Which rows a thread computes changes no row's result.
template <class F>
void shared_rows(int64_t n, const F& body) {
  const int64_t threads = at::get_num_threads();
  if (threads <= 1 || n < 64 || at::in_parallel_region()) return body(0, n);
  const int64_t chunk = std::max<int64_t>(16, n / (threads * 32));  // 14336 rows of 4096: 0.5 MB a chunk
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t a = next.fetch_add(chunk); a < n; a = next.fetch_add(chunk)) body(a, std::min(n, a + chunk));
  });
}

// decode rows of x as each integer block type takes them, each form made once a call: K-quants'
// (q8_dot.cpp, per 256 values) and Q4_0 / Q4_1 / Q8_0's (legacy_dot.cpp, 15 bits per 32)
struct IntegerX {
  const float* x;
  int64_t m, k;
  std::optional<hpipe::Q8Rows> q8;
  std::optional<hpipe::X32Rows> x32;

  static bool takes(int64_t type, int64_t k) {
    return hpipe::integer_decode_type(type) ||
           (hpipe::legacy_decode_part(type, k) && hpipe::decode_dot_mode().load() == hpipe::kInt15Dot);
  }
  void prepare(int64_t type) {  // before the threads start
    if (hpipe::integer_decode_type(type) && !q8)
      q8 = hpipe::quantize_q8k(x, m, k, hpipe::decode_dot_mode().load() == hpipe::kInt15Dot);
    else if (!hpipe::integer_decode_type(type) && !x32)
      x32 = hpipe::quantize_x32(x, m, k);
  }
  void rows(int64_t type, const uint8_t* b, int64_t row_bytes, int64_t n0, int64_t n1, float* out, int64_t ldo) const {
    if (hpipe::integer_decode_type(type))
      hpipe::integer_rows_times_x(type, b, row_bytes, n0, n1, *q8, m, k, out, ldo);
    else
      hpipe::legacy_rows_times_x(type, b, row_bytes, n0, n1, *x32, m, k, out, ldo);
  }
};

// x [m, k] @ the parts' rows .T, float32 out [m, n_out]: in bfloat16 with float32 sums (`bf16`),
// as decode rows (`integer`: K-quant parts and Q4_0 / Q4_1 / Q8_0 ones in integers, whatever m),
// else in float32
// (each weight row dequantized in registers or L1 for a few rows, panels and MKL's GEMM from
// kGemmRows)
Tensor product(const Tensor& x, const uint8_t* base, const std::vector<Part>& parts, int64_t n_out, bool bf16,
               bool integer = false) {
  const int64_t m = x.size(0), k = x.size(1);
  if (bf16 && m == 1 && !own_bf16())  // MKL takes another path for one row (1e-6 apart): two rows sum as any number do
    return product(at::cat({x, x}), base, parts, n_out, true).narrow(0, 0, 1).contiguous();
  Tensor out = at::empty({m, n_out}, x.options());
  const Variant& v = variant();
  Tensor xb;  // x in bfloat16, made once for every part
  IntegerX ix{x.data_ptr<float>(), m, k, std::nullopt, std::nullopt};  // x rounded once for every integer part
  if (integer && !bf16 && m > 0 && parts.size() > 1 &&
      std::all_of(parts.begin(), parts.end(), [k](const Part& p) { return IntegerX::takes(p.type, k); })) {
    // a fused projection's parts in one parallel region: one wait for the threads, not one a part
    // (a decode step of an 8B model has 7 parts a layer)
    for (const Part& p : parts) ix.prepare(p.type);
    std::vector<int64_t> first(parts.size() + 1, 0);  // each part's first output column
    for (size_t i = 0; i < parts.size(); ++i) first[i + 1] = first[i] + parts[i].rows;
    shared_rows(first.back(), [&](int64_t a, int64_t z) {
      for (size_t i = 0; i < parts.size(); ++i) {
        const int64_t lo = std::max(a, first[i]), hi = std::min(z, first[i + 1]);
        if (lo < hi)
          ix.rows(parts[i].type, base + parts[i].offset, parts[i].row_bytes, lo - first[i], hi - first[i],
                  out.data_ptr<float>() + first[i], n_out);
      }
    });
    return out;
  }
  int64_t col = 0;
  for (const Part& p : parts) {
    const uint8_t* b = base + p.offset;
    if (integer && !bf16 && m > 0 && IntegerX::takes(p.type, k)) {
      ix.prepare(p.type);
      float* o = out.data_ptr<float>() + col;
      shared_rows(p.rows, [&](int64_t a, int64_t z) { ix.rows(p.type, b, p.row_bytes, a, z, o, n_out); });
    } else if (bf16 && m > 0 && own_bf16()) {
      // the same with hpipe's kernel: each weight row rounded to bfloat16 in L1, then packed
      if (!xb.defined()) xb = x.to(at::kBFloat16);
      const int64_t panel_rows = std::max<int64_t>(32, kBf16PanelValues / k / 32 * 32);
      uint16_t* dst = panel_room<uint16_t>(hpipe::bf16_packed_values(std::min(panel_rows, p.rows), k));
      for (int64_t n0 = 0; n0 < p.rows; n0 += panel_rows) {
        const int64_t rows = std::min(panel_rows, p.rows - n0);
        at::parallel_for(0, rows, 8, [&](int64_t a, int64_t z) {
          std::vector<float> row(k);
          std::vector<uint16_t> rounded(k);
          for (int64_t r = a; r < z; ++r) {
            v.dequant_rows(p.type, b + (n0 + r) * p.row_bytes, p.row_bytes, 0, 1, k, row.data());
            hpipe::to_bf16(row.data(), rounded.data(), k);
            hpipe::bf16_pack_row(rounded.data(), k, r, dst);
          }
        });
        hpipe::bf16_gemm(reinterpret_cast<const uint16_t*>(xb.data_ptr()), m, k, dst, rows,
                         out.data_ptr<float>() + col + n0, n_out);
      }
    } else if (bf16 && m > 0) {
      // out[:, col+n0 : +rows] = xb @ panel.T, summed in float32 (row-major, B transposed); each
      // weight row dequantized into L1 and rounded to bfloat16 from there
      if (!xb.defined()) xb = x.to(at::kBFloat16);
      const int64_t panel_rows = std::max<int64_t>(16, kBf16PanelValues / k);
      uint16_t* dst = panel_room<uint16_t>(std::min(panel_rows, p.rows) * k);
      for (int64_t n0 = 0; n0 < p.rows; n0 += panel_rows) {
        const int64_t rows = std::min(panel_rows, p.rows - n0);
        at::parallel_for(0, rows, 8, [&](int64_t a, int64_t z) {
          std::vector<float> row(k);
          for (int64_t r = a; r < z; ++r) {
            v.dequant_rows(p.type, b + (n0 + r) * p.row_bytes, p.row_bytes, 0, 1, k, row.data());
            hpipe::to_bf16(row.data(), dst + r * k, k);
          }
        });
        cblas_gemm_bf16bf16f32(101, 111, 112, static_cast<int>(m), static_cast<int>(rows), static_cast<int>(k), 1.0f,
                               reinterpret_cast<const uint16_t*>(xb.data_ptr()), static_cast<int>(k), dst,
                               static_cast<int>(k), 0.0f, out.data_ptr<float>() + col + n0, static_cast<int>(n_out));
      }
    } else if (m >= kGemmRows && !integer) {  // (decode rows never: MKL's sums for a row depend on m)
      const int64_t panel_rows = std::max<int64_t>(16, kPanelValues / k);
      float* dst = panel_room<float>(std::min(panel_rows, p.rows) * k);
      for (int64_t n0 = 0; n0 < p.rows; n0 += panel_rows) {
        const int64_t rows = std::min(panel_rows, p.rows - n0);
        at::parallel_for(0, rows, 8, [&](int64_t a, int64_t z) {
          v.dequant_rows(p.type, b + n0 * p.row_bytes, p.row_bytes, a, z, k, dst + a * k);
        });
        Tensor cols = out.narrow(1, col + n0, rows);
        at::mm_out(cols, x, at::from_blob(dst, {rows, k}, x.options()).t());
      }
    } else if (m > 0) {
      float* o = out.data_ptr<float>() + col;
      const float* xp = x.data_ptr<float>();
      at::parallel_for(0, p.rows, 16, [&](int64_t a, int64_t z) {
        std::vector<float> w(4 * k);
        v.rows_times_x(p.type, b, p.row_bytes, a, z, xp, m, k, o, n_out, w.data());
      });
    }
    col += p.rows;
  }
  return out;
}

}  // namespace

namespace hpipe {

// n floats rounded to bfloat16 (to nearest, ties to even, as torch rounds): AVX512-BF16's
// conversion where the CPU has it, else one value at a time
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx512f,avx512bf16"))) void to_bf16_avx512(const float* x, uint16_t* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i))));
  for (; i < n; ++i) y[i] = c10::BFloat16(x[i]).x;
}
#endif

void to_bf16(const float* x, uint16_t* y, int64_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool avx512_bf16 = cpu_has_avx512_bf16();
  if (avx512_bf16) return to_bf16_avx512(x, y, n);
#endif
  for (int64_t i = 0; i < n; ++i) y[i] = c10::BFloat16(x[i]).x;
}

Tensor qlinear_rows(const Tensor& x_in, const Tensor& blocks, const Tensor& parts_t, const Tensor& bias,
                    const std::optional<Tensor>& low) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(), "qlinear takes float32 CPU activations");
  const int64_t k = x_in.size(-1);
  const Tensor x = x_in.reshape({-1, k}).contiguous();
  const int64_t m = x.size(0);
  const std::vector<Part> parts = parts_of(blocks, parts_t, k);
  const int64_t n_out = total_rows(parts);
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = n_out;
  const uint8_t* base = blocks.data_ptr<uint8_t>();
  Tensor out;
  // a marked projection's rows: prefill rows (`low`) in the prefill GEMM's precision, the others
  // as decode rows; an unmarked one's (the head's) all in float32
  const bool bf16 = low.has_value() && bf16_prefill().load(),
             integer = low.has_value() && decode_dot_mode().load() != hpipe::kFloatDot;
  const int64_t n_low = bf16 || integer ? [&] {
    TORCH_CHECK(low->scalar_type() == at::kBool && low->dim() == 1 && low->size(0) == m,
                "low is bool [", m, "]: the rows of prefill slices");
    return low->sum().item<int64_t>();
  }() : 0;
  if (n_low == m && m > 0) {
    out = product(x, base, parts, n_out, bf16);
  } else if (n_low == 0) {
    out = product(x, base, parts, n_out, false, integer);
  } else {  // each row in its own precision, whatever rows share its micro-batch
    const Tensor rows_low = low->nonzero().squeeze(1), rows_dec = low->logical_not().nonzero().squeeze(1);
    out = at::empty({m, n_out}, x.options());
    out.index_copy_(0, rows_low, product(x.index_select(0, rows_low), base, parts, n_out, bf16));
    out.index_copy_(0, rows_dec, product(x.index_select(0, rows_dec), base, parts, n_out, false, integer));
  }
  if (bias.numel()) out.add_(bias);
  return out.view(shape);
}

Tensor qlinear(const Tensor& x, const Tensor& blocks, const Tensor& parts, const Tensor& bias) {
  return qlinear_rows(x, blocks, parts, bias, std::nullopt);
}

Tensor qlinear_decode(const Tensor& x, const Tensor& blocks, const Tensor& parts, const Tensor& bias) {
  if (decode_dot_mode().load() == kFloatDot) return qlinear(x, blocks, parts, bias);  // the decode kernel's hot path: no mask
  return qlinear_rows(x, blocks, parts, bias, at::zeros({x.numel() / std::max<int64_t>(1, x.size(-1))}, at::kBool));
}

}  // namespace hpipe

namespace {

Tensor qlinear_op(const Tensor& x, const Tensor& blocks, const Tensor& parts, const Tensor& bias,
                  const std::optional<Tensor>& low) {
  return hpipe::qlinear_rows(x, blocks, parts, bias, low);
}

// rows `ids` of the matrix [rows, k] the parts hold, dequantized: an embedding lookup
Tensor qembedding(const Tensor& ids_in, const Tensor& blocks, const Tensor& parts_t, int64_t k) {
  const std::vector<Part> parts = parts_of(blocks, parts_t, k);
  TORCH_CHECK(parts.size() == 1, "an embedding table is one part");
  const Part& p = parts[0];
  const Tensor ids = ids_in.reshape({-1}).to(at::kLong).contiguous();
  const int64_t n = ids.numel();
  Tensor out = at::empty({n, k}, at::TensorOptions().dtype(at::kFloat));
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < p.rows, "token id ", id[i], " is outside the table of ", p.rows, " rows");
  const uint8_t* b = blocks.data_ptr<uint8_t>() + p.offset;
  float* o = out.data_ptr<float>();
  const Variant& v = variant();
  at::parallel_for(0, n, 64, [&](int64_t a, int64_t z) {
    for (int64_t i = a; i < z; ++i) v.dequant_rows(p.type, b + id[i] * p.row_bytes, p.row_bytes, 0, 1, k, o + i * k);
  });
  std::vector<int64_t> shape(ids_in.sizes().begin(), ids_in.sizes().end());
  shape.push_back(k);
  return out.view(shape);
}

// every row of the parts as float32 [rows, k] (tests, and stages that compute in another dtype)
Tensor dequantize(const Tensor& blocks, const Tensor& parts_t, int64_t k) {
  const std::vector<Part> parts = parts_of(blocks, parts_t, k);
  Tensor out = at::empty({total_rows(parts), k}, at::TensorOptions().dtype(at::kFloat));
  const Variant& v = variant();
  int64_t row = 0;
  for (const Part& p : parts) {
    float* o = out.data_ptr<float>() + row * k;
    const uint8_t* b = blocks.data_ptr<uint8_t>() + p.offset;
    at::parallel_for(0, p.rows, 16, [&](int64_t a, int64_t z) { v.dequant_rows(p.type, b, p.row_bytes, a, z, k, o + a * k); });
    row += p.rows;
  }
  return out;
}

std::string quant_variant() { return variant().name; }

// how decode rows of K-quant parts multiply, "int15" (the default), "int8" or "float32", after
// setting it to `mode` unless that is empty
std::string decode_dot(const std::string& mode) {
  TORCH_CHECK(mode.empty() || mode == "int8" || mode == "int15" || mode == "float32",
              "decode rows multiply in int8, int15 or float32, not ", mode);
  if (!mode.empty())
    hpipe::decode_dot_mode().store(mode == "int8" ? hpipe::kInt8Dot : mode == "int15" ? hpipe::kInt15Dot : hpipe::kFloatDot);
  const int now = hpipe::decode_dot_mode().load();
  return now == hpipe::kInt8Dot ? "int8" : now == hpipe::kInt15Dot ? "int15" : "float32";
}

// the prefill GEMM's precision, "bfloat16" or "float32", after setting it to `mode` unless that is
// empty ("default": the process's own choice again); "bfloat16" where the CPU or torch lacks it is
// an error
std::string prefill_gemm(const std::string& mode) {
  TORCH_CHECK(mode.empty() || mode == "float32" || mode == "bfloat16" || mode == "default",
              "the prefill GEMM is float32, bfloat16 or default, not ", mode);
  TORCH_CHECK(mode != "bfloat16" || bf16_gemm_available(),
              "this CPU multiplies no bfloat16 in hardware (AVX512-BF16 or AMX; or this torch build lacks MKL's GEMM, where that is the one used): prefill stays float32 here");
  if (mode == "default") {
    bf16_prefill().store(bf16_by_default());
  } else if (!mode.empty()) {
    bf16_prefill().store(mode == "bfloat16");
  }
  return bf16_prefill().load() ? "bfloat16" : "float32";
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hpipe, m) {
  m.def("qlinear(Tensor x, Tensor blocks, Tensor parts, Tensor bias, Tensor? low=None) -> Tensor", &qlinear_op);
  m.def("qembedding(Tensor ids, Tensor blocks, Tensor parts, int k) -> Tensor", &qembedding);
  m.def("dequantize(Tensor blocks, Tensor parts, int k) -> Tensor", &dequantize);
  m.def("quant_variant() -> str", &quant_variant);
  m.def("prefill_gemm(str mode) -> str", &prefill_gemm);
  m.def("decode_dot(str mode) -> str", &decode_dot);
  m.def("bf16_gemm_kernel() -> str", &bf16_gemm_kernel);
}
