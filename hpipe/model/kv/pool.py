"""A stage's KV cache: a pool of fixed-size blocks, and a block table per sequence.

Design note. For each attention layer of a stage, keys and values live in one tensor each of
shape ``[kv_heads, (num_blocks + 1) * block_size, head_dim]``: block ``b`` holds the token slots
``[b * block_size, (b + 1) * block_size)`` (the last block is no sequence's: padded rows of a
static decode step write there, and its masked positions read it, so it starts as zeros:
:meth:`KVPool.trash_slot`), and position ``p`` of a sequence lives in slot
``table[p // block_size] * block_size + p % block_size``. A sequence grows block by block as its
positions are planned, and gives its blocks back when it closes.

Reading a sequence's keys is the hot path of attention. When its blocks are consecutive, its keys
are a view of the pool, with no copy, exactly like a cache preallocated for that one sequence; when
they are scattered, they are gathered for every attention call (a copy of the whole prefix). So
the allocator keeps sequences consecutive where it can: a new sequence starts at the beginning of
a free run long enough for its declared maximum length (soft-reserved for it: others start
elsewhere while any other space is free), and grows into the next block. Only a pool under
pressure scatters a sequence.

The pool's memory is allocated once (``torch.empty``: on the CPU, pages are committed as they are
first written). Allocation and release are thread-safe, and only the daemon's worker thread
writes keys. A sequence released while a micro-batch that names it is being computed keeps its
block list, so that computation still finds its slots: it may write into blocks already handed to
a newer sequence, but that sequence's own micro-batches come later on the same worker and write
every position before any attention reads it.

Shared blocks. A block may belong to several sequences at once, and to the prefix cache
(:mod:`runtime.daemon.prefix_store`): a sequence that begins with a cached prefix starts with
those blocks (:meth:`SeqKV.share`), never writes them, and grows into blocks of its own. Each
block counts its holders and is free when none is left. Such a sequence's positions lie in two
runs of slots or more; attention reads them as runs (:meth:`SeqKV.runs`), or gathers them.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np
import torch

from hpipe.core.errors import HpipeError

BLOCK_SIZE = 16


class PoolExhausted(HpipeError):
    """No free block is left for a sequence that needs one."""


class KVPool:
    """The K/V blocks of one stage's attention ``layers``."""

    def __init__(self, layers: list[int], num_blocks: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, block_size: int = BLOCK_SIZE):
        if num_blocks < 1 or block_size < 1:
            raise HpipeError(f"a KV pool needs at least one block of at least one token (got {num_blocks} x {block_size})")
        self.layers, self.num_blocks, self.block_size = list(layers), num_blocks, block_size
        self.kv_heads, self.head_dim, self.dtype = kv_heads, head_dim, dtype
        slots = (num_blocks + 1) * block_size  # and one block more, never handed out: trash_slot's
        self.k = {i: torch.empty(kv_heads, slots, head_dim, dtype=dtype, device=device) for i in self.layers}
        self.v = {i: torch.empty(kv_heads, slots, head_dim, dtype=dtype, device=device) for i in self.layers}
        for t in (*self.k.values(), *self.v.values()):  # masked rows of a static step read it: never NaN
            t[:, num_blocks * block_size:].zero_()
        self._refs = np.zeros(num_blocks, dtype=np.int32)  # holders of each block: 0 when free
        self._reserved = np.zeros(num_blocks, dtype=bool)
        self._lock = threading.Lock()

    @staticmethod
    def block_bytes(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int = BLOCK_SIZE) -> int:
        """Bytes one block takes across ``layers`` attention layers (keys and values)."""
        return 2 * layers * kv_heads * head_dim * block_size * dtype.itemsize

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k.values()) + sum(t.nbytes for t in self.v.values())

    @property
    def _used(self) -> np.ndarray:
        return self._refs > 0

    @property
    def used_blocks(self) -> int:
        return int(np.count_nonzero(self._refs))

    def trash_slot(self) -> int:
        """A slot of the block past the pool's ``num_blocks``, which no sequence gets: where padded
        rows of a static (CUDA-graph) step write. It is none of the ``num_blocks`` a coordinator
        counts on (taken from them, a GPU daemon refused sequences its coordinator made room for)."""
        return self.num_blocks * self.block_size

    def sequence(self, max_len: int) -> "SeqKV":
        """A new, empty sequence of at most ``max_len`` positions (no block taken yet)."""
        return SeqKV(self, max_len)

    # --- allocation (any thread) ---------------------------------------------------------------
    def take(self, seq: "SeqKV") -> int:
        """A free block for ``seq``'s next positions (:class:`PoolExhausted` if none is)."""
        with self._lock:
            if len(seq.blocks) > seq.shared:
                nxt = seq.blocks[-1] + 1
                if nxt < self.num_blocks and not self._refs[nxt] and (
                        seq.extent[0] <= nxt < seq.extent[1] or not self._reserved[nxt]):
                    return self._claim(nxt)
            else:  # its first block of its own: a run for the rest of its declared length
                want = math.ceil(seq.max_len / self.block_size) - seq.shared
                start = self._place(want)
                if start is not None:
                    seq.extent = (start, start + want)
                    return self._claim(start)
            # scattered: any block nobody reserved, else any free block at all
            for occupied in (self._used | self._reserved, self._used):
                free = np.flatnonzero(~occupied)
                if free.size:
                    return self._claim(int(free[0]))
            raise PoolExhausted(f"the KV pool is full ({self.num_blocks} blocks of {self.block_size} tokens in use)")

    def _place(self, want: int) -> int | None:
        """The first block of a free, unreserved run of ``want`` blocks (reserving it), or None."""
        occupied = (self._used | self._reserved).tobytes()
        at = occupied.find(bytes(min(want, self.num_blocks)))
        if at < 0:
            return None
        self._reserved[at:at + want] = True
        return at

    def _claim(self, block: int) -> int:
        self._refs[block] = 1
        return block

    def hold(self, blocks: list[int]) -> None:
        """One more holder for each of these blocks (each one in use already)."""
        with self._lock:
            if blocks and not self._refs[blocks].all():
                raise HpipeError("a free KV block cannot be shared")
            np.add.at(self._refs, blocks, 1)

    def drop(self, blocks: list[int]) -> None:
        """One holder fewer for each of these blocks; a block none holds is free."""
        with self._lock:
            np.subtract.at(self._refs, blocks, 1)

    def give_back(self, seq: "SeqKV", keep: int) -> None:
        """Drop ``seq``'s hold on its blocks past its first ``keep``; with none of its own kept,
        its reserved run too."""
        with self._lock:
            np.subtract.at(self._refs, seq.blocks[keep:], 1)
            if keep <= seq.shared:
                self._reserved[seq.extent[0]:seq.extent[1]] = False

    def release(self, seq: "SeqKV") -> None:
        """Drop ``seq``'s hold on its blocks (once; its block list is kept, see the module's note)."""
        with self._lock:
            if seq.released:
                return
            seq.released = True
            np.subtract.at(self._refs, seq.blocks, 1)
            self._reserved[seq.extent[0]:seq.extent[1]] = False


