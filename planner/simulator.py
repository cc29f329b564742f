"""Exact makespan of a pipeline schedule: compute per stage and transfer per link as resources.

Items (micro-batch u, slice i) enter stage 0 in order; each stage computes items one at a time
in arrival order (like the daemon's single worker), and each link carries one transfer at a time
(like the daemon's sender thread), so a stage computes item k+1 while item k is on the wire.

    C[j][k] = max(C[j][k-1], A[j][k]) + comp[j][k]          compute finish
    X[j][k] = max(X[j][k-1], C[j][k]) + comm[j][k]          transfer finish on link j -> j+1
    A[j+1][k] = X[j][k],  A[0][k] = 0                        arrival
    makespan = C[N-1][K-1]

A device may hold several stages (an interleaved schedule: ``A1 B1 C1 A2 B2 C2``, each device
holding two unit ranges). It then computes one item at a time over all of them, first come first
served by arrival (like the daemon's single worker queue), and one sender thread carries all of
its outputs in the order they were computed. That case runs as a discrete-event simulation:
computations are committed in order of start time, so every item a device could have taken
instead has a known arrival by then.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

INF = float("inf")


@dataclass(frozen=True)
class Timeline:
    makespan: float
    # (stage, item, start, end) compute intervals and (link, item, start, end) transfers
    compute: tuple[tuple[int, int, float, float], ...]
    transfers: tuple[tuple[int, int, float, float], ...]


def simulate(comp: list[list[float]], comm: list[list[float]], keep: bool = False,
             devices: list[int] | tuple[int, ...] | None = None) -> Timeline | float:
    """``comp[j][k]``: compute seconds of item k on stage j; ``comm[j][k]``: link j -> j+1 seconds.

    ``devices[j]``: the device of stage j (default: one device per stage). Returns the makespan,
    or a :class:`Timeline` with every interval when ``keep``.
    """
    if devices is not None and len(set(devices)) < len(devices):
        return _simulate_shared(comp, comm, keep, list(devices))
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


def _simulate_shared(comp, comm, keep: bool, devices: list[int]) -> Timeline | float:
    n, k_items = len(comp), len(comp[0]) if comp else 0
    if n == 0 or k_items == 0:
        return Timeline(0.0, (), ()) if keep else 0.0
    arrival = [[0.0] * k_items] + [[INF] * k_items for _ in range(n - 1)]
    nxt = [0] * n                       # the next item of each stage (a stage takes its items in order)
    free = {d: 0.0 for d in devices}    # when each device's worker is next idle
    sender = {d: 0.0 for d in devices}  # when each device's sender thread is next idle
    cspans, tspans = [], []
    makespan = 0.0
    # Candidates (start, arrival, stage) of every stage whose next item has arrived, in a heap. A
    # device's free time only grows, so a stored start is a lower bound of the true one: a popped
    # entry whose start has since grown goes back in with the true start, and the first entry that
    # pops unchanged is the earliest computation any device can begin (ties as (arrival, stage)).
    heap = [(0.0, 0.0, 0)]
    for _ in range(n * k_items):
        while True:
            start, arr, j = heapq.heappop(heap)
            true = max(free[devices[j]], arr)
            if true == start:
                break
            heapq.heappush(heap, (true, arr, j))
        k = nxt[j]
        nxt[j] += 1
        d = devices[j]
        end = free[d] = start + comp[j][k]
        if keep:
            cspans.append((j, k, start, end))
        if k + 1 < k_items and arrival[j][k + 1] < INF:
            heapq.heappush(heap, (max(end, arrival[j][k + 1]), arrival[j][k + 1], j))
        if j == n - 1:
            makespan = max(makespan, end)
            continue
        t0 = max(sender[d], end)
        sender[d] = arrival[j + 1][k] = t0 + comm[j][k]
        if keep:
            tspans.append((j, k, t0, sender[d]))
        if nxt[j + 1] == k:  # the item stage j+1 waits for has arrived
            heapq.heappush(heap, (max(free[devices[j + 1]], sender[d]), sender[d], j + 1))
    if keep:
        return Timeline(makespan, tuple(sorted(cspans)), tuple(sorted(tspans)))
    return makespan
