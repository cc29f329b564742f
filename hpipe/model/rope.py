"""Rotary position embeddings, computed for explicit positions.

Matches Hugging Face's Llama rotary embedding: inverse frequencies and cos/sin in float32,
cast to the activation dtype, ``rotate_half`` (non-interleaved) layout.
"""

from __future__ import annotations

import math

import torch

from hpipe.core.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int, max_position_embeddings: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type == "llama3":
        old_len = rope.original_max_position_embeddings or max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, and sin with its first half negated, of shape ``[tokens, 1, head_dim]`` for integer
    ``positions [tokens]``: the two factors :func:`apply_rotary` takes for queries and keys
    ``[tokens, heads, head_dim]`` (the same for every head)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    signed = torch.cat((-freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], signed.sin().to(dtype)[:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x [..., head_dim]`` rotated (``cos``, ``signed_sin`` broadcast against it, one row per token):
    ``x * cos + rotate_half(x) * sin``, where
    ``rotate_half(x) = cat(-x2, x1)`` is ``x`` rolled by half a head times the sign in
    ``signed_sin``: three kernels instead of six (a decode step runs this once per layer)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
