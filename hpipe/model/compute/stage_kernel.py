"""A stage's float32 decode micro-batch on the CPU in one C++ call (``kernels/decode.cpp``).

Design note. A decode step reads every weight once for a handful of rows, so its floor is the
time to stream the weights from memory. The eager path (:meth:`StageModel.forward_batch`) makes
about twenty-five PyTorch calls per layer from Python; on a 2-core Xeon, SmolLM2's step took
38-43 ms against 23 ms to stream its weights, and the calls other than the projections took
11-13 ms of it. The kernel runs the same projections (MKL-packed where the stage packs) and the
same per-row attention products from C++, with norms, the rotary embedding and the KV writes as
plain loops.

It is built ahead of use where it can be: ``python -m hpipe.model.kernels`` (run by
``scripts/setup.sh``) builds it into the cache (``$HPIPE_CACHE_DIR/kernels``, one directory per
source, PyTorch and Python version); a plain ``pip install`` leaves that to the first stage that
asks (:func:`available` builds it then, about a minute, logged), so a daemon's first load waits
for it, never its first decode. Where it cannot be built (no compiler), float32 stages run the
eager path, which gives the same results up to float rounding (tests/model/test_cpu_kernel.py),
with an error logged; quantized stages refuse to load (:func:`require`) rather than crawl. With
``HPIPE_CPU_KERNEL=off`` stages do not use it.

It takes micro-batches whose rows are all live decode tokens: one an entry, or several (a
speculative decode's verification rows, each at its own position of the sequence, every row's KV
written before any row reads, each row reading its positions up to its own); each row reads its
sequence's keys and values as runs of consecutive pool slots (one run as a rule: the allocator
keeps a sequence consecutive; two when it began with a cached prefix, more in a pool under
pressure). Other micro-batches, and every prefill, run the eager path.
"""

from __future__ import annotations

import torch
from torch import nn

from hpipe.core.config import ModelConfig, RopeConfig
from hpipe.model.compute import packed
from hpipe.model.compute.layers import Attention, FeedForward
from hpipe.model.compute.linear import QuantLinear
from hpipe.model.kernels import library
from hpipe.model.kv.pool import Entry, KVPool


def fits(entries: list[Entry], pool: KVPool | None) -> bool:
    """Whether the kernel takes this micro-batch: every row a live decode token (a prompt's token,
    :attr:`Entry.prefill`, is computed as a prefill slice's). An entry may hold several: a
    speculative decode's verification rows, each its own position of the sequence, each computed
    as it would be alone."""
    return pool is not None and bool(entries) and all(e.length >= 1 and not e.prefill and e.kv is not None
                                                      for e in entries)


class StageKernel:
    """The attention and MLP units of a stage (``blocks``, in order), their weights listed once in
    the order the kernel reads them (the KV pool's tensors are passed per call: a stage's single-
    process caches each have a pool of their own, which this must not keep alive)."""

    def __init__(self, blocks: list[nn.Module], cfg: ModelConfig):
        self.cfg, self.kinds, self.windows, self.layers = cfg, [], [], []
        self.ropes: list[RopeConfig] = []  # the RoPEs the units turn by, in the order cos stacks them
        self.rope_of_unit: list[int] = []  # each attention unit's, an index into ropes
        self._params: list[torch.Tensor] = []  # each unit's tensors in turn, in the kernel's order
        for block in blocks:
            if isinstance(block, Attention):
                self.kinds.append(0)
                self.windows.append(block.window or 0)
                self.layers.append(block.layer)
                if block.rope not in self.ropes:
                    self.ropes.append(block.rope)
                self.rope_of_unit.append(self.ropes.index(block.rope))
                self._params += [block.norm.weight, *_linear(block.qkv_proj), *_linear(block.o_proj),
                                 _weight(block.q_norm), _weight(block.k_norm), _weight(block.post_norm)]
            elif isinstance(block, FeedForward):
                self.kinds.append(1)
                self._params += [block.norm.weight, *_linear(block.gate_up_proj), *_linear(block.down_proj),
                                 _weight(block.post_norm)]
            else:
                raise TypeError(f"the decode kernel runs attention and MLP units, not {type(block).__name__}")

    def __call__(self, x: torch.Tensor, tables: dict, entries: list[Entry], pool: KVPool) -> torch.Tensor:
        """The residual stream ``x [rows, hidden]`` (float32, one row per position of the entries) through the units,
        turned by ``tables`` (:meth:`StageModel.rotations`); each row's key and value are written
        into its sequence's slot of ``pool``."""
        if self.ropes:
            cos = torch.stack([tables[r][0][:, 0] for r in self.ropes])
            ssin = torch.stack([tables[r][1][:, 0] for r in self.ropes])
        else:
            cos = ssin = x.new_empty(0, x.shape[0], self.cfg.head_dim)
        cfg, positions, writes, runs = self.cfg, [], [], []
        for e in entries:
            for position in range(e.start, e.start + e.length):
                row = e.kv.runs(position + 1)
                positions.append(position)
                writes.append(row[-1][0] + row[-1][1] - 1)  # the slot of its own position, the last one
                runs.append(len(row))
                for slot, count in row:
                    runs += (slot, count)
        return torch.ops.hpipe.decode_units(
            x.contiguous(), cos, ssin, positions, writes, runs,
            self.kinds, self._params, [pool.k[i] for i in self.layers], [pool.v[i] for i in self.layers],
            self.windows, self.rope_of_unit, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
            cfg.attention_scale, cfg.hidden_act != "silu", library.vector_attention_on())

_NONE = torch.empty(0)

def _weight(norm: nn.Module | None) -> torch.Tensor:
    """A norm's weight, or an empty tensor for a norm the family lacks."""
    return _NONE if norm is None else norm.weight

def _linear(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight or quantized blocks; its packed shape stand-in, its blocks' parts or an empty tensor;
    bias or an empty tensor)."""
    bias = linear.bias if linear.bias is not None else _NONE
    if isinstance(linear, QuantLinear):
        return linear.blocks, linear.parts, bias
    if isinstance(linear, packed.PackedLinear):
        return linear.packed, linear.shape, bias
    return linear.weight, _NONE, bias
