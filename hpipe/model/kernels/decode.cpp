// A stage's decode micro-batch on the CPU, float32, in one call: every row is one token of its
// own sequence. Python reaches it as torch.ops.hpipe.decode_units (hpipe/model/kernels/library.py).
//
// The arithmetic is the eager path's (hpipe/model/compute/layers.py): the projections are the same
// MKL-packed or plain linear calls, and attention the same two products and softmax per row (the
// queries scaled before, not the scores after), as AVX-512 or AVX2 loops that read each key and value once
// where the CPU has it (attend_row), else as MKL's batched products; norms, the rotary embedding
// and the KV writes are plain loops. What it saves is Python (an eager decode step of SmolLM2
// spends about a third of its time between kernels) and, in attention, MKL's copies of the keys.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "quant.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <optional>
#include <vector>

using at::Tensor;

namespace {

// per unit, in the order the Python side lists them (hpipe/model/compute/stage_kernel.py: StageKernel)
// (the norms after q/k and after the output are empty tensors in the families without them)
enum AttnParam { A_NORM, A_QKV, A_QKV_SHAPE, A_QKV_BIAS, A_O, A_O_SHAPE, A_O_BIAS, A_Q_NORM, A_K_NORM, A_POST_NORM,
                 A_COUNT };
enum MlpParam { M_NORM, M_GATE_UP, M_GATE_UP_SHAPE, M_GATE_UP_BIAS, M_DOWN, M_DOWN_SHAPE, M_DOWN_BIAS, M_POST_NORM,
                M_COUNT };

std::optional<Tensor> maybe(const Tensor& t) {
  return t.numel() ? std::optional<Tensor>(t) : std::nullopt;
}

// x @ w.T + b, with w packed for MKL (shape: the original weight's zero-byte stand-in), plain
// (shape empty) or GGUF's quantized blocks (uint8; shape: their parts, quant.h)
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& shape, const Tensor& bias) {
  if (w.scalar_type() == at::kByte) return hpipe::qlinear_decode(x, w, shape, bias);  // every row a decode row
  if (shape.numel() == 0) return at::linear(x, w, maybe(bias));
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkl::_mkl_linear", "")
                       .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const std::optional<Tensor>&,
                                     int64_t)>();
  return op.call(x, w, shape, maybe(bias), x.size(0));
}

// Hugging Face's LlamaRMSNorm in float32 over d values: in * rsqrt(mean(in^2) + eps) * w, into o
void rms_norm_row(const float* in, const float* w, int64_t d, double eps, float* o) {
  float sum = 0.f;
  for (int64_t i = 0; i < d; ++i) sum += in[i] * in[i];
  const float scale = 1.f / std::sqrt(sum / static_cast<float>(d) + static_cast<float>(eps));
  for (int64_t i = 0; i < d; ++i) o[i] = w[i] * (in[i] * scale);
}

void check_norm(const Tensor& weight, int64_t d) {
  TORCH_CHECK(weight.numel() == d && weight.is_contiguous() && weight.scalar_type() == at::kFloat,
              "a norm's weight is float32 [its width]");
}

// the norm row by row of x [rows, hidden]
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  const int64_t rows = x.size(0), d = x.size(1);
  check_norm(weight, d);
  Tensor out = at::empty_like(x);
  for (int64_t r = 0; r < rows; ++r)
    rms_norm_row(x.data_ptr<float>() + r * d, weight.data_ptr<float>(), d, eps, out.data_ptr<float>() + r * d);
  return out;
}

// Qwen3's and Gemma's per-head norms of the queries (the first `heads` heads of each row of qkv
// [rows, all heads, head_dim]) and of the keys (the next `kv_heads`), in place
void head_norms(Tensor& qkv, const Tensor& q_norm, const Tensor& k_norm, int64_t heads, int64_t kv_heads,
                double eps) {
  const int64_t dim = qkv.size(2);
  check_norm(q_norm, dim);
  check_norm(k_norm, dim);
  for (int64_t r = 0; r < qkv.size(0); ++r)
    for (int64_t h = 0; h < heads + kv_heads; ++h) {
      float* x = qkv.data_ptr<float>() + (r * qkv.size(1) + h) * dim;
      rms_norm_row(x, (h < heads ? q_norm : k_norm).data_ptr<float>(), dim, eps, x);
    }
}

