"""One sequence's KV cache on a stage, for single-process use: a pool of its own.

A ``StageCache`` holds ``batch`` rows of equal length (the rows of one prompt batch, or of one
micro-batch of a GPipe-style schedule), each a sequence in a :class:`KVPool` just large enough
for ``max_len`` positions, so that every row's blocks are consecutive. The daemons use one pool
per stage shared by all sequences instead; both go through the same attention code.
"""

from __future__ import annotations

import math

import torch

from hpipe.core.errors import InputError
from hpipe.model.kv.pool import BLOCK_SIZE, Entry, KVPool, SeqKV, prefill_end


class StageCache:
    """``length`` is the number of positions already computed; a slice must start exactly there,
    which is what makes sliced prefill equal one-shot prefill."""

    def __init__(self, pool: KVPool | None, batch: int, max_len: int):
        self.pool, self.batch, self.max_len = pool, batch, max_len
        self.rows: list[SeqKV] = [pool.sequence(max_len) for _ in range(batch)] if pool else []
        self.length = 0

    @classmethod
    def allocate(cls, layers: list[int], batch: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> "StageCache":
        if batch < 1 or max_len < 1:
            raise InputError(f"a sequence needs batch >= 1 and max_len >= 1 (got {batch}, {max_len})")
        blocks = batch * math.ceil(max_len / BLOCK_SIZE)
        pool = KVPool(layers, blocks, kv_heads, head_dim, dtype, device) if layers else None
        return cls(pool, batch, max_len)

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

    def rewind(self, length: int) -> None:
        """Keep positions ``[0, length)`` only (a speculative decode's guesses that were not kept):
        the next slice starts there, and the blocks past it go back to the pool."""
        if not 0 <= length <= self.length:
            raise InputError(f"cannot rewind a sequence of {self.length} positions to {length}")
        for row in self.rows:
            row.truncate(length)
        self.length = length

    def entries(self, start: int, tokens: int, logits: str, prefill: bool | None = None) -> list[Entry]:
        """The rows' entries for positions ``[start, start + tokens)`` (their blocks taken).
        ``prefill``: True, the positions are the prompt's (prefill rows, whatever their number);
        False, decode tokens; None, :class:`Entry`'s rule by length."""
        for row in self.rows:
            row.grow(start + tokens)
        end = prefill_end(start, tokens, prefill)
        return [Entry(start, tokens, row if self.pool else None, logits, end) for row in self.rows] if self.rows else \
            [Entry(start, tokens, None, logits, end) for _ in range(self.batch)]

    @property
    def layers(self) -> list[int]:
        return self.pool.layers if self.pool else []

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes if self.pool else 0
