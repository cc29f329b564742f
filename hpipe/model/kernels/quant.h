// Linear layers over GGUF's quantized blocks, on the CPU (quant.cpp). decode.cpp calls qlinear for
// a weight stored as blocks (uint8), so the decode kernel reads quantized weights as they are.
#pragma once
#include <ATen/ATen.h>

#include <optional>

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

}  // namespace hpipe
