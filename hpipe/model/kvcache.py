"""Per-sequence KV cache of one stage, preallocated to the length declared at open time."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hpipe.core.errors import InputError


@dataclass
class LayerCache:
    k: torch.Tensor  # [batch, kv_heads, max_len, head_dim]
    v: torch.Tensor

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k, v`` at ``[start, start+s)`` and return the keys and values of ``[0, start+s)``."""
        end = start + k.shape[2]
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


@dataclass
class StageCache:
    """The caches of one stage's attention layers for one sequence (a batch of equal-length rows).

    ``length`` is the number of positions already computed; a slice must start exactly there,
    which is what makes sliced prefill equal one-shot prefill.
    """

    batch: int
    max_len: int
    layers: dict[int, LayerCache] = field(default_factory=dict)
    length: int = 0

    @classmethod
    def allocate(
        cls,
        layers: list[int],
        batch: int,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> "StageCache":
        if batch < 1 or max_len < 1:
            raise InputError(f"a sequence needs batch >= 1 and max_len >= 1 (got {batch}, {max_len})")
        shape = (batch, kv_heads, max_len, head_dim)
        caches = {
            i: LayerCache(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for i in layers
        }
        return cls(batch=batch, max_len=max_len, layers=caches)

    def check_slice(self, start: int, tokens: int, batch: int) -> None:
        if batch != self.batch:
            raise InputError(f"slice has batch {batch}, the sequence was opened with batch {self.batch}")
        if start != self.length:
            raise InputError(f"slice starts at position {start}, the sequence has {self.length} positions")
        if tokens < 1:
            raise InputError("a slice needs at least one token")
        if start + tokens > self.max_len:
            raise InputError(
                f"positions up to {start + tokens} exceed the sequence's declared max length {self.max_len}"
            )

    @property
    def nbytes(self) -> int:
        return sum(c.k.nbytes + c.v.nbytes for c in self.layers.values())

    @staticmethod
    def bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, batch: int = 1) -> int:
        return 2 * layers * kv_heads * head_dim * batch * torch.empty((), dtype=dtype).element_size()
