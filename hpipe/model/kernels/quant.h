// Linear layers over GGUF's quantized blocks, on the CPU (quant.cpp). decode.cpp calls qlinear for
// a weight stored as blocks (uint8), so the decode kernel reads quantized weights as they are.
#pragma once
#include <ATen/ATen.h>

namespace hpipe {

// x [rows, in] float32 @ w.T (+ bias): w is the bytes of one or more parts stacked along the
// output dimension (a fused projection whose parts may differ in type); parts [P, 4] int64 holds
// each part's (ggml type, output rows, bytes per row, byte offset into blocks).
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& parts, const at::Tensor& bias);

}  // namespace hpipe
