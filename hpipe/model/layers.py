"""The four unit kinds as plain ``nn.Module``s, and the checkpoint names of every parameter.

Each unit maps the residual stream to the residual stream (embed maps token ids to it, head maps
it to logits). Layer indices stay global, so a stage holding layers 12..17 reads
``model.layers.12.*`` from the checkpoint like the full model does.

The query, key and value projections are one matrix (``qkv_proj``), and so are the MLP's gate
and up projections (``gate_up_proj``): the checkpoint's matrices stacked at load. A decode step
multiplies each weight by a handful of rows, where a call's fixed cost is a fair share of its
time, so three calls made one are fewer passes and fewer launches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from hpipe.core.config import ModelConfig
from hpipe.core.units import ATTN, EMBED, HEAD, MLP, unit_kind
from hpipe.model.kvpool import BatchKV
from hpipe.model.rope import apply_rotary


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


class Embed(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)


class Attention(nn.Module):
    """``x + o_proj(attention(input_layernorm(x)))`` over the cached prefix plus this slice."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window = cfg.sliding_windows[layer]
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim,
                                  bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.scale = cfg.head_dim ** -0.5

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and keys ``[tokens, heads + kv_heads, head_dim]``, rotated, and values
        ``[tokens, kv_heads, head_dim]`` of the tokens of ``x`` (``cos``, ``sin``: ``[tokens, 1, head_dim]``).
        Token-major, so that a token's heads are one row: no transposes on the way."""
        qkv = self.qkv_proj(self.input_layernorm(x)).view(-1, self.heads + 2 * self.kv_heads, self.head_dim)
        return apply_rotary(qkv[:, :self.heads + self.kv_heads], cos, sin), qkv[:, self.heads + self.kv_heads:]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: BatchKV) -> torch.Tensor:
        """The micro-batch ``x [1, tokens, hidden]``: every entry's tokens attend to its own sequence's
        cached prefix and to themselves; projections run once over all tokens."""
        t, heads = x.shape[1], self.heads
        qk, v = self._project(x, cos, sin)
        k = qk[:, heads:]
        batch.write(self.layer, k, v)
        o = x.new_empty(t, heads, self.head_dim)
        on_cpu = not x.is_cuda
        for i, e in enumerate(batch.entries):
            a = batch.offsets[i]
            keys, values = batch.read(self.layer, i, k, v)
            if e.length == 1 and on_cpu and (self.window is None or e.kv is None):
                self._attend_one(qk[a, :heads], keys, values, o[a])
            else:
                q = qk[a:a + e.length, :heads].transpose(0, 1)[None]
                out = self._attend(q, keys[None], values[None], e.start if e.kv is not None else 0)
                o[a:a + e.length] = out[0].transpose(0, 1)
        return x + self.o_proj(o.view(1, t, heads * self.head_dim))

    def forward_decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor,
                       v_pool: torch.Tensor, write: torch.Tensor, gather: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
        """One token for each of ``rows`` sequences, ``x [rows, 1, hidden]``, with shapes that never
        change (what a CUDA graph needs, :mod:`hpipe.model.graphs`): row r writes its key at pool slot
        ``write[r]`` and attends over the slots ``gather[r]`` where ``mask[r]`` holds."""
        rows, context = gather.shape
        qk, v = self._project(x, cos, sin)  # [rows, heads (+ kv_heads), head_dim]
        k_pool.index_copy_(1, write, qk[:, self.heads:].transpose(0, 1))
        v_pool.index_copy_(1, write, v.transpose(0, 1))
        keys = k_pool.index_select(1, gather.reshape(-1)).view(self.kv_heads, rows, context, self.head_dim)
        values = v_pool.index_select(1, gather.reshape(-1)).view(self.kv_heads, rows, context, self.head_dim)
        out = F.scaled_dot_product_attention(qk[:, :self.heads, None], keys.transpose(0, 1), values.transpose(0, 1),
                                             attn_mask=mask.view(rows, 1, 1, context),
                                             enable_gqa=self.kv_heads != self.heads)
        return x + self.o_proj(out.reshape(rows, 1, self.heads * self.head_dim))

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

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
        """``q [1, heads, s, head_dim]`` at positions ``start ..`` over ``keys [1, kv_heads, start + s, head_dim]``."""
        s = q.shape[2]
        # A lower-right causal mask: query i (position start+i) sees keys 0..start+i. Relying on
        # is_causal would align the triangle top-left and drop the cached prefix.
        mask, causal = None, False
        if start == 0 and self.window is None:
            causal = s > 1  # no prefix: lower-right == top-left, and the kernel can skip the upper triangle
        elif s > 1 and self.window is None and q.is_cuda:
            # lets SDPA pick a fused kernel (flash / memory-efficient); a boolean mask would force a
            # slower one: 16 slices of a 6 x 2048 prefill took 1.62x one slice with it on an H100
            mask = causal_lower_right(s, start + s)
        elif s == 1 and self.window is not None:
            first = max(0, start + 1 - self.window)  # one query: its window is a slice, no mask
            keys, values = keys[:, :, first:], values[:, :, first:]
        elif s > 1 or self.window is not None:
            # explicit boolean mask: on the CPU as fast as the bias or faster (measured), and the
            # only form that also expresses a sliding window
            q_pos = torch.arange(start, start + s, device=q.device)[:, None]
            k_pos = torch.arange(start + s, device=q.device)[None, :]
            mask = k_pos <= q_pos
            if self.window is not None:
                mask = mask & (k_pos > q_pos - self.window)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal,
                                              enable_gqa=self.kv_heads != self.heads)


class FeedForward(nn.Module):
    """``x + down_proj(silu(gate_proj(n)) * up_proj(n))`` with ``n = post_attention_layernorm(x)``."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class Head(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

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
    prefix = f"model.layers.{layer}." + ("self_attn." if kind == ATTN else "mlp.")
    names = {}
    for name, _ in module.named_parameters():
        if name.endswith("layernorm.weight"):
            names[name] = (f"model.layers.{layer}.{name}",)
            continue
        linear, param = name.split(".")
        names[name] = tuple(f"{prefix}{part}.{param}" for part in FUSED.get(linear, (linear,)))
    return names