// x * cos + rotate_half(x) * sin over the first `heads` heads of each row of qkv
// [rows, all heads, head_dim], in place; ssin holds sin with its first half negated. cos and ssin
// [rows, rot] may cover only a head's leading `rot` dimensions (partial rotation): the rest pass.
void rotate(Tensor& qkv, const Tensor& cos, const Tensor& ssin, int64_t heads) {
  const int64_t rows = qkv.size(0), dim = qkv.size(2), rot = cos.size(1), half = rot / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos.data_ptr<float>() + r * rot;
    const float* s = ssin.data_ptr<float>() + r * rot;
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

// One row's attention in two passes over each KV head's keys and values, each read once from
// memory with AVX-512: MKL's batched product copies a row's keys before multiplying them, which for
// one query row costs more than the product (SmolLM2, 16 rows over 1,200 positions, one thread: all
// 30 layers' attention took 146 ms through MKL, about 92 here against 87-93 ms to stream the keys
// and values once). The sums run in another order than MKL's: the same up to float rounding.
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HPIPE_AVX512 __attribute__((target("avx512f")))

// scores[g * stride + j] = q[g] . keys[j] for the group's queries [group, dim] and the len keys
// [len, dim] (stride: the length of a query's whole row of scores, of which these are a part)
HPIPE_AVX512 void key_scores(const float* q, const float* keys, int64_t len, int64_t group, int64_t dim,
                             float* scores, int64_t stride) {
  if (dim == 64 && group <= 4) {  // the common shape: the queries in registers, each key loaded once
    __m512 qr[4][4];
    for (int64_t g = 0; g < group; ++g)
      for (int c = 0; c < 4; ++c) qr[g][c] = _mm512_loadu_ps(q + g * 64 + c * 16);
    for (int64_t j = 0; j < len; ++j) {
      const float* k = keys + j * 64;
      const __m512 k0 = _mm512_loadu_ps(k), k1 = _mm512_loadu_ps(k + 16), k2 = _mm512_loadu_ps(k + 32),
                   k3 = _mm512_loadu_ps(k + 48);
      for (int64_t g = 0; g < group; ++g) {
        const __m512 a = _mm512_fmadd_ps(qr[g][1], k1, _mm512_mul_ps(qr[g][0], k0));
        const __m512 b = _mm512_fmadd_ps(qr[g][3], k3, _mm512_mul_ps(qr[g][2], k2));
        scores[g * stride + j] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
      }
    }
    return;
  }
  for (int64_t j = 0; j < len; ++j) {
    const float* k = keys + j * dim;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * dim;
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), _mm512_loadu_ps(k));
      for (int64_t i = 16; i < dim; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + i), _mm512_loadu_ps(k + i), acc);
      scores[g * stride + j] = _mm512_reduce_add_ps(acc);
    }
  }
}

// out[g] += sum over j of probs[g * stride + j] * values[j], for values [len, dim]
HPIPE_AVX512 void weighted_values(const float* probs, const float* values, int64_t len, int64_t group, int64_t dim,
                                  float* out, int64_t stride) {
  if (dim == 64 && group <= 4) {  // the common shape: every sum in registers
    __m512 acc[4][4];
    for (int64_t g = 0; g < group; ++g)
      for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_loadu_ps(out + g * 64 + c * 16);
    for (int64_t j = 0; j < len; ++j) {
      const float* v = values + j * 64;
      _mm_prefetch(reinterpret_cast<const char*>(v + 16 * 64), _MM_HINT_T0);
      const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16), v2 = _mm512_loadu_ps(v + 32),
                   v3 = _mm512_loadu_ps(v + 48);
      for (int64_t g = 0; g < group; ++g) {
        const __m512 p = _mm512_set1_ps(probs[g * stride + j]);
        acc[g][0] = _mm512_fmadd_ps(p, v0, acc[g][0]);
        acc[g][1] = _mm512_fmadd_ps(p, v1, acc[g][1]);
        acc[g][2] = _mm512_fmadd_ps(p, v2, acc[g][2]);
        acc[g][3] = _mm512_fmadd_ps(p, v3, acc[g][3]);
      }
    }
    for (int64_t g = 0; g < group; ++g)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + g * 64 + c * 16, acc[g][c]);
    return;
  }
  for (int64_t j = 0; j < len; ++j) {
    const float* v = values + j * dim;
    for (int64_t g = 0; g < group; ++g) {
      const __m512 p = _mm512_set1_ps(probs[g * stride + j]);
      float* o = out + g * dim;
      for (int64_t i = 0; i < dim; i += 16)
        _mm512_storeu_ps(o + i, _mm512_fmadd_ps(p, _mm512_loadu_ps(v + i), _mm512_loadu_ps(o + i)));
    }
  }
}

