"""Weights kept in GGUF's quantized block formats, and the layers that compute on them.

A :class:`QuantizedWeight` is a matrix ``[rows, in_features]`` as the file stores it: the bytes
of its blocks and, for a fused projection whose pieces the file stores in different types (a
Q4_K_M file keeps some value projections at Q6_K), one part per piece. :class:`QuantLinear` and
:class:`QuantEmbedding` compute from those bytes through the C++ kernels
(``kernels/quant.cpp``, decision: docs/decisions/quantized-kernels.md); nothing dequantizes a
whole matrix; a GPU stage keeps the blocks too and dequantizes one matrix at a time as it uses it,
a CPU stage in another dtype dequantizes its own weights once at load (:mod:`hpipe.model.dequant`).
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from hpipe.core.errors import ModelSourceError
from hpipe.model import cpu_kernel

#: ggml type id -> (name, values per block, bytes per block) of the types the kernels read (the
#: sizes are the gguf package's)
TYPES = {int(t): (t.name, *GGML_QUANT_SIZES[t]) for t in (GGMLQuantizationType[n] for n in (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"))}


def prefill_in_bfloat16() -> bool:
    """Whether prefill slices (entries of two tokens or more) of quantized weights multiply in
    bfloat16 with float32 sums (decode tokens and the head stay float32): the default where the
    CPU does so in hardware (AVX512-BF16 or AMX: MKL's GEMM on an Intel CPU, hpipe's own on
    another vendor's, where MKL's is no faster than float32);
    ``HPIPE_PREFILL_GEMM=float32`` or :func:`set_prefill_gemm` keeps float32
    (docs/decisions/quantized-kernels.md). False where the kernels are not built."""
    return cpu_kernel.available() and torch.ops.hpipe.prefill_gemm("") == "bfloat16"


#: what a process's prefill GEMM defaults to (``float32`` keeps it float32), and what a coordinator
#: asks its daemons to compute and to time prefill in ("": each daemon's default)
PREFILL_ENV = "HPIPE_PREFILL_GEMM"


def asked_prefill_gemm() -> str:
    """The prefill GEMM's precision this process's environment names ("": none, the default)."""
    return os.environ.get(PREFILL_ENV, "")


#: ``HPIPE_PREFILL_ATTENTION=sdpa`` keeps bfloat16 prefill attention on SDPA where hpipe's own
#: kernel would run (to compare the two)
ATTENTION_ENV = "HPIPE_PREFILL_ATTENTION"


def own_bf16_attention() -> bool:
    """Whether a bfloat16 prefill slice's attention (the caller knows the prefill is bfloat16:
    :func:`prefill_in_bfloat16`) runs hpipe's own kernel (``kernels/bf16_attention.cpp``) rather
    than SDPA: where hpipe's own bfloat16 GEMM runs (AVX512-BF16 without MKL's kernels in
    hardware: AMD's Zen 4, where SDPA's bfloat16 is no faster than its float32), unless
    ``HPIPE_PREFILL_ATTENTION=sdpa``."""
    return os.environ.get(ATTENTION_ENV, "").lower() != "sdpa" and _own_bf16_gemm()


@functools.cache
def _own_bf16_gemm() -> bool:
    """Whether the bfloat16 GEMM is hpipe's own (fixed for the process; the kernels loaded)."""
    return torch.ops.hpipe.bf16_gemm_kernel() == "hpipe"


#: the rows of the micro-batch being computed that belong to prefill slices (bool ``[tokens]``), set
#: by the stage around its blocks (:func:`prefill_rows`); None: every row is float32
_PREFILL_ROWS: ContextVar[torch.Tensor | None] = ContextVar("hpipe_prefill_rows", default=None)


@contextmanager
def prefill_rows(rows: torch.Tensor | None):
    """Within: the :class:`QuantLinear` s marked ``low_precision`` multiply these rows (bool
    ``[tokens]``) in bfloat16 while :func:`prefill_in_bfloat16`, the others in float32. A row's
    precision is its entry's, never its neighbours': a decode token beside a prefill slice, or a
    decode micro-batch of any size, stays float32, and a slice's rows sum the same whatever
    shares its micro-batch (tests/model/test_quant.py)."""
    token = _PREFILL_ROWS.set(rows)
    try:
        yield
    finally:
        _PREFILL_ROWS.reset(token)


