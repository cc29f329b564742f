// A stage's decode micro-batch on the CPU, float32, in one call: every row is one token of its
// own sequence. Python reaches it as torch.ops.hpipe.decode_units (hpipe/model/cpu_kernel.py).
//
// The arithmetic is the eager path's (hpipe/model/layers.py): the projections are the same
// MKL-packed or plain linear calls, attention is the same two batched products and softmax per
// row (the queries scaled before, not the scores after); norms, the rotary embedding and the KV
// writes are plain loops. What it saves is Python:
// an eager decode step of SmolLM2 spends about a third of its time between kernels.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

using at::Tensor;

namespace {

// per unit, in the order the Python side lists them (cpu_kernel.StageKernel)
enum AttnParam { A_NORM, A_QKV, A_QKV_SHAPE, A_QKV_BIAS, A_O, A_O_SHAPE, A_O_BIAS, A_COUNT };
enum MlpParam { M_NORM, M_GATE_UP, M_GATE_UP_SHAPE, M_GATE_UP_BIAS, M_DOWN, M_DOWN_SHAPE, M_DOWN_BIAS, M_COUNT };

std::optional<Tensor> maybe(const Tensor& t) {
  return t.numel() ? std::optional<Tensor>(t) : std::nullopt;
}

// x @ w.T + b, with w packed for MKL (shape: the original weight's zero-byte stand-in) or plain
// (shape empty)
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& shape, const Tensor& bias) {
  if (shape.numel() == 0) return at::linear(x, w, maybe(bias));
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkl::_mkl_linear", "")
                       .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const std::optional<Tensor>&,
                                     int64_t)>();
  return op.call(x, w, shape, maybe(bias), x.size(0));
}

// Hugging Face's LlamaRMSNorm in float32: x * rsqrt(mean(x^2) + eps) * weight, row by row
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  const int64_t rows = x.size(0), d = x.size(1);
  TORCH_CHECK(weight.numel() == d && weight.is_contiguous() && weight.scalar_type() == at::kFloat,
              "a norm's weight is float32 [hidden]");
  Tensor out = at::empty_like(x);
  const float* w = weight.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = x.data_ptr<float>() + r * d;
    float* o = out.data_ptr<float>() + r * d;
    float sum = 0.f;
    for (int64_t i = 0; i < d; ++i) sum += in[i] * in[i];
    const float scale = 1.f / std::sqrt(sum / static_cast<float>(d) + static_cast<float>(eps));
    for (int64_t i = 0; i < d; ++i) o[i] = w[i] * (in[i] * scale);
  }
  return out;
}

// x * cos + rotate_half(x) * sin over the first `heads` heads of each row of qkv
// [rows, all heads, head_dim], in place; ssin holds sin with its first half negated
void rotate(Tensor& qkv, const Tensor& cos, const Tensor& ssin, int64_t heads) {
  const int64_t rows = qkv.size(0), dim = qkv.size(2), half = dim / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos.data_ptr<float>() + r * dim;
    const float* s = ssin.data_ptr<float>() + r * dim;
    for (int64_t h = 0; h < heads; ++h) {
      float* x = qkv.data_ptr<float>() + (r * qkv.size(1) + h) * dim;
      for (int64_t i = 0; i < half; ++i) {
        const float a = x[i], b = x[i + half];
        x[i] = a * c[i] + b * s[i];
        x[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
  }
}

struct Rows {
  std::vector<int64_t> position;  // each row's position in its sequence
  std::vector<int64_t> base;      // the pool slot of its sequence's position 0 (its blocks are consecutive)
};

Tensor attention_unit(const Tensor& x, const std::vector<Tensor>& p, const Tensor& k_pool, const Tensor& v_pool,
                      const Tensor& cos, const Tensor& ssin, const Rows& rows, int64_t window, int64_t heads,
                      int64_t kv_heads, int64_t head_dim, double eps) {
  const int64_t n = x.size(0), group = heads / kv_heads;
  Tensor qkv = linear(rms_norm(x, p[A_NORM], eps), p[A_QKV], p[A_QKV_SHAPE], p[A_QKV_BIAS])
                   .view({n, heads + 2 * kv_heads, head_dim});
  rotate(qkv, cos, ssin, heads + kv_heads);
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  qkv.narrow(1, 0, heads).mul_(scale);  // the queries scaled once, not each row's scores
  const int64_t slots = k_pool.size(1);
  Tensor out = at::empty({n, heads, head_dim}, x.options());
  for (int64_t r = 0; r < n; ++r) {  // every row's key and value into its slot, before any row reads
    const int64_t pos = rows.position[r], slot = rows.base[r] + pos;
    TORCH_CHECK(pos >= 0 && rows.base[r] >= 0 && slot < slots, "a row's KV slot lies outside the pool");
    const float* row = qkv.data_ptr<float>() + r * (heads + 2 * kv_heads) * head_dim;
    for (int64_t h = 0; h < kv_heads; ++h) {
      std::memcpy(k_pool.data_ptr<float>() + (h * slots + slot) * head_dim, row + (heads + h) * head_dim,
                  head_dim * sizeof(float));
      std::memcpy(v_pool.data_ptr<float>() + (h * slots + slot) * head_dim,
                  row + (heads + kv_heads + h) * head_dim, head_dim * sizeof(float));
    }
  }
  // each row over its own prefix; rows spread over the intra-op threads (reading keys is memory-bound)
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t pos = rows.position[r];
      const int64_t first = window > 0 ? std::max<int64_t>(0, pos + 1 - window) : 0;
      const int64_t len = pos + 1 - first;
      Tensor keys = k_pool.narrow(1, rows.base[r] + first, len);
      Tensor values = v_pool.narrow(1, rows.base[r] + first, len);
      Tensor q = qkv.select(0, r).narrow(0, 0, heads).view({kv_heads, group, head_dim});
      Tensor scores = at::bmm(q, keys.transpose(1, 2));
      Tensor into = out.select(0, r).view({kv_heads, group, head_dim});
      at::bmm_out(into, at::_softmax(scores, -1, false), values);
    }
  });
  return x + linear(out.view({n, heads * head_dim}), p[A_O], p[A_O_SHAPE], p[A_O_BIAS]);
}

