"""The linear layers and embeddings over stored weights: :class:`QuantLinear` and
:class:`QuantEmbedding` compute from GGUF's blocks through the C++ kernels (``kernels/quant.cpp``;
decision: docs/decisions/quantized-kernels.md), nothing dequantizing a whole matrix;
:class:`DequantLinear` and :class:`DequantEmbedding` (a GPU stage's) keep the blocks on the device
and dequantize one matrix at a time as they use it (:mod:`hpipe.model.weights.dequant`)."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

from hpipe.core.errors import ModelSourceError
from hpipe.model.weights.blocks import QuantizedWeight
from hpipe.model.weights.dequant import dequantize, lookup

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

#: on a GPU, the fewest rows a product is computed with: a lone decode step's row and the rows of
#: a verification entry (up to 9) then run one GEMM shape, so a row's sums have the same order
#: whatever shares its pass (cuBLAS picks its kernel by shape: in float32, rows computed one and
#: five at a time differed from the first projection on, on an H200; benchmarks/row_invariance.py)
GPU_MIN_ROWS = 16


def rows_padded(product, x: torch.Tensor) -> torch.Tensor:
    """``product(x)`` over the last dimension, with fewer than :data:`GPU_MIN_ROWS` rows on a GPU
    padded with zero rows (dropped from the result)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not x.is_cuda or rows >= GPU_MIN_ROWS or rows == 0:
        return product(x)
    flat = x.reshape(rows, x.shape[-1])
    out = product(torch.cat((flat, flat.new_zeros(GPU_MIN_ROWS - rows, flat.shape[1]))))
    return out[:rows].reshape(*x.shape[:-1], out.shape[-1])


class Linear(nn.Linear):
    """``nn.Linear`` with its rows :func:`rows_padded` on a GPU (float checkpoints' layers)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rows_padded(super().forward, x)


class DequantLinear(nn.Module):
    """``nn.Linear``'s forward in ``dtype`` over a :class:`QuantizedWeight` that stays as stored
    on the module's device, dequantized at each call."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features, self.dtype = weight.in_features, weight.rows, dtype
        self.quantized, self._parts = weight, weight.parts.tolist()
        self.register_buffer("blocks", weight.data, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.to(dtype), persistent=False)

    @property
    def weight_bytes(self) -> int:
        return self.blocks.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = dequantize(self.blocks, self._parts, self.in_features, x.dtype)
        return rows_padded(lambda rows: F.linear(rows, weight, self.bias), x)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"types={'+'.join(self.quantized.type_names)}, dtype={self.dtype}, bias={self.bias is not None}")

class DequantEmbedding(nn.Module):
    """``nn.Embedding`` in ``dtype`` over a one-part :class:`QuantizedWeight`: a lookup
    dequantizes only the rows it reads."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype):
        super().__init__()
        if len(weight.parts) != 1:
            raise ValueError("an embedding table is stored in one type")
        self.num_embeddings, self.embedding_dim, self.dtype = weight.rows, weight.in_features, dtype
        self.quantized, self._part = weight, weight.parts[0].tolist()
        self.register_buffer("blocks", weight.data, persistent=False)

    @property
    def weight_bytes(self) -> int:
        return self.blocks.numel()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return lookup(self.blocks, self._part, self.embedding_dim, self.dtype, ids)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={self.quantized.type_names[0]}, dtype={self.dtype}"
