"""The cost model the planner optimises: stage compute, link transfer, and stage memory.

A stage holding units ``[a, b)`` runs, for a slice of ``s`` tokens at context ``c`` and batch
``B``: the embedding if ``a == 0``, one attention unit per attention unit in the range, one MLP
per MLP unit, and the head if it holds the last unit. During prefill the runtime computes the
head only for the last slice of a sequence, and only at its last position (the logits the next
token is sampled from): ``head`` says which slices pay for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpipe.core.profile import Profile
from hpipe.core.units import kind_counts


@dataclass(frozen=True)
class Workload:
    seq_len: int
    batch: int = 1
    max_len: int | None = None  # KV cache length to provision; defaults to seq_len
    #: answer tokens decoded after the prompt, one pass through the chain each (a job's
    #: ``--max-new-tokens``); 0: the prompt's prefill alone is the objective (HPipe's)
    output_len: int = 0

    @property
    def kv_len(self) -> int:
        return self.max_len or self.seq_len


def working_bytes(p: Profile, batch: int, tokens: int, head: bool):
    """Working space of a stage for one slice of ``tokens`` x ``batch`` (``tokens`` may be an array).

    The peak of one unit's forward (residual, normed input and its float32 upcast, q/k/v and the
    attention output; gate, up and their product), plus the slices in flight around it (one
    uploaded ahead, one waiting to be sent), plus last-position logits in float32 at the head.
    Measured on an H100 with 32k-token prefills, the peaks came within 1.5% of the old estimate
    without the upcast and the in-flight slices, above it; this one stays above them.
    """
    m = p.model
    per_token = (6 * m.hidden_size + 3 * m.intermediate_size) * p.itemsize + 2 * m.hidden_size * 4
    return batch * tokens * per_token + (batch * m.vocab_size * 4 if head else 0)


#: unit-time lookups of item arrays up to this long are remembered (see CostModel._kind_times), up
#: to this many bytes of keys and values (then all forgotten at once)
MEMO_MAX_ITEMS = 1024
MEMO_MAX_BYTES = 32 << 20

#: per stage, whatever the slice: library workspaces (cuBLAS keeps ~32 MiB per stream), position
#: and mask buffers, allocator rounding. Measured 32k-token peaks on an H100 came within 1 MB of
#: the estimate without it.
FIXED_STAGE_BYTES = 64 << 20


def _factor(value) -> float:
    try:
        f = float(value)
    except (TypeError, ValueError):
        return 1.0
    return f if f >= 1.0 and f < float("inf") else 1.0


class CostModel:
    def __init__(self, profile: Profile):
        self.profile = profile
        self.daemons = list(profile.daemons)
        self.L = profile.model.num_layers
        self.num_units = profile.model.num_units
        # A measured profile's grids describe each device slowed by its co-located neighbours (all
        # busy at once, as in a pipeline); this takes that factor back out, for schedules in which
        # a device computes alone.
        factors = profile.meta.get("colocation_factors") or {}
        self.alone_scale = [1.0 / _factor(factors.get(d.name, 1.0)) for d in self.daemons]
        index = {d.name: i for i, d in enumerate(self.daemons)}
        self._links = {(index[l.src], index[l.dst]): l for l in profile.links}
        self._counts: dict[tuple[int, int], tuple[int, int, int, int]] = {}
        self._kind_memo: dict[tuple, np.ndarray] = {}
        self._memo_bytes = 0

    def _kind_times(self, dev: int, kind: str, s: np.ndarray, c: np.ndarray, batch: int) -> np.ndarray:
        """One unit of ``kind`` on ``dev`` for slices ``s`` at contexts ``c``: the grid's interpolation.

        A search over schedules asks for the same slicing on the same device again and again, once
        per stage and per candidate cut, and interpolating the grids was three quarters of a
        simulation's time: short item arrays (a schedule's items, not the slicing DP's tables) are
        remembered."""
        grid = self.daemons[dev].compute[kind]
        if s.size > MEMO_MAX_ITEMS:
            return grid.times(s, c, batch)
        key = (dev, kind, batch, s.tobytes(), c.tobytes())
        t = self._kind_memo.get(key)
        if t is None:
            if self._memo_bytes >= MEMO_MAX_BYTES:
                self._kind_memo.clear()
                self._memo_bytes = 0
            t = self._kind_memo[key] = grid.times(s, c, batch)
            t.flags.writeable = False
            self._memo_bytes += s.nbytes + c.nbytes + t.nbytes
        return t

    def stage_times(self, dev: int, a: int, b: int, s, c, batch: int, head=True) -> np.ndarray:
        """Vectorised: compute seconds of units [a, b) on ``dev`` for slices ``s`` at contexts ``c``.

        ``head`` (a bool, or a bool array shaped like ``s``): whether the slice computes the head's
        one-token logits, if the range holds the head.
        """
        key = (dev, a, b, batch)
        counts = self._counts.get(key[1:3])
        if counts is None:
            counts = self._counts[key[1:3]] = kind_counts(a, b, self.L)
        e, at, ml, h = counts
        s = np.asarray(s, dtype=float)
        c = np.asarray(c, dtype=float)
        t = np.zeros_like(s)
        if e:
            t = t + self._kind_times(dev, "embed", s, c, batch)
        if at:
            t = t + at * self._kind_times(dev, "attn", s, c, batch)
        if ml:
            t = t + ml * self._kind_times(dev, "mlp", s, np.zeros_like(c), batch)
        if h:
            t = t + np.asarray(head, dtype=float) * self.daemons[dev].compute["head"].time(1, 0, batch)
        return t

    def stage_time(self, dev: int, a: int, bnd: int, s: int, c: int, batch: int, head: bool = True) -> float:
        return float(self.stage_times(dev, a, bnd, [s], [c], batch, head)[0])

    def link(self, src: int, dst: int):
        """The measured link from device ``src`` to ``dst`` (latency_s, bandwidth_Bps)."""
        return self._links[src, dst]

    def comm_time(self, src: int, dst: int, s, batch: int):
        """Seconds to send slices of ``s`` tokens from device ``src`` to ``dst`` (``s`` may be an array)."""
        nbytes = np.asarray(s, dtype=float) * batch * self.profile.activation_bytes_per_token()
        link = self._links[src, dst]
        t = link.latency_s + nbytes / link.bandwidth_Bps
        return float(t) if t.ndim == 0 else t

    def host_times(self, dev: int, src: int | None, dst: int | None, s, batch: int):
        """CPU seconds a CPU device spends outside its compute moving slices of ``s`` tokens: in from
        ``src`` and out to ``dst`` (None: no such hop). Its RPC and transport threads share its cores
        with the compute, so this adds to the stage's time. Zero on accelerators, whose host threads
        run beside the device."""
        s = np.asarray(s, dtype=float)
        if not self.daemons[dev].device.startswith("cpu"):
            return np.zeros_like(s)
        nbytes = s * batch * self.profile.activation_bytes_per_token()
        t = np.zeros_like(s)
        if src is not None and src != dev:
            t = t + self._links[src, dev].recv_cpu(nbytes)
        if dst is not None and dst != dev:
            t = t + self._links[dev, dst].send_cpu(nbytes)
        return t

    def stage_memory(self, a: int, b: int, work: Workload, slice_tokens: int | None = None) -> int:
        """Weights + KV cache for the workload's max length x batch + working space of one slice."""
        p = self.profile
        e, at, ml, h = kind_counts(a, b, self.L)
        weights = (e * p.unit_weight_bytes("embed") + at * p.unit_weight_bytes("attn")
                   + ml * p.unit_weight_bytes("mlp") + h * p.unit_weight_bytes("head"))
        if e and h and p.model.tie_word_embeddings:
            weights -= p.matrix_bytes(p.model.vocab_size * p.model.hidden_size)
        kv = at * p.kv_bytes_per_token_per_layer() * work.kv_len * work.batch
        return weights + kv + working_bytes(p, work.batch, slice_tokens or work.seq_len, bool(h)) + FIXED_STAGE_BYTES

    def fits(self, dev: int, a: int, b: int, work: Workload) -> bool:
        return self.stage_memory(a, b, work) <= self.daemons[dev].memory_bytes
