"""Rotary position embeddings, computed for explicit positions.

Matches Hugging Face's rotary embeddings: inverse frequencies and cos/sin in float32, cast to the
activation dtype, ``rotate_half`` (non-interleaved) layout. Besides plain RoPE: linear and Llama 3
scaling, LongRoPE (Phi-3: per-frequency factors, the long ones from ``original_max_position_embeddings``
on, and a factor on cos and sin) and partial rotation (only a head's leading dimensions turn).

LongRoPE picks short or long factors. hpipe picks them per position: a position from
``original_max_position_embeddings`` on turns by the long factors, the positions before it by the
short ones, whatever the sequence's length. So a position's keys never change, and a cached prefix,
a preempted and recomputed sequence and every slicing of a prompt give the same KV. transformers'
model does the same when fed token by token with its cache (tested), but its ``generate()`` turns a
whole call by the long factors once its longest position passes the boundary, and drops its cache
once at the crossing to recompute everything that way; llama.cpp chooses once, by the context size
it was started with. Past the boundary hpipe's tokens may therefore differ from both; below it
(4,096 positions for Phi-3-mini-128k) they are the same.
"""

from __future__ import annotations

import math

import torch

from hpipe.core.config import RopeConfig
from hpipe.core.errors import UnsupportedModelError


def inverse_frequencies(rope: RopeConfig, dim: int, max_position_embeddings: int,
                        factors: tuple[float, ...] = ()) -> torch.Tensor:
    """The inverse frequencies of the ``dim`` rotated dimensions of a head (``factors``: LongRoPE's)."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type == "longrope":
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta ** (
            torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
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


class Rotary:
    """One RoPE's factors for any positions: :meth:`cos_sin` gives what :func:`apply_rotary` takes."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_position_embeddings: int,
                 device: torch.device | str = "cpu"):
        self.dim = int(head_dim * rope.partial_rotary_factor)
        if self.dim % 2 or self.dim <= 0:
            raise UnsupportedModelError(f"a rotary embedding turns pairs of dimensions: {self.dim} of a head's "
                                        f"{head_dim} cannot be turned")
        self.scale = rope.attention_factor
        short = rope.short_factor if rope.type == "longrope" else ()
        self.inv_freq = inverse_frequencies(rope, self.dim, max_position_embeddings, short).to(device)
        self.long: torch.Tensor | None = None
        self.boundary = rope.original_max_position_embeddings or 0
        if rope.type == "longrope":
            self.long = inverse_frequencies(rope, self.dim, max_position_embeddings, rope.long_factor).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, and sin with its first half negated, of shape ``[tokens, 1, rotated dims]`` for integer
        ``positions [tokens]``: the two factors :func:`apply_rotary` takes for queries and keys
        ``[tokens, heads, head_dim]`` (the same for every head)."""
        pos = positions.to(torch.float32)[:, None]
        freqs = pos * self.inv_freq.to(positions.device)[None, :]
        if self.long is not None:
            far = (positions >= self.boundary)[:, None]
            freqs = torch.where(far, pos * self.long.to(positions.device)[None, :], freqs)
        emb = torch.cat((freqs, freqs), dim=-1)
        signed = torch.cat((-freqs, freqs), dim=-1)
        cos, sin = emb.cos(), signed.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x [..., head_dim]`` rotated (``cos``, ``signed_sin`` broadcast against it, one row per token):
    ``x * cos + rotate_half(x) * sin``, where
    ``rotate_half(x) = cat(-x2, x1)`` is ``x`` rolled by half a head times the sign in
    ``signed_sin``: three kernels instead of six (a decode step runs this once per layer). Where the
    factors cover fewer dimensions than a head (partial rotation), only those leading ones turn."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return torch.addcmul(x * cos, x.roll(rot // 2, dims=-1), signed_sin)
    part = x[..., :rot]
    return torch.cat((torch.addcmul(part * cos, part.roll(rot // 2, dims=-1), signed_sin), x[..., rot:]), dim=-1)
