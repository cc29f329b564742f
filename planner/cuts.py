"""Layer cuts: HPipe's Algorithm 1, extended to choose the devices and their order.

The paper fixes the device order and runs ``A[b][m] = min_k max(A[k][m-1], T(k+1, b, m))``.
Here the DP runs over suffixes with the set of devices already used as part of the state:

    F(a, m, S) = min( T_last(m, a),                                     stage [a, U) ends the pipeline
                      min_{b, m' not in S} max(T(m, a, b) + comm(m, m'), F(b, m', S | {m'})) )

so the device order is searched exactly, a device may be left out, and a stage that does not fit
its device's memory costs infinity. That is exact for up to ``EXACT_DEVICES`` devices (2^N
subsets); beyond it the order is fixed, fastest device first, and the DP still may skip devices.
Stage times are for the whole sequence x batch (the paper's T), including the stage's outgoing
transfer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hpipe.core.errors import HpipeError
from hpipe.core.units import UNIT_KINDS, unit_kinds
from planner.costs import FIXED_STAGE_BYTES, CostModel, Workload, working_bytes

EXACT_DEVICES = 8


class InfeasibleError(HpipeError):
    """No assignment of units to devices fits."""


@dataclass(frozen=True)
class Cuts:
    bottleneck: float
    bounds: tuple[int, ...]  # 0 = b0 < b1 < ... < bk = num_units
    daemons: tuple[int, ...]  # daemon index (in the profile) of each stage

    @property
    def cuts(self) -> list[int]:
        return list(self.bounds[1:-1])


def count_matrices(num_layers: int) -> tuple[np.ndarray, ...]:
    """(embed, attn, mlp, head) unit counts of every range [a, b) as [U+1, U+1] matrices."""
    kinds = np.array([[kind == k for kind in unit_kinds(num_layers)] for k in UNIT_KINDS], dtype=float)
    prefix = np.concatenate([np.zeros((4, 1)), np.cumsum(kinds, axis=1)], axis=1)  # [4, U+1]
    counts = prefix[:, None, :] - prefix[:, :, None]  # counts[k, a, b] = units of kind k in [a, b)
    return tuple(counts)


def stage_table(cost: CostModel, work: Workload) -> np.ndarray:
    """``T[m, a, b]``: compute seconds of units [a, b) on device m for the whole sequence (inf if it does not fit)."""
    n, u = len(cost.daemons), cost.num_units
    e, at, ml, h = count_matrices(cost.L)
    p = cost.profile
    weights = (e * p.unit_weight_bytes("embed") + at * p.unit_weight_bytes("attn") + ml * p.unit_weight_bytes("mlp")
               + h * p.unit_weight_bytes("head"))
    if p.model.tie_word_embeddings:
        weights = weights - e * h * p.matrix_bytes(p.model.vocab_size * p.model.hidden_size)
    memory = (weights + at * p.kv_bytes_per_token_per_layer() * work.kv_len * work.batch
              + working_bytes(p, work.batch, work.seq_len, False)
              + h * working_bytes(p, work.batch, 0, True) + FIXED_STAGE_BYTES)
    a_idx, b_idx = np.meshgrid(np.arange(u + 1), np.arange(u + 1), indexing="ij")
    table = np.full((n, u + 1, u + 1), math.inf)
    for m, dev in enumerate(cost.daemons):
        g = dev.compute
        s, b = work.seq_len, work.batch
        t = (e * g["embed"].time(s, 0, b) + at * g["attn"].time(s, 0, b) + ml * g["mlp"].time(s, 0, b)
             + h * g["head"].time(1, 0, b))
        ok = (b_idx > a_idx) & (memory <= dev.memory_bytes)
        table[m][ok] = t[ok]
    return table


def best_cuts(cost: CostModel, work: Workload, allowed: list[int] | None = None) -> Cuts:
    devices = allowed if allowed is not None else list(range(len(cost.daemons)))
    if not devices:
        raise InfeasibleError("no devices to plan for")
    table = stage_table(cost, work)
    comm = comm_matrix(cost, work.seq_len, work.batch)
    u = cost.num_units
    result = min_max_cuts(table, comm, devices, u, speed=lambda m: table[m, 0, u] if np.isfinite(
        table[m, 0, u]) else cost.stage_time(m, 0, u, work.seq_len, 0, work.batch))
    if not math.isfinite(result.bottleneck):
        need = cost.stage_memory(0, cost.num_units, work)
        have = sum(cost.daemons[m].memory_bytes for m in devices)
        raise InfeasibleError(
            f"the model does not fit: weights + KV cache for {work.kv_len} tokens x batch {work.batch} + working space "
            f"need about {need / 2**30:.2f} GiB in all, the devices offer {have / 2**30:.2f} GiB, and no split into "
            "contiguous unit ranges fits every device")
    return result


def comm_matrix(cost: CostModel, tokens: int, batch: int) -> np.ndarray:
    """``[src, dst]``: seconds to send ``tokens`` x ``batch`` activations between devices (0 to itself)."""
    n = len(cost.daemons)
    return np.array([[cost.comm_time(i, j, tokens, batch) if i != j else 0.0 for j in range(n)] for i in range(n)])


def min_max_cuts(table: np.ndarray, comm: np.ndarray, devices: list[int], u: int, speed=None) -> Cuts:
    """The contiguous split of ``u`` units over some of ``devices`` (chosen and ordered) that
    minimises the largest ``table[m, a, b] + comm[m, next]``: exact over device orders for up to
    ``EXACT_DEVICES`` devices, beyond that in a fixed order, fastest first by ``speed(m)``
    (seconds; default: the whole model's ``table`` entry)."""
    if len(devices) <= EXACT_DEVICES:
        return _subset_dp(table, comm, devices, u)
    return _ordered_dp(table, comm, sorted(devices, key=speed or (lambda m: table[m, 0, u])), u)


def _subset_dp(table: np.ndarray, comm: np.ndarray, devices: list[int], u: int) -> Cuts:
    n = len(devices)
    full = 1 << n
    f = np.full((u + 1, n, full), math.inf)
    nxt_b = np.zeros((u + 1, n, full), dtype=np.int32)
    nxt_m = np.full((u + 1, n, full), -1, dtype=np.int32)
    for a in range(u - 1, -1, -1):
        for i, m in enumerate(devices):
            last = table[m, a, u]
            for mask in range(full):
                if not mask >> i & 1:
                    continue
                best, bb, bm = last, u, -1
                for k, m2 in enumerate(devices):
                    if mask >> k & 1:
                        continue
                    cand = np.maximum(table[m, a, a + 1:u] + comm[m, m2], f[a + 1:u, k, mask | 1 << k])
                    if cand.size:
                        j = int(np.argmin(cand))
                        if cand[j] < best:
                            best, bb, bm = float(cand[j]), a + 1 + j, k
                f[a, i, mask], nxt_b[a, i, mask], nxt_m[a, i, mask] = best, bb, bm
    starts = [f[0, i, 1 << i] for i in range(n)]
    i = int(np.argmin(starts))
    bounds, devs, a, mask = [0], [], 0, 1 << i
    while True:
        devs.append(devices[i])
        b, k = int(nxt_b[a, i, mask]), int(nxt_m[a, i, mask])
        bounds.append(b)
        if k < 0:
            break
        a, i, mask = b, k, mask | 1 << k
    return Cuts(float(starts[int(np.argmin(starts))]), tuple(bounds), tuple(devs))


def _ordered_dp(table: np.ndarray, comm: np.ndarray, order: list[int], u: int) -> Cuts:
    """Devices in a fixed order; each may be skipped."""
    n = len(order)
    f = np.full((u + 1, n), math.inf)
    nxt = {}
    for a in range(u - 1, -1, -1):
        for i in range(n - 1, -1, -1):
            m = order[i]
            best, choice = table[m, a, u], (u, -1)
            for k in range(i + 1, n):
                cand = np.maximum(table[m, a, a + 1:u] + comm[m, order[k]], f[a + 1:u, k])
                if cand.size:
                    j = int(np.argmin(cand))
                    if cand[j] < best:
                        best, choice = float(cand[j]), (a + 1 + j, k)
            f[a, i], nxt[a, i] = best, choice
    i = int(np.argmin(f[0]))
    value = float(f[0, i])
    bounds, devs, a = [0], [], 0
    while True:
        devs.append(order[i])
        b, k = nxt[a, i]
        bounds.append(b)
        if k < 0:
            break
        a, i = b, k
    return Cuts(value, tuple(bounds), tuple(devs))


def bottleneck_of(cost: CostModel, work: Workload, bounds: tuple[int, ...], devices: tuple[int, ...]) -> float:
    """The Algorithm-1 objective of a given split (for tests and reports)."""
    worst = 0.0
    for j, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if not cost.fits(devices[j], a, b, work):
            return math.inf
        t = cost.stage_time(devices[j], a, b, work.seq_len, 0, work.batch)
        if j + 1 < len(devices):
            t += cost.comm_time(devices[j], devices[j + 1], work.seq_len, work.batch)
        worst = max(worst, t)
    return worst