def set_prefill_gemm(mode: str) -> str:
    """Set the prefill GEMM's precision in this process (``"float32"``, ``"bfloat16"``, or
    ``"default"``: bfloat16 where the CPU has it unless ``HPIPE_PREFILL_GEMM=float32``; a
    :class:`ModelSourceError` where bfloat16 is asked of a CPU without it); the one it had."""
    cpu_kernel.require("a bfloat16 prefill GEMM")
    before = torch.ops.hpipe.prefill_gemm("")
    try:
        torch.ops.hpipe.prefill_gemm(mode)
    except RuntimeError as e:
        raise ModelSourceError(str(e).splitlines()[0]) from None
    return before


@contextmanager
def prefill_gemm_as(mode: str):
    """Within: the prefill GEMM's precision ``mode`` (``"float32"``, ``"bfloat16"``, or ``""``: the
    process's default from its CPU and ``HPIPE_PREFILL_GEMM``, not what was set last), restored
    after; nothing to set where ``mode`` is ``""`` and the kernels are not loaded yet (they load
    with the default). A :class:`ModelSourceError` where bfloat16 is asked of a CPU without it."""
    if not (cpu_kernel.available() if mode else cpu_kernel.loaded()):
        yield
        return
    before = set_prefill_gemm(mode or "default")
    try:
        yield
    finally:
        torch.ops.hpipe.prefill_gemm(before)


def row_bytes(ggml_type: int, in_features: int) -> int:
    _, values, nbytes = TYPES[ggml_type]
    return in_features // values * nbytes