// The same two passes on a CPU with AVX2 and FMA but no AVX-512 (the AMD EPYCs this runs on):
// eight floats a vector, the sums of the weighted values kept in L1 rather than in registers
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
typedef float vec8 __attribute__((vector_size(32)));

inline vec8 load8(const float* p) {
  vec8 v;
  std::memcpy(&v, p, 32);
  return v;
}

inline float sum8(vec8 v) {
  const vec8 h = v + __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  return (h[0] + h[2]) + (h[1] + h[3]);
}

void key_scores(const float* q, const float* keys, int64_t len, int64_t group, int64_t dim, float* scores,
                int64_t stride) {
  for (int64_t j = 0; j < len; ++j) {
    const float* k = keys + j * dim;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * dim;
      vec8 a = load8(qg) * load8(k), b = {};
      int64_t i = 8;
      for (; i + 8 < dim; i += 16) {
        a += load8(qg + i) * load8(k + i);
        b += load8(qg + i + 8) * load8(k + i + 8);
      }
      for (; i < dim; i += 8) a += load8(qg + i) * load8(k + i);
      scores[g * stride + j] = sum8(a + b);
    }
  }
}

void weighted_values(const float* probs, const float* values, int64_t len, int64_t group, int64_t dim, float* out,
                     int64_t stride) {
  for (int64_t j = 0; j < len; ++j) {
    const float* v = values + j * dim;
    for (int64_t g = 0; g < group; ++g) {
      const float p = probs[g * stride + j];
      float* o = out + g * dim;
      for (int64_t i = 0; i < dim; i += 8) {
        const vec8 r = load8(o + i) + p * load8(v + i);
        std::memcpy(o + i, &r, 32);
      }
    }
  }
}
}  // namespace avx2
#pragma GCC pop_options

enum class AttentionLoops { none, avx2, avx512 };

