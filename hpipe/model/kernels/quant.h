// Linear layers over GGUF's quantized blocks, on the CPU (quant.cpp). decode.cpp calls qlinear for
// a weight stored as blocks (uint8), so the decode kernel reads quantized weights as they are.
#pragma once
#include <ATen/ATen.h>

#include <atomic>
#include <cstring>
#include <optional>
#include <vector>

namespace hpipe {

// x [rows, in] float32 @ w.T (+ bias): w is the bytes of one or more parts stacked along the
// output dimension (a fused projection whose parts may differ in type); parts [P, 4] int64 holds
// each part's (ggml type, output rows, bytes per row, byte offset into blocks).
// Float32 throughout: what decode steps and the head compute.
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& parts, const at::Tensor& bias);

// The same, but the rows where `low` (bool [rows]) is true, the rows of prefill slices, multiply
// in bfloat16 with float32 sums while the prefill GEMM is bfloat16 (quant.cpp); the others in
// float32. A row's precision is its own: it does not change with the rows beside it.
at::Tensor qlinear_rows(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& parts, const at::Tensor& bias,
                        const std::optional<at::Tensor>& low);

// Decode rows: rows of a projection that are not prefill's (`low` false, or all rows here). Where a
// part is Q4_K, Q5_K or Q6_K they multiply in integers (q8_dot.cpp): x rounded to 15 bits per 256
// values (HPIPE_DECODE_DOT=int8: 8 bits, as ggml's; float32: float activations); where it is
// Q4_0, Q4_1 or Q8_0, with x in 15 bits per 32 (legacy_dot.cpp; float32 activations under int8);
// a row's bits then depend on no other row and on no instruction set. Else as qlinear.
at::Tensor qlinear_decode(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& parts,
                          const at::Tensor& bias);

// q8_dot.cpp: how decode rows of K-quant parts multiply (settable: quant.cpp's decode_dot op):
// kFloatDot (float32 activations), kInt8Dot (ggml's Q8_K: x rounded to 8 bits per 256 values, a
// scale per 256, the sum of every 16) or kInt15Dot (x rounded to 15 bits per 256 values, each 16
// weights times their scale meeting them in 16-bit products); which block types
// do; rows of x rounded so; and output columns [n0, n1) of one part for them (out[row, n], row
// stride ldo)
constexpr int kFloatDot = 0, kInt8Dot = 1, kInt15Dot = 2;
std::atomic<int>& decode_dot_mode();
bool integer_decode_type(int64_t type);
struct Q8Rows {
  int64_t blocks = 0;  // per row
  std::vector<float> d;  // each 256 values' scale
  std::vector<int8_t> q;  // kInt8Dot: the values
  std::vector<int16_t> bsums;  // kInt8Dot: the sums of every 16 values (at most 16 x 127)
  std::vector<int16_t> wide;  // kInt15Dot: the values, each 32 as their 16 even ones, then the 16 odd
  std::vector<int32_t> sums32;  // kInt15Dot: the sums of every 32 values
};
Q8Rows quantize_q8k(const float* x, int64_t m, int64_t k, bool fifteen = false);
void integer_rows_times_x(int64_t type, const uint8_t* blocks, int64_t row_bytes, int64_t n0, int64_t n1,
                       const Q8Rows& q, int64_t m, int64_t k, float* out, int64_t ldo);

// what the integer decode loops share (q8_dot.cpp, legacy_dot.cpp): a 16-bit float's value (as
// c10::Half converts it, exactly), 8 lanes of float sums added in their fixed order, and whether
// they run their AVX2 form (AVX2 with F16C, unless HPIPE_CPU_ISA=portable); and x's rounding
// (q8_dot.cpp)
inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::Half(h, c10::Half::from_bits()).operator float();
}
inline float sum_lanes(const float* v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}
bool integer_avx2();
// n values of x (a multiple of 8) rounded to integers of at most `top` (ties to even, the same
// bits on every instruction set): the scale they were multiplied by (0 for all zeros)
float rounded(const float* x, int64_t n, float top, int32_t* v);

// legacy_dot.cpp: decode rows of Q4_0, Q4_1 and Q8_0 parts of rows of at least 1024 values in
// integers too (with kInt15Dot, the default): x rounded to 15 bits per 32 values (natural order),
// each 32's scale, and that times their sum (Q4_1's minimum meets it); which parts do (by type and
// row length, never by the rows of x); rows of x rounded so; and output columns [n0, n1) of one
// part for them (out[row, n], row stride ldo)
bool legacy_decode_part(int64_t type, int64_t k);
struct X32Rows {
  std::vector<int16_t> v;  // the values, to +-16383
  std::vector<float> d;    // each 32 values' scale (and 8 zeros past the last row)
  std::vector<float> ds;   // each 32 values' scale times their sum (the same 8 zeros)
};
X32Rows quantize_x32(const float* x, int64_t m, int64_t k);
void legacy_rows_times_x(int64_t type, const uint8_t* blocks, int64_t row_bytes, int64_t n0, int64_t n1,
                         const X32Rows& q, int64_t m, int64_t k, float* out, int64_t ldo);

// n floats rounded to bfloat16 (to nearest, ties to even, as torch rounds); AVX512-BF16's
// conversion where the CPU has it (quant.cpp)
void to_bf16(const float* x, uint16_t* y, int64_t n);

// bf16_gemm.cpp: a bfloat16 GEMM with float32 sums on AVX512-BF16, for the CPUs where MKL's is
// not in hardware (AMD's). Whether this CPU has the instruction:
bool bf16_dot_available();
// values of a panel of `rows` weight rows of k (even) bfloat16 values once packed, and row r of it
// packed (the last 32-row block's unused rows are never read into a result)
int64_t bf16_packed_values(int64_t rows, int64_t k);
void bf16_pack_row(const uint16_t* row, int64_t k, int64_t r, uint16_t* packed);
// out[m, rows] (row stride ldo) = x[m, k] (bfloat16) . the packed rows, float32 sums; a row's bits
// do not depend on m
void bf16_gemm(const uint16_t* x, int64_t m, int64_t k, const uint16_t* packed, int64_t rows, float* out,
               int64_t ldo);

}  // namespace hpipe