@dataclass
class QuantizedWeight:
    """``[rows, in_features]`` as stored: ``data`` (uint8, 1-D) holds the parts one after the other;
    ``parts`` (int64 ``[P, 4]``) each part's (ggml type, rows, bytes per row, byte offset)."""

    data: torch.Tensor
    parts: torch.Tensor
    in_features: int

    @classmethod
    def of(cls, ggml_type: int, rows: int, in_features: int, data: torch.Tensor) -> "QuantizedWeight":
        rb = row_bytes(ggml_type, in_features)
        if data.numel() != rows * rb:
            raise ModelSourceError(f"{rows} rows of {in_features} {TYPES[ggml_type][0]} values are {rows * rb} bytes, "
                                   f"not {data.numel()}")
        return cls(data.reshape(-1), torch.tensor([[ggml_type, rows, rb, 0]], dtype=torch.int64), in_features)

    @classmethod
    def stack(cls, pieces: list["QuantizedWeight"]) -> "QuantizedWeight":
        """The pieces stacked along the rows (a fused projection), one part per run of one type."""
        if len(pieces) == 1:
            return pieces[0]
        if len({p.in_features for p in pieces}) != 1:
            raise ModelSourceError("stacked weights differ in their input width")
        rows: list[list[int]] = []
        offset = 0
        for piece in pieces:
            for t, n, rb, _ in piece.parts.tolist():
                if rows and rows[-1][0] == t:
                    rows[-1][1] += n
                else:
                    rows.append([t, n, rb, offset])
                offset += n * rb
        return cls(torch.cat([p.data for p in pieces]), torch.tensor(rows, dtype=torch.int64), pieces[0].in_features)

    @property
    def rows(self) -> int:
        return int(self.parts[:, 1].sum())

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def type_names(self) -> list[str]:
        return [TYPES[int(t)][0] for t in self.parts[:, 0]]

    def take_rows(self, order: torch.Tensor) -> "QuantizedWeight":
        """The rows in ``order`` (a permutation of a one-part weight's rows)."""
        if len(self.parts) != 1:
            raise ValueError("only a one-part weight's rows can be reordered")
        rb = int(self.parts[0, 2])
        data = self.data.view(-1, rb)[order].reshape(-1)
        return QuantizedWeight(data, self.parts.clone(), self.in_features)

    def to(self, device: torch.device) -> "QuantizedWeight":
        """The same weight with its bytes on ``device`` (the part table stays on the CPU)."""
        return QuantizedWeight(self.data.to(device), self.parts, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The whole matrix as float32 ``[rows, in_features]`` (bit for bit ggml's dequantization)."""
        return torch.ops.hpipe.dequantize(self.data, self.parts, self.in_features)


#: where each block type keeps its 16-bit scales (byte offsets in a block): set to small values in
#: random blocks, whose other bytes are any bits
_SCALES = {8: (0,), 2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 12: (0, 2), 13: (0, 2), 14: (208,)}


def random_weight(ggml_type: int, rows: int, in_features: int, generator: torch.Generator) -> QuantizedWeight:
    """A ``[rows, in_features]`` matrix of random blocks of ``ggml_type`` (the profiler times such
    units): random quants, every scale 0.01."""
    if ggml_type in (0, 1, 30):  # float formats: random values, stored as the type stores them
        values = torch.randn(rows, in_features, generator=generator) * 0.02
        data = {0: values, 1: values.half(), 30: values.bfloat16()}[ggml_type].view(torch.uint8)
        return QuantizedWeight.of(ggml_type, rows, in_features, data.reshape(-1))
    _, per_block, nbytes = TYPES[ggml_type]
    blocks = torch.randint(0, 256, (rows, in_features // per_block, nbytes), generator=generator, dtype=torch.uint8)
    scale = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    for at in _SCALES[ggml_type]:
        blocks[:, :, at:at + 2] = scale
    return QuantizedWeight.of(ggml_type, rows, in_features, blocks.reshape(-1))


class QuantLinear(nn.Module):
    """``nn.Linear``'s forward, float32 on the CPU, over a :class:`QuantizedWeight`."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = weight.in_features, weight.rows
        self.quantized = weight
        # buffers, not parameters: not in a state dict, and the bytes move with the module
        self.register_buffer("blocks", weight.data, persistent=False)
        self.register_buffer("parts", weight.parts, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.float(), persistent=False)
        #: whether prefill rows (:func:`prefill_rows`) multiply in bfloat16: set on a stage's
        #: attention and MLP projections, never on the head (logits stay float32)
        self.low_precision = False
        #: the head's: its decode rows (those :func:`prefill_rows` leaves out) multiply as the
        #: projections' decode rows do (K-quants in integers), its prefill rows in float32
        self.head = False

    @property
    def weight_bytes(self) -> int:
        return self.blocks.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.bias is not None else _NONE
        rows = _PREFILL_ROWS.get()
        if self.head and rows is not None:
            return self._head(x, rows, bias)
        return torch.ops.hpipe.qlinear(x, self.blocks, self.parts, bias, rows if self.low_precision else None)

    def _head(self, x: torch.Tensor, prefill: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Logits: each row of ``x [rows, in]`` as a decode row unless ``prefill`` marks it."""
        def decode(part):
            return torch.ops.hpipe.qlinear(part, self.blocks, self.parts, bias,
                                           torch.zeros(part.shape[0], dtype=torch.bool))

        if not bool(prefill.any()):
            return decode(x)
        if bool(prefill.all()):
            return torch.ops.hpipe.qlinear(x, self.blocks, self.parts, bias, None)
        out = x.new_empty(x.shape[0], self.out_features)
        out[prefill] = torch.ops.hpipe.qlinear(x[prefill], self.blocks, self.parts, bias, None)
        out[~prefill] = decode(x[~prefill])
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"types={'+'.join(self.quantized.type_names)}, bias={self.bias is not None}")


class QuantEmbedding(nn.Module):
    """``nn.Embedding`` over a :class:`QuantizedWeight`: the rows looked up are dequantized."""

    def __init__(self, weight: QuantizedWeight):
        super().__init__()
        if len(weight.parts) != 1:
            raise ModelSourceError("an embedding table is stored in one type")
        self.num_embeddings, self.embedding_dim = weight.rows, weight.in_features
        self.quantized = weight
        self.register_buffer("blocks", weight.data, persistent=False)
        self.register_buffer("parts", weight.parts, persistent=False)

    @property
    def weight_bytes(self) -> int:
        return self.blocks.numel()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.hpipe.qembedding(ids, self.blocks, self.parts, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={self.quantized.type_names[0]}"


_NONE = torch.empty(0)