// the widest loops the CPU has (HPIPE_CPU_ISA=avx2 or portable caps them, as for the quantized
// kernels), or none for this head size
AttentionLoops attention_loops(int64_t head_dim) {
  static const AttentionLoops best = [] {
    const char* cap_env = std::getenv("HPIPE_CPU_ISA");
    const std::string cap = cap_env ? cap_env : "";
    __builtin_cpu_init();
    if (cap != "avx2" && cap != "portable" && __builtin_cpu_supports("avx512f")) return AttentionLoops::avx512;
    if (cap != "portable" && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return AttentionLoops::avx2;
    return AttentionLoops::none;
  }();
  if (best == AttentionLoops::avx512 && head_dim % 16 == 0) return best;
  if (best != AttentionLoops::none && head_dim % 8 == 0) return AttentionLoops::avx2;
  return AttentionLoops::none;
}

bool vector_attention(int64_t head_dim) { return attention_loops(head_dim) != AttentionLoops::none; }

// A row's positions in one KV head's pool slots: `count` consecutive slots from `slot`
struct Segment {
  int64_t slot, count;
};

// one KV head's group of queries q [group, dim] over the positions in `segments` (in position
// order, len in all) of that head's keys and values [slots, dim], into out [group, dim]
void attend_row(const float* q, const float* keys, const float* values, const std::vector<Segment>& segments,
                int64_t len, int64_t group, int64_t dim, float* out, const at::TensorOptions& options) {
  const bool wide = attention_loops(dim) == AttentionLoops::avx512;
  Tensor scores = at::empty({group, len}, options);
  int64_t at = 0;
  for (const Segment& s : segments) {
    (wide ? key_scores : avx2::key_scores)(q, keys + s.slot * dim, s.count, group, dim,
                                           scores.data_ptr<float>() + at, len);
    at += s.count;
  }
  const Tensor probs = at::_softmax(scores, -1, false);
  std::fill(out, out + group * dim, 0.f);
  at = 0;
  for (const Segment& s : segments) {
    (wide ? weighted_values : avx2::weighted_values)(probs.data_ptr<float>() + at, values + s.slot * dim, s.count,
                                                     group, dim, out, len);
    at += s.count;
  }
}
#else
struct Segment {
  int64_t slot, count;
};
bool vector_attention(int64_t) { return false; }
void attend_row(const float*, const float*, const float*, const std::vector<Segment>&, int64_t, int64_t, int64_t,
                float*, const at::TensorOptions&) {}
#endif

// Where each row's keys and values are. A sequence's positions lie in runs of consecutive pool
// slots: one when its blocks are consecutive, more when it begins with cached prefix blocks
// (shared with other sequences) or when a pool under pressure scattered it.
struct Rows {
  std::vector<int64_t> position;  // each row's position in its sequence
  std::vector<int64_t> write;     // the pool slot of that position, where its key and value go
  std::vector<std::vector<Segment>> runs;  // its positions [0, position] in order, as runs of slots

  // the runs of positions [first, position] of row r
  std::vector<Segment> window(int64_t r, int64_t first) const {
    std::vector<Segment> out;
    int64_t at = 0;
    for (const Segment& s : runs[r]) {
      const int64_t skip = std::max<int64_t>(0, first - at);
      if (skip < s.count) out.push_back({s.slot + skip, s.count - skip});
      at += s.count;
    }
    return out;
  }
};

Tensor attention_unit(const Tensor& x, const std::vector<Tensor>& p, const Tensor& k_pool, const Tensor& v_pool,
                      const Tensor& cos, const Tensor& ssin, const Rows& rows, int64_t window, int64_t heads,
                      int64_t kv_heads, int64_t head_dim, double eps, double scale, bool vector) {
  const int64_t n = x.size(0), group = heads / kv_heads;
  Tensor qkv = linear(rms_norm(x, p[A_NORM], eps), p[A_QKV], p[A_QKV_SHAPE], p[A_QKV_BIAS])
                   .view({n, heads + 2 * kv_heads, head_dim});
  if (p[A_Q_NORM].numel()) head_norms(qkv, p[A_Q_NORM], p[A_K_NORM], heads, kv_heads, eps);
  rotate(qkv, cos, ssin, heads + kv_heads);
  qkv.narrow(1, 0, heads).mul_(scale);  // the queries scaled once, not each row's scores
  const int64_t slots = k_pool.size(1);
  Tensor out = at::empty({n, heads, head_dim}, x.options());
  for (int64_t r = 0; r < n; ++r) {  // every row's key and value into its slot, before any row reads
    const int64_t slot = rows.write[r];
    TORCH_CHECK(slot >= 0 && slot < slots, "a row's KV slot lies outside the pool");
    for (const Segment& s : rows.runs[r])
      TORCH_CHECK(s.slot >= 0 && s.count >= 0 && s.slot + s.count <= slots, "a row's KV run lies outside the pool");
    const float* row = qkv.data_ptr<float>() + r * (heads + 2 * kv_heads) * head_dim;
    for (int64_t h = 0; h < kv_heads; ++h) {
      std::memcpy(k_pool.data_ptr<float>() + (h * slots + slot) * head_dim, row + (heads + h) * head_dim,
                  head_dim * sizeof(float));
      std::memcpy(v_pool.data_ptr<float>() + (h * slots + slot) * head_dim,
                  row + (heads + kv_heads + h) * head_dim, head_dim * sizeof(float));
    }
  }
  // each row's KV heads over its own prefix, (row, KV head) pairs spread over the intra-op threads
  // (reading keys is memory-bound: one sequence's step leaves no thread idle), each thread in the
  // caller's inference mode (the pools are inference tensors)
  const at::ThreadLocalState caller;
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard as_caller(caller);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / kv_heads, h = item % kv_heads;
      const int64_t pos = rows.position[r];
      const int64_t first = window > 0 ? std::max<int64_t>(0, pos + 1 - window) : 0;
      const int64_t len = pos + 1 - first;
      const std::vector<Segment> segments = rows.window(r, first);
      const float* q = qkv.data_ptr<float>() + (r * (heads + 2 * kv_heads) + h * group) * head_dim;
      float* o = out.data_ptr<float>() + (r * heads + h * group) * head_dim;
      if (vector) {
        const int64_t at = h * slots * head_dim;
        attend_row(q, k_pool.data_ptr<float>() + at, v_pool.data_ptr<float>() + at, segments, len, group, head_dim,
                   o, x.options());
        continue;
      }
      std::vector<Tensor> key_runs, value_runs;
      for (const Segment& s : segments) {
        key_runs.push_back(k_pool.select(0, h).narrow(0, s.slot, s.count));
        value_runs.push_back(v_pool.select(0, h).narrow(0, s.slot, s.count));
      }
      Tensor keys = key_runs.size() == 1 ? key_runs[0] : at::cat(key_runs);
      Tensor values = value_runs.size() == 1 ? value_runs[0] : at::cat(value_runs);
      Tensor qg = qkv.select(0, r).narrow(0, h * group, group);
      Tensor into = out.select(0, r).narrow(0, h * group, group);
      at::mm_out(into, at::_softmax(at::mm(qg, keys.t()), -1, false), values);
    }
  });
  Tensor h = linear(out.view({n, heads * head_dim}), p[A_O], p[A_O_SHAPE], p[A_O_BIAS]);
  return x + (p[A_POST_NORM].numel() ? rms_norm(h, p[A_POST_NORM], eps) : h);
}

