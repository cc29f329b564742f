"""The precision of prefill slices' products in this process: bfloat16 with float32 sums where
the CPU does it in hardware (AVX512-BF16 or AMX), else float32 (docs/decisions/quantized-kernels.md);
decode rows and the head keep theirs (float32, or the integer rows of K-quants)."""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager

import torch

from hpipe.core.errors import ModelSourceError
from hpipe.model.kernels import library


def prefill_in_bfloat16() -> bool:
    """Whether prefill slices (entries of two tokens or more) of quantized weights multiply in
    bfloat16 with float32 sums (decode tokens and the head stay float32): the default where the
    CPU does so in hardware (AVX512-BF16 or AMX: MKL's GEMM on an Intel CPU, hpipe's own on
    another vendor's, where MKL's is no faster than float32);
    ``HPIPE_PREFILL_GEMM=float32`` or :func:`set_prefill_gemm` keeps float32
    (docs/decisions/quantized-kernels.md). False where the kernels are not built."""
    return library.available() and torch.ops.hpipe.prefill_gemm("") == "bfloat16"

#: what a process's prefill GEMM defaults to (``float32`` keeps it float32), and what a coordinator
#: asks its daemons to compute and to time prefill in ("": each daemon's default)
PREFILL_ENV = "HPIPE_PREFILL_GEMM"

def asked_prefill_gemm() -> str:
    """The prefill GEMM's precision this process's environment names ("": none, the default)."""
    return os.environ.get(PREFILL_ENV, "")

#: ``HPIPE_PREFILL_ATTENTION=sdpa`` keeps prefill attention on SDPA where one of hpipe's own
#: kernels would run (to compare the two)
ATTENTION_ENV = "HPIPE_PREFILL_ATTENTION"

def own_bf16_attention() -> bool:
    """Whether a bfloat16 prefill slice's attention (the caller knows the prefill is bfloat16:
    :func:`prefill_in_bfloat16`) runs hpipe's own kernel (``kernels/bf16_attention.cpp``) rather
    than SDPA: where hpipe's own bfloat16 GEMM runs (AVX512-BF16 without MKL's kernels in
    hardware: AMD's Zen 4, where SDPA's bfloat16 is no faster than its float32), unless
    ``HPIPE_PREFILL_ATTENTION=sdpa``."""
    return os.environ.get(ATTENTION_ENV, "").lower() != "sdpa" and _own_bf16_gemm()

def own_f32_attention() -> bool:
    """Whether a float32 prefill slice's attention runs hpipe's own kernel
    (``kernels/f32_attention.cpp``) rather than SDPA: on a CPU whose widest vectors are AVX2's (or
    one capped so, ``HPIPE_CPU_ISA=avx2``), where SDPA's float32 kernel ran at half the rate of the
    projections and pads a later slice's keys to whole splits; unless
    ``HPIPE_PREFILL_ATTENTION=sdpa``. False where the kernels are not built."""
    return os.environ.get(ATTENTION_ENV, "").lower() != "sdpa" and library.available() and _f32_attention_fits()

@functools.cache
def _f32_attention_fits() -> bool:
    """Whether this CPU's widest vectors are AVX2's (fixed for the process; the kernels loaded)."""
    return bool(torch.ops.hpipe.f32_attention_fits())

@functools.cache
def _own_bf16_gemm() -> bool:
    """Whether the bfloat16 GEMM is hpipe's own (fixed for the process; the kernels loaded)."""
    return torch.ops.hpipe.bf16_gemm_kernel() == "hpipe"

def set_prefill_gemm(mode: str) -> str:
    """Set the prefill GEMM's precision in this process (``"float32"``, ``"bfloat16"``, or
    ``"default"``: bfloat16 where the CPU has it unless ``HPIPE_PREFILL_GEMM=float32``; a
    :class:`ModelSourceError` where bfloat16 is asked of a CPU without it); the one it had."""
    library.require("a bfloat16 prefill GEMM")
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
    if not (library.available() if mode else library.loaded()):
        yield
        return
    before = set_prefill_gemm(mode or "default")
    try:
        yield
    finally:
        torch.ops.hpipe.prefill_gemm(before)
