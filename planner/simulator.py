"""Exact makespan of a pipeline schedule: compute per stage and transfer per link as resources.

Items (micro-batch u, slice i) enter stage 0 in order; each stage computes items one at a time
in arrival order (like the daemon's single worker), and each link carries one transfer at a time
(like the daemon's sender thread), so a stage computes item k+1 while item k is on the wire.

    C[j][k] = max(C[j][k-1], A[j][k]) + comp[j][k]          compute finish
    X[j][k] = max(X[j][k-1], C[j][k]) + comm[j][k]          transfer finish on link j -> j+1
    A[j+1][k] = X[j][k],  A[0][k] = 0                        arrival
    makespan = C[N-1][K-1]
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Timeline:
    makespan: float
    # (stage, item, start, end) compute intervals and (link, item, start, end) transfers
    compute: tuple[tuple[int, int, float, float], ...]
    transfers: tuple[tuple[int, int, float, float], ...]


def simulate(comp: list[list[float]], comm: list[list[float]], keep: bool = False) -> Timeline | float:
    """``comp[j][k]``: compute seconds of item k on stage j; ``comm[j][k]``: link j -> j+1 seconds.

    Returns the makespan, or a :class:`Timeline` with every interval when ``keep``.
    """
    n = len(comp)
    if n == 0 or not comp[0]:
        return Timeline(0.0, (), ()) if keep else 0.0
    k_items = len(comp[0])
    arrival = [0.0] * k_items
    cspans, tspans = [], []
    for j in range(n):
        busy = 0.0
        finish = [0.0] * k_items
        for k in range(k_items):
            start = max(busy, arrival[k])
            busy = finish[k] = start + comp[j][k]
            if keep:
                cspans.append((j, k, start, busy))
        if j == n - 1:
            makespan = busy
            break
        wire = 0.0
        for k in range(k_items):
            start = max(wire, finish[k])
            wire = arrival[k] = start + comm[j][k]
            if keep:
                tspans.append((j, k, start, wire))
    return Timeline(makespan, tuple(cspans), tuple(tspans)) if keep else makespan
