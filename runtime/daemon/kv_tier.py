"""The host tier of a daemon's KV cache: sequences swapped out of the pools under memory pressure.

Seesaw's tiered KV buffer (§4.2), as preemption uses it. When the coordinator needs blocks it
preempts a sequence that has nothing in flight; with the tier, it asks every daemon to swap the
sequence out (``SwapOut``) instead of closing it: each held stage copies the sequence's computed
positions (keys and values of each layer) from its pool into host memory (pinned on a GPU, so
the copy back is a DMA) and gives its blocks back. The next entry naming the sequence copies them
into blocks of its own first (:meth:`HostTier.swap_in`, from the layout), and it goes on where it
stood: nothing is computed again. A copy lives until it is swapped in or its sequence is freed.

The tier holds at most :data:`TIER_FACTOR` times each stage's pool in blocks, allocated as
sequences are swapped out; the coordinator mirrors that room (its engine swaps out only what
fits, and recomputes the rest), and a sequence the tier cannot take here is refused instead: it
fails with ``DATA_LOSS``, and the coordinator recomputes it.

Both directions run on the worker (``run_on_device``): a block freed by a sequence closed while
one of its micro-batches computes may still be written by that computation, which is harmless to
a new sequence that writes its positions before reading them, but not to a copy back, which no
micro-batch writes again (:mod:`hpipe.model.kv.pool`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from hpipe.model.kv.pool import BLOCK_SIZE
from runtime.daemon.sequences import Sequence

#: the tier's room per stage, in multiples of the stage's pool blocks
TIER_FACTOR = 3


@dataclass
class Swapped:
    """One sequence's KV in the tier: per held stage, its positions and each layer's keys and values."""
    positions: dict[int, int]
    k: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    v: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)

    def blocks(self, block_size: int) -> int:
        return max((math.ceil(n / block_size) for n in self.positions.values()), default=0)


class HostTier:
    """Swapped-out sequences of one daemon, by id."""

    def __init__(self):
        self._held: dict[int, Swapped] = {}
        self.swapped_out = self.swapped_in = 0

    def reset(self) -> None:
        """A new deployment: its pools are new, and no copy fits them."""
        self._held.clear()
        self.swapped_out = self.swapped_in = 0

    def holds(self, seq_id: int) -> bool:
        return seq_id in self._held

    def used_blocks(self, block_size: int) -> int:
        return sum(s.blocks(block_size) for s in self._held.values())

    def stats(self, stages: dict) -> dict:
        """Its room and use in blocks, and the sequences swapped out and in (as ``Status`` reports them)."""
        return {"tier_blocks": self.capacity(stages), "tier_used_blocks": self.used_blocks(BLOCK_SIZE),
                "swapped_out": self.swapped_out, "swapped_in": self.swapped_in}

    @staticmethod
    def capacity(stages: dict) -> int:
        """Blocks the tier holds: TIER_FACTOR times the smallest held pool (0 without pools)."""
        return TIER_FACTOR * min((s.pool.num_blocks for s in stages.values() if s.pool is not None), default=0)

    def swap_out(self, seq: Sequence, stages: dict) -> bool:
        """Copy ``seq``'s computed positions into the tier and give its blocks back (True; already
        out: nothing to do); False, with nothing changed, when the tier has no room for it."""
        if seq.id in self._held:
            return True
        pools = {i: stages[i].pool for i in seq.kv if i in stages and stages[i].pool is not None}
        if not pools:
            return True
        block_size = next(iter(pools.values())).block_size
        copy = Swapped({i: seq.computed.get(i, 0) for i in pools})
        if self.used_blocks(block_size) + copy.blocks(block_size) > self.capacity(stages):
            return False
        for i, pool in pools.items():
            kv, n = seq.kv[i], copy.positions[i]
            slots = kv.slots(0, n, pool.k[pool.layers[0]].device) if pool.layers else None
            copy.k[i] = {layer: _to_host(pool.k[layer][:, slots]) for layer in pool.layers}
            copy.v[i] = {layer: _to_host(pool.v[layer][:, slots]) for layer in pool.layers}
            kv.release()
            seq.kv[i] = pool.sequence(seq.max_len)
            seq.planned[i] = seq.computed[i] = n
        self._held[seq.id] = copy
        self.swapped_out += 1
        return True

    def swap_out_all(self, seqs: list[Sequence], stages: dict) -> None:
        """Swap these sequences out; one the tier has no room for fails with DATA_LOSS and gives
        its blocks back (one failed already is left as it is)."""
        for seq in seqs:
            if not seq.error and not seq.closed and not self.swap_out(seq, stages):
                seq.fail("DATA_LOSS", f"sequence {seq.id} was preempted and the host tier has no room for its KV")
                for kv in seq.kv.values():
                    kv.truncate(0)

    def swap_in(self, seq: Sequence, stages: dict) -> None:
        """Copy ``seq``'s positions back into blocks of its own on every held stage
        (:class:`hpipe.model.kv.pool.PoolExhausted` if a pool has no room: it stays in the tier)."""
        copy = self._held.get(seq.id)
        if copy is None:
            return
        grown = []
        try:
            for i, n in copy.positions.items():
                seq.kv[i].grow(n)
                grown.append(i)
        except Exception:
            for i in grown:
                seq.kv[i].truncate(0)
            raise
        for i, n in copy.positions.items():
            pool = stages[i].pool
            if not pool.layers or not n:
                continue
            slots = seq.kv[i].slots(0, n, pool.k[pool.layers[0]].device)
            for layer in pool.layers:
                pool.k[layer][:, slots] = copy.k[i][layer].to(pool.k[layer].device, non_blocking=True)
                pool.v[layer][:, slots] = copy.v[i][layer].to(pool.v[layer].device, non_blocking=True)
        del self._held[seq.id]
        self.swapped_in += 1

    def drop(self, seq_id: int) -> None:
        """Forget a freed sequence's copy."""
        self._held.pop(seq_id, None)

    def keep(self, stages: dict) -> None:
        """A layout switch (a reshard): the copies of stages still held stay, those of stages given
        up go (their KV was sent to the new owner, or is rebuilt there)."""
        for seq_id, copy in list(self._held.items()):
            for i in [i for i in copy.positions if i not in stages]:
                del copy.positions[i]
                copy.k.pop(i, None)
                copy.v.pop(i, None)
            if not copy.positions:
                del self._held[seq_id]

    def stage_copy(self, seq_id: int, i: int) -> tuple[dict, dict] | None:
        """A swapped sequence's keys and values on stage ``i`` (each layer's ``[kv_heads, positions,
        head_dim]``), None when the tier holds none of it."""
        copy = self._held.get(seq_id)
        if copy is None or i not in copy.positions:
            return None
        return copy.k.get(i, {}), copy.v.get(i, {})

    def adopt(self, seq: Sequence, i: int, positions: int, k: dict, v: dict, stages: dict) -> bool:
        """Keep KV another daemon sent for stage ``i`` of a swapped sequence (each layer's ``[kv_heads,
        positions, head_dim]``) as its copy here, so the sequence stays in the tier and comes back
        whole; False (nothing kept) when the tier has no room for it."""
        copy = self._held.get(seq.id) or Swapped({})
        before = copy.blocks(BLOCK_SIZE) if seq.id in self._held else 0
        if self.used_blocks(BLOCK_SIZE) - before + max(before, math.ceil(positions / BLOCK_SIZE)) > \
                self.capacity(stages):
            return False
        copy.positions[i], copy.k[i], copy.v[i] = positions, k, v
        self._held[seq.id] = copy
        seq.planned[i] = seq.computed[i] = positions
        return True


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a pool's rows gathered by index: already a copy) in host memory, pinned on a GPU."""
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t)
    return out
