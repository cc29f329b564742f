"""GGUF blocks dequantized by torch operations on whatever device holds them, at each use.

A GPU stage keeps its weights as the file stores them, on the card, and turns one matrix at a
time into its compute dtype when a forward needs it: :class:`DequantLinear` and
:class:`DequantEmbedding`. Resident weight bytes are the file's; the price is the dequantization
each call, a pass over bytes the GPU's memory streams far faster than a CPU's (it works on any
card, Pascal's P100 included). A CPU stage in bfloat16 calls :func:`dequantize` once at load
instead (float32 CPU stages compute on the blocks through the C++ kernels, :mod:`hpipe.model.weights.blocks`).
The arithmetic is ggml's, in the order of the ``gguf`` package's numpy dequantizers, so the
values equal theirs bit for bit (tested per type) and, in the compute dtype, equal a checkpoint
dequantized once (``--dequantize``) and cast.
"""

from __future__ import annotations

import torch

from hpipe.model.weights.blocks import TYPES

#: values dequantized per chunk: bounds the float32 temporaries of a large matrix (64 MiB each)
CHUNK_VALUES = 1 << 24


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes per row ``[n, 2]`` as the float16 they store, in float32 ``[n, 1]``."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[n, 16]`` bytes to ``[n, 32]``: the 16 low nibbles, then the 16 high ones."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _bits(b: torch.Tensor, n: int) -> torch.Tensor:
    """Bit j of the little-endian bytes ``[rows, n // 8]``, for j < n, as ``[rows, n]`` of 0/1."""
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)
    return ((b[:, :, None] >> shifts) & 1).reshape(b.shape[0], n)


def _shifts(start: int, end: int, step: int, device: torch.device) -> torch.Tensor:
    """Bit shifts ``[1, 1, s, 1]``, made by a kernel on the device (a tensor copied from a list
    could not be made while a CUDA graph is captured)."""
    return torch.arange(start, end, step, dtype=torch.uint8, device=device).reshape(1, 1, -1, 1)


def _scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's eight 6-bit scales and mins, packed in 12 bytes ``[n, 12]``."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc.float(), mn.float()


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * (_nibbles(b[:, 2:]).to(torch.int8) - 8).float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * _nibbles(b[:, 4:]).float() + _f16(b[:, 2:4])


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 6:]) | (_bits(b[:, 2:6], 32) << 4)
    return _f16(b[:, :2]) * (q.to(torch.int8) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:]) | (_bits(b[:, 4:8], 32) << 4)
    return _f16(b[:, :2]) * q.float() + _f16(b[:, 2:4])


def _q45_k(b: torch.Tensor, five: bool) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _scale_min(b[:, 4:16])
    d = (_f16(b[:, :2]) * sc).reshape(n, 8, 1)
    dm = (_f16(b[:, 2:4]) * mn).reshape(n, 8, 1)
    qs = b[:, 48:] if five else b[:, 16:]
    q = ((qs.reshape(n, 4, 1, 32) >> _shifts(0, 8, 4, b.device)) & 0x0F).reshape(n, 8, 32)
    if five:
        q = q | (((b[:, 16:48].reshape(n, 1, 1, 32) >> _shifts(0, 8, 1, b.device)) & 1).reshape(n, 8, 32) << 4)
    return (d * q.float() - dm).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b[:, 208:210]) * scales).reshape(n, 16, 1)
    ql = ((b[:, :128].reshape(n, 2, 1, 64) >> _shifts(0, 8, 4, b.device)) & 0x0F).reshape(n, 8, 32)
    qh = ((b[:, 128:192].reshape(n, 2, 1, 32) >> _shifts(0, 8, 2, b.device)) & 0x03).reshape(n, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (d * q).reshape(n, 256)


_BLOCKS = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
    "Q4_K": lambda b: _q45_k(b, five=False), "Q5_K": lambda b: _q45_k(b, five=True), "Q6_K": _q6_k,
}
_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _values(ggml_type: int, data: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """``rows`` rows of ``k`` values stored as ``data`` (uint8) in one type, as float32 ``[rows, k]``."""
    name, per_block, nbytes = TYPES[ggml_type]
    if name in _FLOATS:
        return data.view(_FLOATS[name]).float().view(rows, k)
    return _BLOCKS[name](data.view(-1, nbytes)).view(rows, k)


def dequantize(data: torch.Tensor, parts: list[list[int]], k: int, dtype: torch.dtype) -> torch.Tensor:
    """The matrix stored as ``data`` (uint8) in ``parts`` (:class:`QuantizedWeight`'s, as lists) as
    ``[rows, k]`` of ``dtype`` on the data's device, a chunk of rows at a time."""
    out = torch.empty(sum(p[1] for p in parts), k, dtype=dtype, device=data.device)
    at, step = 0, max(1, CHUNK_VALUES // k)
    for t, n, rb, offset in parts:
        for r in range(0, n, step):
            m = min(step, n - r)
            out[at + r:at + r + m] = _values(t, data[offset + r * rb:offset + (r + m) * rb], m, k)
        at += n
    return out


def lookup(data: torch.Tensor, part: list[int], k: int, dtype: torch.dtype, ids: torch.Tensor) -> torch.Tensor:
    """The rows ``ids`` of a one-part matrix, ``[*ids.shape, k]`` of ``dtype``."""
    t, _, rb, _ = part
    picked = data.view(-1, rb).index_select(0, ids.reshape(-1))
    return _values(t, picked, picked.shape[0], k).to(dtype).view(*ids.shape, k)


