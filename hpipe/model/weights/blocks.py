"""Weights kept in GGUF's quantized block formats, and the layers that compute on them.

A :class:`QuantizedWeight` is a matrix ``[rows, in_features]`` as the file stores it: the bytes
of its blocks and, for a fused projection whose pieces the file stores in different types (a
Q4_K_M file keeps some value projections at Q6_K), one part per piece. :class:`QuantLinear` and
:class:`QuantEmbedding` compute from those bytes through the C++ kernels
(``kernels/quant.cpp``, decision: docs/decisions/quantized-kernels.md); nothing dequantizes a
whole matrix; a GPU stage keeps the blocks too and dequantizes one matrix at a time as it uses it,
a CPU stage in another dtype dequantizes its own weights once at load (:mod:`hpipe.model.weights.dequant`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from hpipe.core.errors import ModelSourceError

#: ggml type id -> (name, values per block, bytes per block) of the types the kernels read (the
#: sizes are the gguf package's)
TYPES = {int(t): (t.name, *GGML_QUANT_SIZES[t]) for t in (GGMLQuantizationType[n] for n in (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"))}


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


