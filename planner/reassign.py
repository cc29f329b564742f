"""After a daemon is lost for good: its stages moved to the survivors, every other stage kept.

Design note. Re-planning on the survivors from scratch (the plan's strategy on
``Profile.without``) finds the best pipeline for them, but it moves every cut: each survivor
reloads its units and every sequence in flight is prefilled again. Moving only the lost daemon's
stages keeps every other stage where it is, with its weights and its KV caches; the moved stages
are rebuilt from the replay log of the stage before each (``runtime.coordinator.resume``). This picks, for
each lost stage, the survivor that keeps the busiest device's work smallest: a device computes
all its stages, so its load is the sum of its stages' times for the workload's slice, and every
device must hold what it is given. The application compares the busiest device's load with a
fresh plan's (:func:`busiest_load`) and moves stages unless that is much slower.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Sequence

from hpipe.core.plan import Stage
from planner.costs import CostModel, Workload

#: the most lost stages whose placements are tried exhaustively (survivors ** stages combinations)
MAX_EXHAUSTIVE = 6


def reassign(cost: CostModel, work: Workload, stages: Sequence[Stage], gone: set[str]) -> tuple[Stage, ...] | None:
    """``stages`` with those on ``gone`` daemons placed on the cost model's daemons (the survivors),
    or None when they cannot hold them."""
    index = {d.name: i for i, d in enumerate(cost.daemons)}
    lost = [j for j, s in enumerate(stages) if s.daemon in gone]
    if not lost:
        return tuple(stages)
    if any(s.daemon not in index for j, s in enumerate(stages) if j not in lost):
        return None
    base_time = [0.0] * len(cost.daemons)
    base_mem = [0] * len(cost.daemons)
    for j, s in enumerate(stages):
        if j not in lost:
            d = index[s.daemon]
            base_time[d] += _time(cost, work, d, s)
            base_mem[d] += cost.stage_memory(s.units.start, s.units.end, work)
    choices = range(len(cost.daemons))
    tries = itertools.product(choices, repeat=len(lost)) if len(lost) <= MAX_EXHAUSTIVE else [_greedy(
        cost, work, stages, lost, base_time)]
    best, best_load = None, float("inf")
    for placement in tries:
        load, mem = list(base_time), list(base_mem)
        for j, d in zip(lost, placement):
            load[d] += _time(cost, work, d, stages[j])
            mem[d] += cost.stage_memory(stages[j].units.start, stages[j].units.end, work)
        if any(m > cost.daemons[d].memory_bytes for d, m in enumerate(mem)):
            continue
        if max(load) < best_load:
            best, best_load = placement, max(load)
    if best is None:
        return None
    out = list(stages)
    for j, d in zip(lost, best):
        dev = cost.daemons[d]
        out[j] = replace(stages[j], daemon=dev.name, address=dev.address, memory_limit=dev.memory_bytes,
                         compute_s=_time(cost, work, d, stages[j]))
    return tuple(out)


def busiest_load(cost: CostModel, work: Workload, stages: Sequence[Stage]) -> float:
    """Seconds the busiest device computes for one slice of the workload through ``stages``
    (summed over the stages it holds): how two placements compare."""
    index = {d.name: i for i, d in enumerate(cost.daemons)}
    load: dict[int, float] = {}
    for s in stages:
        d = index[s.daemon]
        load[d] = load.get(d, 0.0) + _time(cost, work, d, s)
    return max(load.values())


def _time(cost: CostModel, work: Workload, d: int, s: Stage) -> float:
    return cost.stage_time(d, s.units.start, s.units.end, work.seq_len, 0, work.batch)


def _greedy(cost, work, stages, lost, load) -> tuple[int, ...]:
    """Each lost stage, largest first, on the device that ends up least loaded."""
    load, placement = list(load), {}
    for j in sorted(lost, key=lambda j: stages[j].units.start - stages[j].units.end):
        d = min(range(len(load)), key=lambda d: load[d] + _time(cost, work, d, stages[j]))
        load[d] += _time(cost, work, d, stages[j])
        placement[j] = d
    return tuple(placement[j] for j in lost)