// gelu: GeGLU with tanh GELU (Gemma), else SwiGLU
Tensor mlp_unit(const Tensor& x, const std::vector<Tensor>& p, double eps, bool gelu) {
  Tensor gate_up = linear(rms_norm(x, p[M_NORM], eps), p[M_GATE_UP], p[M_GATE_UP_SHAPE], p[M_GATE_UP_BIAS]);
  const int64_t inner = gate_up.size(1) / 2;
  Tensor gate = gate_up.narrow(1, 0, inner);
  Tensor act = (gelu ? at::gelu(gate, "tanh") : at::silu(gate)).mul_(gate_up.narrow(1, inner, inner));
  Tensor h = linear(act, p[M_DOWN], p[M_DOWN_SHAPE], p[M_DOWN_BIAS]);
  return x + (p[M_POST_NORM].numel() ? rms_norm(h, p[M_POST_NORM], eps) : h);
}

// The residual stream x [rows, hidden] through a stage's attention and MLP units in order:
// kinds[i] is 0 for an attention unit, 1 for an MLP unit; params holds each unit's tensors in
// turn (A_COUNT or M_COUNT of them; an empty tensor for a bias or packed shape it lacks);
// k_pools, v_pools, windows and ropes hold each attention unit's KV pool tensors [kv_heads, slots,
// head_dim], sliding window (0: none) and RoPE (an index into cos). cos and ssin [ropes, rows,
// rotated dims] are the rows' rotary factors, one set per RoPE; positions and write slots as in
// Rows, and runs each row's runs in turn: their count, then a slot and a length for each. scale:
// the queries'; gelu: the MLP's activation (else silu). vector: attention through the AVX-512 or
// AVX2 loops where the CPU and the head size allow them (false: MKL's products, to compare).
Tensor decode_units(Tensor x, const Tensor& cos, const Tensor& ssin, at::IntArrayRef positions,
                    at::IntArrayRef writes, at::IntArrayRef runs, at::IntArrayRef kinds, at::TensorList params, at::TensorList k_pools,
                    at::TensorList v_pools, at::IntArrayRef windows, at::IntArrayRef ropes, int64_t heads,
                    int64_t kv_heads, int64_t head_dim, double eps, double scale, bool gelu, bool vector) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "decode_units takes a contiguous float32 CPU residual stream [rows, hidden]");
  TORCH_CHECK(static_cast<int64_t>(positions.size()) == x.size(0) && positions.size() == writes.size(),
              "one position and one write slot per row");
  TORCH_CHECK(heads % kv_heads == 0 && head_dim % 2 == 0, "heads must be a multiple of kv_heads, head_dim even");
  Rows rows{positions.vec(), writes.vec(), {}};
  size_t at_run = 0;
  for (size_t r = 0; r < positions.size(); ++r) {
    TORCH_CHECK(at_run < runs.size() && runs[at_run] >= 1 &&
                    at_run + 1 + 2 * static_cast<size_t>(runs[at_run]) <= runs.size(),
                "each row's runs: their count (one or more), then a slot and a length for each");
    std::vector<Segment> row;
    int64_t covered = 0;
    for (int64_t i = 0; i < runs[at_run]; ++i) {
      row.push_back({runs[at_run + 1 + 2 * i], runs[at_run + 2 + 2 * i]});
      covered += row.back().count;
    }
    TORCH_CHECK(positions[r] >= 0 && covered == positions[r] + 1, "a row's runs cover its positions 0 to its own");
    at_run += 1 + 2 * static_cast<size_t>(runs[at_run]);
    rows.runs.push_back(std::move(row));
  }
  TORCH_CHECK(at_run == runs.size(), "more runs than the rows have");
  vector = vector && vector_attention(head_dim);
  Tensor c = cos.contiguous(), s = ssin.contiguous();
  TORCH_CHECK(c.dim() == 3 && c.size(1) == x.size(0) && c.size(2) <= head_dim && c.size(2) % 2 == 0 &&
                  s.sizes() == c.sizes() && c.scalar_type() == at::kFloat && s.scalar_type() == at::kFloat,
              "cos and ssin are float32 [ropes, rows, rotated dims <= head_dim]");
  size_t at_param = 0, at_window = 0;
  for (int64_t kind : kinds) {
    const size_t count = kind == 0 ? static_cast<size_t>(A_COUNT) : static_cast<size_t>(M_COUNT);
    TORCH_CHECK(at_param + count <= params.size(), "too few unit tensors for the unit kinds");
    std::vector<Tensor> p(params.begin() + at_param, params.begin() + at_param + count);
    at_param += count;
    if (kind == 0) {
      TORCH_CHECK(at_window < windows.size() && at_window < k_pools.size() && at_window < v_pools.size() &&
                      at_window < ropes.size() && ropes[at_window] >= 0 && ropes[at_window] < c.size(0),
                  "one window, one RoPE and one K and V pool per attention unit");
      for (const Tensor* pool : {&k_pools[at_window], &v_pools[at_window]})
        TORCH_CHECK(pool->is_contiguous() && pool->scalar_type() == at::kFloat && pool->dim() == 3 &&
                        pool->size(0) == kv_heads && pool->size(2) == head_dim,
                    "a KV pool tensor is contiguous float32 [kv_heads, slots, head_dim]");
      x = attention_unit(x, p, k_pools[at_window], v_pools[at_window], c.select(0, ropes[at_window]),
                         s.select(0, ropes[at_window]), rows, windows[at_window], heads, kv_heads, head_dim, eps,
                         scale, vector);
      ++at_window;
    } else {
      x = mlp_unit(x, p, eps, gelu);
    }
  }
  TORCH_CHECK(at_param == params.size(), "more unit tensors than the unit kinds take");
  return x;
}

}  // namespace

// one kernel for every dispatch key: the packed weights are MKL-DNN tensors, the rest plain CPU ones
TORCH_LIBRARY(hpipe, m) {
  m.def("decode_units(Tensor x, Tensor cos, Tensor ssin, int[] positions, int[] writes, int[] runs, int[] kinds, "
        "Tensor[] params, Tensor[] k_pools, Tensor[] v_pools, int[] windows, int[] ropes, int heads, int kv_heads, "
        "int head_dim, float eps, float scale, bool gelu, bool vector) -> Tensor",
        &decode_units);
}
