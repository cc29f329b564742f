"""Linear layers with MKL-packed weights, for float32 stages on the CPU.

Design note. A pipeline slices the prompt, so a stage multiplies its weights by a few dozen to a
few hundred rows at a time. A plain ``F.linear`` re-packs the weight matrix into MKL's blocked
layout on every call, and with so few rows that packing is a large share of the call: at 128 rows,
SmolLM2's 576 x 1536 projection (weights streamed from memory, one thread) took 15.4 us per row
against 12.0 at 512 rows. Packing once at load time (``cblas_sgemm_pack``, exposed by PyTorch as
``torch.ops.mkl``) brings 128 rows to 13.0 us, and a ten-block stage prefilling 2048 tokens in
128-token slices to 1.02x its unsliced time, from 1.09x (``python benchmarks/packed_linear.py``).
The packed copy replaces the weight, so on that Xeon the memory was the same. The result equals
``F.linear``'s up to float rounding (a different summation order).

Packing pays on Intel CPUs only. On an AMD EPYC (family 26, AVX-512) the same benchmark measured
packed at 0.97-1.01x plain time at every row count and slicing, and MKL's packed copies of
SmolLM2's projections took 1.2-3.5x the plain weights' memory (the whole model: 834 MB resident
for 538 MB of weights, against 545 MB unpacked). So stages pack only where the CPU is Intel's.
"""

from __future__ import annotations

import torch
from torch import nn

from hpipe.core import cpuinfo


def available() -> bool:
    """Whether this PyTorch build has MKL's packed GEMM (x86 CPU builds do)."""
    return (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
            and hasattr(torch.ops.mkl, "_mkl_linear"))


def pays() -> bool:
    """Whether float32 CPU stages pack their projections here: MKL's packed GEMM on an Intel CPU."""
    return available() and cpuinfo.vendor() == "GenuineIntel"


def possible(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a stage on ``device`` in ``dtype`` can pack at all: float32 on the CPU, with MKL."""
    return device.type == "cpu" and dtype == torch.float32 and available()


def applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether such a stage packs by default: where it can and where that pays."""
    return possible(device, dtype) and pays()


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward over a weight packed once for MKL; the plain weight is dropped."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # the packed layout of B does not depend on the row count it is given here (checked by
        # tests/test_packed.py at several row counts)
        self.register_buffer("packed", torch.ops.mkl._mkl_reorder_linear_weight(w.contiguous(), 128),
                             persistent=False)
        # _mkl_linear reads only the shape of the original weight: a zero-byte stand-in (the C++
        # kernel passes it on too)
        self.shape = torch.empty((), dtype=w.dtype).expand(self.out_features, self.in_features)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    @property
    def weight_numel(self) -> int:
        return self.in_features * self.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        return torch.ops.mkl._mkl_linear(x.contiguous(), self.packed, self.shape, self.bias, rows)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


def pack_linears(module: nn.Module, names: tuple[str, ...]) -> None:
    """Replace the ``nn.Linear`` children of ``module`` named in ``names`` by packed ones."""
    for name in names:
        child = getattr(module, name, None)
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child))