class SeqKV:
    """One sequence's blocks on one stage, in position order."""

    def __init__(self, pool: KVPool, max_len: int):
        self.pool, self.max_len = pool, max_len
        self.blocks: list[int] = []
        self.extent: tuple[int, int] = (0, 0)  # the blocks reserved for it at its first block of its own
        self.shared = 0  # how many of its first blocks it shares (a cached prefix it began with)
        self.leading = 0  # how many of its first blocks are consecutive in the pool
        self._runs: list[list[int]] = []  # its blocks as runs: [first block, count] in order
        self.released = False

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.pool.block_size

    @property
    def nbytes(self) -> int:
        return len(self.blocks) * KVPool.block_bytes(len(self.pool.layers), self.pool.kv_heads, self.pool.head_dim,
                                                    self.pool.dtype, self.pool.block_size)

    def share(self, blocks: list[int]) -> None:
        """Begin with these blocks of a cached prefix (held, never written: positions from
        ``len(blocks) * block_size`` on go to blocks of its own)."""
        if self.blocks or self.released:
            raise HpipeError("only a new, empty sequence can begin with shared blocks")
        self.pool.hold(blocks)
        for block in blocks:
            self._append(block)
        self.shared = len(blocks)

    def _append(self, block: int) -> None:
        if self.leading == len(self.blocks) and (not self.blocks or block == self.blocks[-1] + 1):
            self.leading += 1
        if self._runs and block == self._runs[-1][0] + self._runs[-1][1]:
            self._runs[-1][1] += 1
        else:
            self._runs.append([block, 1])
        self.blocks.append(block)

    def grow(self, length: int) -> None:
        """Hold positions ``[0, length)``, taking blocks as needed (:class:`PoolExhausted` if none is free)."""
        if self.released:
            raise HpipeError("the sequence's blocks were given back")
        if length > self.max_len:
            raise HpipeError(f"positions up to {length} exceed the sequence's declared max length {self.max_len}")
        while self.capacity < length:
            self._append(self.pool.take(self))

    def truncate(self, length: int) -> None:
        """Hold only positions ``[0, length)``: the blocks past them go back to the pool."""
        keep = math.ceil(length / self.pool.block_size)
        if keep >= len(self.blocks) or self.released:
            return
        self.pool.give_back(self, keep)
        if keep <= self.shared:  # none of its own left: its next block of its own reserves a new run
            self.extent = (0, 0)
            self.shared = keep
        blocks = self.blocks[:keep]
        self.blocks, self._runs, self.leading = [], [], 0
        for block in blocks:
            self._append(block)

    def release(self) -> None:
        self.pool.release(self)

    def run(self, end: int) -> tuple[int, int] | None:
        """The pool slots ``[a, b)`` of positions ``[0, end)`` when they are consecutive, else None."""
        if end == 0:
            return 0, 0
        if math.ceil(end / self.pool.block_size) > self.leading:
            return None
        first = self.blocks[0] * self.pool.block_size
        return first, first + end

    def runs(self, end: int) -> list[tuple[int, int]]:
        """Positions ``[0, end)`` as runs of consecutive pool slots: (first slot, count) in order."""
        bs, out, left = self.pool.block_size, [], end
        for first, count in self._runs:
            if left <= 0:
                break
            n = min(count * bs, left)
            out.append((first * bs, n))
            left -= n
        return out

    def slots(self, start: int, end: int, device: torch.device) -> torch.Tensor:
        """Pool slot indices of positions ``[start, end)``."""
        bs = self.pool.block_size
        run = self.run(end)
        if run is not None:
            return torch.arange(run[0] + start, run[1], device=device)
        pos = torch.arange(start, end)
        table = torch.tensor(self.blocks, dtype=torch.long)
        return (table[pos // bs] * bs + pos % bs).to(device)


@dataclass
class Entry:
    """One entry of a micro-batch as a stage computes it: ``length`` tokens of a sequence from
    position ``start``, and the logits wanted back (none, its last position's, or all).

    ``kv`` None marks an entry whose sequence has failed or closed: its rows still flow (so the
    micro-batch keeps its layout) but it neither reads nor writes any cache.

    ``prefill_end``: the positions below it are the prompt's, computed as prefill rows, and those
    at or past it as decode tokens (a replay's or a restart's decoded tokens get the KV their
    decode gave them); 0: every row of an entry of two tokens or more is a prefill row."""

    start: int
    length: int
    kv: SeqKV | None
    logits: str = "none"  # none | last | all
    prefill_end: int = 0

    @property
    def prefill(self) -> int:
        """How many of its rows, from the first, are prefill rows (the rest are decode tokens)."""
        if not self.prefill_end:
            return self.length if self.length > 1 else 0
        return min(self.length, max(0, self.prefill_end - self.start))


def prefill_end(start: int, tokens: int, prefill: bool | None) -> int:
    """An entry's ``prefill_end`` for ``tokens`` positions from ``start`` that are all prompt
    (True), all decode tokens (False), or left to the rule by length (None; also False at
    position 0, where a sequence's prompt begins and 0 is the field's "not said")."""
    if prefill is None:
        return 0
    return start + tokens if prefill else start


class BatchKV:
    """Where each entry of a micro-batch writes and reads its keys and values, worked out once for
    all the stage's layers."""

    def __init__(self, entries: list[Entry], pool: KVPool | None, device: torch.device):
        self.entries, self.pool = entries, pool
        self.offsets, off = [], 0
        writes, self.reads = [], []
        for e in entries:
            self.offsets.append(off)
            off += e.length
            if e.kv is None:
                self.reads.append(None)
                continue
            writes.append((off - e.length, e.kv.slots(e.start, e.start + e.length, device)))
            run = e.kv.run(e.start + e.length)
            self.reads.append(run if run is not None else e.kv.slots(0, e.start + e.length, device))
        self.tokens = off
        self.live_rows = torch.cat([torch.arange(a, a + len(s), device=device) for a, s in writes]) if writes else None
        self.write_slots = torch.cat([s for _, s in writes]) if writes else None
        self.all_live = self.live_rows is not None and len(self.live_rows) == self.tokens
        #: attention masks made for this micro-batch, kept for its other layers (:meth:`Attention._attend`)
        self.masks: dict = {}

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the micro-batch's new keys and values ``[tokens, kv_heads, head_dim]``."""
        if self.write_slots is None:
            return
        if not self.all_live:
            k, v = k.index_select(0, self.live_rows), v.index_select(0, self.live_rows)
        self.pool.k[layer].index_copy_(1, self.write_slots, k.transpose(0, 1))
        self.pool.v[layer].index_copy_(1, self.write_slots, v.transpose(0, 1))

    def read(self, layer: int, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[kv_heads, positions, head_dim]`` entry ``i`` attends to: its cached
        prefix and itself (only itself for a dead entry, from the micro-batch's own ``k``, ``v``
        ``[tokens, kv_heads, head_dim]``)."""
        where = self.reads[i]
        if where is None:
            a, n = self.offsets[i], self.entries[i].length
            return k[a:a + n].transpose(0, 1), v[a:a + n].transpose(0, 1)
        if isinstance(where, tuple):
            n = where[1] - where[0]
            return self.pool.k[layer].narrow(1, where[0], n), self.pool.v[layer].narrow(1, where[0], n)
        return self.pool.k[layer].index_select(1, where), self.pool.v[layer].index_select(1, where)
