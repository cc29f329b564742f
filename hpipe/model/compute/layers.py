"""The four unit kinds as plain ``nn.Module``s, and the checkpoint names of every parameter.

Each unit maps the residual stream to the residual stream (embed maps token ids to it, head maps
it to logits). Layer indices stay global, so a stage holding layers 12..17 reads
``model.layers.12.*`` from the checkpoint like the full model does.

The query, key and value projections are one matrix (``qkv_proj``), and so are the MLP's gate
and up projections (``gate_up_proj``): the checkpoint's matrices stacked at load (Phi-3's
checkpoints store them so). A decode step multiplies each weight by a handful of rows, where a
call's fixed cost is a fair share of its time, so three calls made one are fewer passes and fewer
launches.

Norms are named by their role in the unit (``norm`` before, ``post_norm`` after, ``q_norm`` and
``k_norm`` per head); :data:`NORM_NAMES` gives each family's checkpoint names for them. A norm's
weight is its effective factor: Gemma's checkpoints store ``factor - 1``, added back at load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from hpipe.core.config import ModelConfig
from hpipe.core.units import ATTN, EMBED, HEAD, MLP, UnitRange, unit_kind
from hpipe.model.compute.linear import Linear
from hpipe.model.compute.rope import apply_rotary
from hpipe.model.kernels.precision import own_bf16_attention, own_f32_attention, prefill_in_bfloat16
from hpipe.model.kv.pool import BatchKV

#: each family's checkpoint names of a unit's ``norm`` and ``post_norm`` (within ``model.layers.N.``)
NORM_NAMES = {
    "llama": {ATTN: {"norm": "input_layernorm"}, MLP: {"norm": "post_attention_layernorm"}},
    "gemma3": {ATTN: {"norm": "input_layernorm", "post_norm": "post_attention_layernorm"},
               MLP: {"norm": "pre_feedforward_layernorm", "post_norm": "post_feedforward_layernorm"}},
}
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:  # one fused kernel, the same arithmetic
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def is_norm(param: str) -> bool:
    """Whether a unit's parameter is a norm's weight."""
    return param.endswith("norm.weight")


class Embed(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.scale = cfg.embed_scale  # Gemma's sqrt(hidden), in the activations' dtype as transformers has it

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        if self.scale == 1.0:
            return x
        return x * float(torch.tensor(self.scale, dtype=torch.float32).to(x.dtype))


class Attention(nn.Module):
    """``x + post_norm(o_proj(attention(norm(x))))`` over the cached prefix plus this slice (no
    ``post_norm`` but Gemma's), queries and keys per-head normed (Qwen3, Gemma) and rotated by the
    layer's RoPE (:attr:`rope`: Gemma's sliding layers have their own)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window = cfg.sliding_windows[layer]
        self.rope = cfg.rope_of(layer)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = Linear(cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim,
                               bias=cfg.qkv_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.sandwich_norms else None
        self.scale = cfg.attention_scale
        #: a prefill slice's attention in bfloat16 while the quantized kernels' prefill GEMM is
        #: (set on a stage of quantized weights; :func:`hpipe.model.kernels.precision.prefill_in_bfloat16`)
        self.low_precision_prefill = False

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and keys ``[tokens, heads + kv_heads, head_dim]``, rotated, and values
        ``[tokens, kv_heads, head_dim]`` of the tokens of ``x`` (``cos``, ``sin``: ``[tokens, 1, head_dim]``).
        Token-major, so that a token's heads are one row: no transposes on the way."""
        qkv = self.qkv_proj(self.norm(x)).view(-1, self.heads + 2 * self.kv_heads, self.head_dim)
        qk = qkv[:, :self.heads + self.kv_heads]
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :self.heads]), self.k_norm(qk[:, self.heads:])), dim=1)
        return apply_rotary(qk, cos, sin), qkv[:, self.heads + self.kv_heads:]

    def _out(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The residual stream plus the attention's output ``o`` projected (and normed, Gemma's)."""
        h = self.o_proj(o)
        return x + (h if self.post_norm is None else self.post_norm(h))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: BatchKV) -> torch.Tensor:
        """The micro-batch ``x [1, tokens, hidden]``: every entry's tokens attend to its own sequence's
        cached prefix and to themselves; projections run once over all tokens."""
        t, heads = x.shape[1], self.heads
        qk, v = self._project(x, cos, sin)
        k = qk[:, heads:]
        batch.write(self.layer, k, v)
        o = x.new_empty(t, heads, self.head_dim)
        for i, e in enumerate(batch.entries):
            a = batch.offsets[i]
            keys, values = batch.read(self.layer, i, k, v)
            if e.kv is None:  # a failed sequence's rows: computed over themselves, never read
                self._attend_rows(qk[a:a + e.length, :heads], keys, values, 0, o[a:a + e.length], batch.masks)
                continue
            n = e.prefill  # the prompt's rows, in the prefill's precision
            if n:
                self._attend_rows(qk[a:a + n, :heads], keys[:, :e.start + n], values[:, :e.start + n], e.start,
                                  o[a:a + n], batch.masks, prefill=True)
            if n < e.length:  # decode tokens (a replay's or a restart's too): in float32, as decode steps
                self._attend_rows(qk[a + n:a + e.length, :heads], keys, values, e.start + n, o[a + n:a + e.length],
                                  batch.masks, prefill=False)
        return self._out(x, o.view(1, t, heads * self.head_dim))

    def _attend_rows(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, out: torch.Tensor,
                     masks: dict, prefill: bool | None = None) -> None:
        """Rows ``q [s, heads, head_dim]`` at positions ``start ..`` over ``keys [kv_heads, start + s,
        head_dim]``, into ``out [s, heads, head_dim]``: one decode row as a decode step computes it;
        ``prefill`` (None: rows of several) as a prefill slice, in its precision, else in float32."""
        if len(q) == 1 and not prefill and not q.is_cuda and (self.window is None or start == 0):
            self._attend_one(q[0], keys, values, out[0])
            return
        if len(q) > 1 and prefill is False and q.is_cuda:  # a GPU's decode rows: each as a lone step's
            for i in range(len(q)):
                self._attend_rows(q[i:i + 1], keys[:, :start + i + 1], values[:, :start + i + 1], start + i,
                                  out[i:i + 1], masks, prefill=False)
            return
        res = self._attend(q.transpose(0, 1)[None], keys[None], values[None], start, masks, prefill=prefill)
        out.copy_(res[0].transpose(0, 1))

    def forward_decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor,
                       v_pool: torch.Tensor, write: torch.Tensor, gather: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
        """One token for each of ``rows`` sequences, ``x [rows, 1, hidden]``, with shapes that never
        change (what a CUDA graph needs, :mod:`hpipe.model.compute.graphs`): row r writes its key at pool slot
        ``write[r]`` and attends over the slots ``gather[r]`` where ``mask[r]`` holds."""
        rows, context = gather.shape
        qk, v = self._project(x, cos, sin)  # [rows, heads (+ kv_heads), head_dim]
        k_pool.index_copy_(1, write, qk[:, self.heads:].transpose(0, 1))
        v_pool.index_copy_(1, write, v.transpose(0, 1))
        keys = k_pool.index_select(1, gather.reshape(-1)).view(self.kv_heads, rows, context, self.head_dim)
        values = v_pool.index_select(1, gather.reshape(-1)).view(self.kv_heads, rows, context, self.head_dim)
        out = F.scaled_dot_product_attention(qk[:, :self.heads, None], keys.transpose(0, 1), values.transpose(0, 1),
                                             attn_mask=mask.view(rows, 1, 1, context), scale=self.scale,
                                             enable_gqa=self.kv_heads != self.heads)
        return self._out(x, out.reshape(rows, 1, self.heads * self.head_dim))

    def _attend_one(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, out: torch.Tensor) -> None:
        """One query ``[heads, head_dim]`` over all of ``keys [kv_heads, positions, head_dim]``, into
        ``out [heads, head_dim]``: on a CPU two batched products beat the fused kernel's setup for a
        single row (SmolLM2, 620 positions: 54 us against 80 us, measured)."""
        group = self.heads // self.kv_heads
        scores = torch.bmm(q.view(self.kv_heads, group, self.head_dim), keys.transpose(1, 2)).mul_(self.scale)
        if scores.dtype == torch.float32:
            torch.bmm(torch.softmax(scores, dim=-1), values, out=out.view(self.kv_heads, group, self.head_dim))
        else:
            probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
            torch.bmm(probs, values, out=out.view(self.kv_heads, group, self.head_dim))

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                masks: dict | None = None, prefill: bool | None = None) -> torch.Tensor:
        """``q [1, heads, s, head_dim]`` at positions ``start ..`` over ``keys [1, kv_heads, start + s, head_dim]``
        (``masks``: the micro-batch's masks, made once for all its layers; ``prefill``: whether these
        are a prompt's rows, computed in the prefill's precision, even one; None: where there are several)."""
        s = q.shape[2]
        prefill = s > 1 if prefill is None else prefill
        if (s > 1 or prefill) and not q.is_cuda:
            return self._attend_split(q, keys, values, start, {} if masks is None else masks, low=prefill)
        # A lower-right causal mask: query i (position start+i) sees keys 0..start+i. Relying on
        # is_causal would align the triangle top-left and drop the cached prefix.
        mask, causal = None, False
        if start == 0 and self.window is None:
            causal = s > 1  # no prefix: lower-right == top-left, and the kernel can skip the upper triangle
        elif s > 1 and self.window is None:
            # lets SDPA pick a fused kernel (flash / memory-efficient); a boolean mask would force a
            # slower one: 16 slices of a 6 x 2048 prefill took 1.62x one slice with it on an H100
            mask = causal_lower_right(s, start + s)
        elif s == 1 and self.window is not None:
            first = max(0, start + 1 - self.window)  # one query: its window is a slice, no mask
            keys, values = keys[:, :, first:], values[:, :, first:]
        elif s > 1 or self.window is not None:
            mask = _additive_mask(start, s, start + s, self.window, q.device, q.dtype, {})
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal, scale=self.scale,
                                              enable_gqa=self.kv_heads != self.heads)

    def _attend_split(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                      masks: dict, low: bool = True) -> torch.Tensor:
        """A prefill slice on the CPU, over its keys padded with masked zeros to whole splits of
        ``KV_SPLIT`` positions: SDPA's CPU kernel then splits every slice's keys at the same
        absolute positions, and the splits past a query's own position add exact zeros, so a
        query's result does not depend on how its prompt was sliced (bit for bit in bfloat16,
        tested; float32's products of two rows can differ by an ulp). Unpadded, a 700-token
        slice's last query differed from the same query in a 3,000-token slice by a bfloat16
        step; the padding cost 3-10% of the attention's time in five slicings (measured, AVX-512 Xeon).
        In bfloat16 while the quantized kernels' prefill GEMM is (set on a stage of quantized
        weights: :func:`hpipe.model.kernels.precision.prefill_in_bfloat16`): 2.7x float32's speed for a
        512-token slice over 2,048 keys (AMX), results in float32. Where hpipe's own bfloat16
        GEMM runs (AMD's Zen 4, where SDPA's bfloat16 is no faster than float32), hpipe's own
        attention instead (``kernels/bf16_attention.cpp``: slicing-invariant by construction).
        ``low`` False: rows of decoded tokens computed again (a replay's), in float32 as decode did."""
        s, n = q.shape[2], start + q.shape[2]
        low = low and self.low_precision_prefill and q.dtype == torch.float32 and prefill_in_bfloat16()
        if low and self.head_dim % 64 == 0 and keys.dtype == torch.float32 and own_bf16_attention():
            # hpipe's own kernel: invariant to the slicing by construction, no padding needed
            out = torch.ops.hpipe.bf16_attention(q[0].transpose(0, 1), keys[0], values[0], start, self.scale,
                                                 self.window or 0)
            return out.transpose(0, 1)[None]
        if (not low and q.dtype == keys.dtype == values.dtype == torch.float32 and self.head_dim % 16 == 0
                and keys.stride(-1) == values.stride(-1) == 1 and own_f32_attention()):
            # hpipe's own float32 kernel on an AVX2 CPU: invariant to the slicing by construction too
            out = torch.ops.hpipe.f32_attention(q[0].transpose(0, 1), keys[0], values[0], start, self.scale,
                                                self.window or 0)
            return out.transpose(0, 1)[None]
        width = -(-n // KV_SPLIT) * KV_SPLIT
        dtype = torch.bfloat16 if low else q.dtype
        padded_keys = keys.new_zeros(*keys.shape[:2], width, keys.shape[3], dtype=dtype)
        padded_values = values.new_zeros(*values.shape[:2], width, values.shape[3], dtype=dtype)
        padded_keys[:, :, :n], padded_values[:, :, :n] = keys, values
        mask = None
        if start > 0 or self.window is not None:  # else top-left causal is right, padding included
            mask = _additive_mask(start, s, width, self.window, q.device, dtype, masks)
        out = F.scaled_dot_product_attention(q.to(dtype), padded_keys, padded_values, attn_mask=mask,
                                             is_causal=mask is None, scale=self.scale,
                                             enable_gqa=self.kv_heads != self.heads)
        return out.float() if low else out


#: the keys per split of SDPA's CPU flash-attention kernel (its kv_split_size): prefill slices pad
#: their keys to whole splits (:meth:`Attention._attend_split`)
KV_SPLIT = 512


def _additive_mask(start: int, s: int, width: int, window: int | None, device: torch.device, dtype: torch.dtype,
                   made: dict) -> torch.Tensor:
    """Queries at positions ``start .. start + s`` over keys ``0 .. width``: 0 where a query sees a
    key (causal, within ``window``), -inf elsewhere; ``made`` keeps it for the micro-batch's
    other layers. Additive rather than boolean, which SDPA would convert at every call: a masked
    bfloat16 slice of 512 over 2,048 keys 5.5 -> 4.9 ms, the same values (measured); on the CPU as
    fast as a bias or faster, and the only form that also expresses a sliding window."""
    key = (start, s, width, window, device, dtype)
    if key not in made:
        q_pos = torch.arange(start, start + s, device=device)[:, None]
        k_pos = torch.arange(width, device=device)[None, :]
        seen = k_pos <= q_pos
        if window is not None:
            seen = seen & (k_pos > q_pos - window)
        made[key] = torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen, float("-inf"))
    return made[key]


class FeedForward(nn.Module):
    """``x + post_norm(down_proj(act(gate_proj(n)) * up_proj(n)))`` with ``n = norm(x)``: SwiGLU
    (``act`` silu) or GeGLU (tanh GELU, Gemma's, which alone has a ``post_norm``)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.act = cfg.hidden_act
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.sandwich_norms else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(self.norm(x)).chunk(2, dim=-1)
        h = self.down_proj(ACTIVATIONS[self.act](gate) * up)
        return x + (h if self.post_norm is None else self.post_norm(h))


class Head(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))


def build_unit(cfg: ModelConfig, unit: int) -> nn.Module:
    kind, layer = unit_kind(unit, cfg.num_layers)
    if kind == EMBED:
        return Embed(cfg)
    if kind == ATTN:
        return Attention(cfg, layer)
    if kind == MLP:
        return FeedForward(cfg, layer)
    return Head(cfg)


#: fused parameters and the checkpoint's tensors stacked into them (in order, along dim 0)
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fused_rows(cfg: ModelConfig, param: str) -> tuple[int, ...]:
    """The rows each checkpoint tensor of a fused parameter takes, in order."""
    if param.startswith("qkv_proj."):
        return cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return cfg.intermediate_size, cfg.intermediate_size


def checkpoint_tensors(cfg: ModelConfig, unit: int) -> list[str]:
    """Every checkpoint tensor ``unit`` reads, without building its weights (a meta module)."""
    with torch.device("meta"):
        module = build_unit(cfg, unit)
    return [n for parts in checkpoint_names(cfg, unit, module).values() for n in parts]


def checkpoint_names(cfg: ModelConfig, unit: int, module: nn.Module) -> dict[str, tuple[str, ...]]:
    """``{parameter name in the unit module: the Hugging Face checkpoint tensors it stacks}``."""
    kind, layer = unit_kind(unit, cfg.num_layers)
    if kind == EMBED:
        return {"embed_tokens.weight": ("model.embed_tokens.weight",)}
    if kind == HEAD:
        lm = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        return {"norm.weight": ("model.norm.weight",), "lm_head.weight": (lm,)}
    block = f"model.layers.{layer}."
    prefix = block + ("self_attn." if kind == ATTN else "mlp.")
    norms = NORM_NAMES.get(cfg.family, NORM_NAMES["llama"])[kind]
    names = {}
    for name, _ in module.named_parameters():
        child, param = name.split(".")
        if child in norms:
            names[name] = (f"{block}{norms[child]}.{param}",)
        elif child in ("q_norm", "k_norm") or cfg.family == "phi3":  # Phi-3 stores the fused matrices
            names[name] = (f"{prefix}{name}",)
        else:
            names[name] = tuple(f"{prefix}{part}.{param}" for part in FUSED.get(child, (child,)))
    return names


def tensors_of(cfg: ModelConfig, ranges: list[UnitRange]) -> list[str]:
    """The checkpoint tensors stages of ``ranges`` read, each once, in order."""
    return list(dict.fromkeys(n for units in ranges for u in units for n in checkpoint_tensors(cfg, u)))
