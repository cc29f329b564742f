"""Token slicing: HPipe's Algorithm 2, for every supported length at once.

For fixed stages, a slice of ``s`` tokens at context ``c`` costs ``G[s][c] = max_j t_j(s, c)``
on the pipeline's slowest stage (``t_j`` = compute plus the stage's outgoing transfer). For each
candidate bound ``t_max`` a prefix DP over positions

    L[p] = min_{s : G[s][p-s] <= t_max} L[p - s] + G[s][p - s]

gives the best slicing of *every* prefix length p, and the paper's latency estimate of a length
is ``L[p] + (N-1) * t_max``; the best ``t_max`` is kept per length. Lengths and slices are
multiples of ``granularity`` tokens (default 16), so a table up to 8192 tokens has 512 entries.
``t_max`` is enumerated over ``levels`` geometrically spaced values spanning all slice times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from planner.costs import CostModel

GRANULARITY = 16


@dataclass(frozen=True)
class CostStage:
    """A stage as the slicing DP prices it: its daemon index, units [start, end), and neighbours."""

    device: int
    start: int
    end: int
    next_device: int | None
    prev_device: int | None = None


def slice_times(cost: CostModel, stages: list[CostStage], s, c, batch: int) -> np.ndarray:
    """Per-stage time (compute, its host's share of moving the slice, outgoing transfer) of slices
    ``s`` at contexts ``c``: shape [stages, ...].

    The head's one-time cost (last slice only) is left out: it does not depend on the slicing.
    """
    out = []
    for st in stages:
        t = cost.stage_times(st.device, st.start, st.end, s, c, batch, head=False)
        t = t + cost.host_times(st.device, st.prev_device, st.next_device, s, batch)
        if st.next_device is not None:
            t = t + cost.comm_time(st.device, st.next_device, s, batch)
        out.append(t)
    return np.stack(out)


@dataclass(frozen=True)
class SlicingTable:
    granularity: int
    max_len: int
    slices: dict[int, tuple[int, ...]]  # length (multiple of granularity) -> slice lengths
    estimate: dict[int, float]          # the DP's latency estimate for that length


def slicing_table(cost: CostModel, stages: list[CostStage], max_len: int, batch: int,
                  granularity: int = GRANULARITY, levels: int = 64) -> SlicingTable:
    g = granularity
    p_max = max_len // g
    if p_max < 1:
        raise ValueError(f"max length {max_len} is below the slicing granularity {g}")
    # H[p, s] = G[s][p - s] for slices of s*g tokens ending at p*g
    pp, ss = np.meshgrid(np.arange(p_max + 1), np.arange(p_max + 1), indexing="ij")
    valid = (ss >= 1) & (ss <= pp)
    h = np.full((p_max + 1, p_max + 1), math.inf)
    per_stage = slice_times(cost, stages, ss[valid] * g, (pp[valid] - ss[valid]) * g, batch)
    h[valid] = per_stage.max(axis=0)
    finite = h[np.isfinite(h)]
    t_levels = np.unique(np.geomspace(finite.min(), finite.max(), levels))
    n_stages = len(stages)
    best = np.full(p_max + 1, math.inf)
    best_choice = np.zeros((p_max + 1,), dtype=np.int64)
    choices = {}
    for t_max in t_levels:
        lat = np.full(p_max + 1, math.inf)
        lat[0] = 0.0
        step = np.zeros(p_max + 1, dtype=np.int64)
        for p in range(1, p_max + 1):
            s = np.arange(1, p + 1)
            cand = lat[p - s] + h[p, 1:p + 1]
            cand[h[p, 1:p + 1] > t_max] = math.inf
            j = int(np.argmin(cand))
            lat[p], step[p] = cand[j], j + 1
        total = lat + (n_stages - 1) * t_max
        better = total < best
        if better.any():
            key = len(choices)
            choices[key] = step
            best = np.where(better, total, best)
            best_choice = np.where(better, key, best_choice)
    table, estimate = {}, {}
    for p in range(1, p_max + 1):
        step = choices[int(best_choice[p])]
        out, q = [], p
        while q > 0:
            out.append(int(step[q]) * g)
            q -= int(step[q])
        table[p * g] = tuple(reversed(out))
        estimate[p * g] = float(best[p])
    return SlicingTable(g, p_max * g, table, estimate)