Tensor mlp_unit(const Tensor& x, const std::vector<Tensor>& p, double eps) {
  Tensor gate_up = linear(rms_norm(x, p[M_NORM], eps), p[M_GATE_UP], p[M_GATE_UP_SHAPE], p[M_GATE_UP_BIAS]);
  const int64_t inner = gate_up.size(1) / 2;
  Tensor act = at::silu(gate_up.narrow(1, 0, inner)).mul_(gate_up.narrow(1, inner, inner));
  return x + linear(act, p[M_DOWN], p[M_DOWN_SHAPE], p[M_DOWN_BIAS]);
}

// The residual stream x [rows, hidden] through a stage's attention and MLP units in order:
// kinds[i] is 0 for an attention unit, 1 for an MLP unit; params holds each unit's tensors in
// turn (A_COUNT or M_COUNT of them; an empty tensor for a bias or packed shape it lacks);
// k_pools, v_pools and windows hold each attention unit's KV pool tensors [kv_heads, slots,
// head_dim] and sliding window (0: none). cos and ssin [rows, head_dim] are the rows' rotary
// factors; positions and bases as in Rows.
Tensor decode_units(Tensor x, const Tensor& cos, const Tensor& ssin, at::IntArrayRef positions,
                    at::IntArrayRef bases, at::IntArrayRef kinds, at::TensorList params, at::TensorList k_pools,
                    at::TensorList v_pools, at::IntArrayRef windows, int64_t heads, int64_t kv_heads,
                    int64_t head_dim, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "decode_units takes a contiguous float32 CPU residual stream [rows, hidden]");
  TORCH_CHECK(static_cast<int64_t>(positions.size()) == x.size(0) && positions.size() == bases.size(),
              "one position and one base slot per row");
  TORCH_CHECK(heads % kv_heads == 0 && head_dim % 2 == 0, "heads must be a multiple of kv_heads, head_dim even");
  Rows rows{positions.vec(), bases.vec()};
  Tensor c = cos.contiguous(), s = ssin.contiguous();
  TORCH_CHECK(c.dim() == 2 && c.size(0) == x.size(0) && c.size(1) == head_dim && s.sizes() == c.sizes() &&
                  c.scalar_type() == at::kFloat && s.scalar_type() == at::kFloat,
              "cos and ssin are float32 [rows, head_dim]");
  size_t at_param = 0, at_window = 0;
  for (int64_t kind : kinds) {
    const size_t count = kind == 0 ? static_cast<size_t>(A_COUNT) : static_cast<size_t>(M_COUNT);
    TORCH_CHECK(at_param + count <= params.size(), "too few unit tensors for the unit kinds");
    std::vector<Tensor> p(params.begin() + at_param, params.begin() + at_param + count);
    at_param += count;
    if (kind == 0) {
      TORCH_CHECK(at_window < windows.size() && at_window < k_pools.size() && at_window < v_pools.size(),
                  "one window and one K and V pool per attention unit");
      for (const Tensor* pool : {&k_pools[at_window], &v_pools[at_window]})
        TORCH_CHECK(pool->is_contiguous() && pool->scalar_type() == at::kFloat && pool->dim() == 3 &&
                        pool->size(0) == kv_heads && pool->size(2) == head_dim,
                    "a KV pool tensor is contiguous float32 [kv_heads, slots, head_dim]");
      x = attention_unit(x, p, k_pools[at_window], v_pools[at_window], c, s, rows, windows[at_window], heads,
                         kv_heads, head_dim, eps);
      ++at_window;
    } else {
      x = mlp_unit(x, p, eps);
    }
  }
  TORCH_CHECK(at_param == params.size(), "more unit tensors than the unit kinds take");
  return x;
}

}  // namespace

// one kernel for every dispatch key: the packed weights are MKL-DNN tensors, the rest plain CPU ones
TORCH_LIBRARY(hpipe, m) {
  m.def("decode_units(Tensor x, Tensor cos, Tensor ssin, int[] positions, int[] bases, int[] kinds, "
        "Tensor[] params, Tensor[] k_pools, Tensor[] v_pools, int[] windows, int heads, int kv_heads, int head_dim, float eps) -> Tensor",
        &decode_units);
}
