"""Local search under the exact simulator: polish a schedule the dynamic programs proposed.

Algorithm 1 balances stages by their *unsliced* cost and Algorithm 2 then slices with the cuts
fixed. Slicing changes each device's costs differently (a small slice re-reads a unit's weights,
which costs a memory-bound device more than a compute-bound one), so the DPs' answer is close to
but not at the best schedule. This search hill-climbs (cuts, slices) under the simulator, then
kicks the best schedule found with a few random moves and climbs again (iterated local search),
until several kicks in a row find nothing better or the budget is spent. It never returns a worse
schedule than it was given, and with the same budget of evaluations it is deterministic.

Moves:
- **transfer units** between any two stages: shift a run of consecutive cuts by one or two units,
  which moves units between the stage before the run and the stage after it, the stages inside
  the run keeping their sizes (a single cut is the shortest run). In an interleaved chain this
  moves work between one device's rounds, which single cuts cannot do without passing through
  worse schedules. On a profile of ``clusters/emulated-hetero.yaml`` the climb with single-cut
  moves stopped at 4.493 s predicted; this search shrank the first round's stages (a shorter
  pipeline fill) and reached 4.302 s (docs/planner.md);
- **transfer tokens** between two neighbouring slices, merge two, or halve one.
"""

from __future__ import annotations

import random
import time
from typing import Callable, Iterator, Sequence

Evaluate = Callable[[tuple[int, ...], tuple[int, ...]], float]
Move = tuple[tuple[int, ...], tuple[int, ...]]

CUT_STEPS = (-2, -1, 1, 2)
KICK_MOVES = (2, 4)   # a kick applies this many random moves (inclusive range)
PATIENCE = 12         # kicks in a row that find nothing better end the search


def _cut_moves(bounds: tuple[int, ...], steps: Sequence[int]) -> Iterator[tuple[int, ...]]:
    n = len(bounds)
    for first in range(1, n - 1):
        for last in range(first, n - 1):
            for d in steps:
                if bounds[first - 1] < bounds[first] + d and bounds[last] + d < bounds[last + 1]:
                    b = list(bounds)
                    for i in range(first, last + 1):
                        b[i] += d
                    yield tuple(b)


def _slice_moves(slices: tuple[int, ...], granularity: int) -> Iterator[tuple[int, ...]]:
    sl = list(slices)
    for i in range(len(sl) - 1):
        for d in (granularity, -granularity, 4 * granularity, -4 * granularity):
            s = sl[:]
            s[i] += d
            s[i + 1] -= d
            if s[i] > 0 and s[i + 1] > 0:
                yield tuple(s)
        yield tuple(sl[:i] + [sl[i] + sl[i + 1]] + sl[i + 2:])
    for i, n in enumerate(sl):
        half = (n // 2 // granularity) * granularity
        if half > 0:
            yield tuple(sl[:i] + [half, n - half] + sl[i + 1:])


class _Search:
    def __init__(self, evaluate: Evaluate, granularity: int, feasible: Callable[[tuple[int, ...]], bool],
                 max_evals: int, deadline: float):
        self.evaluate, self.granularity, self.feasible = evaluate, granularity, feasible
        self.max_evals, self.deadline = max_evals, deadline
        self.evals = 0
        self._feasible: dict[tuple[int, ...], bool] = {}

    def spent(self) -> bool:
        return self.evals >= self.max_evals or time.perf_counter() >= self.deadline

    def ok(self, bounds: tuple[int, ...]) -> bool:
        if bounds not in self._feasible:
            self._feasible[bounds] = self.feasible(bounds)
        return self._feasible[bounds]

    def moves(self, bounds: tuple[int, ...], slices: tuple[int, ...]) -> Iterator[Move]:
        for b in _cut_moves(bounds, CUT_STEPS):
            if self.ok(b):
                yield b, slices
        for s in _slice_moves(slices, self.granularity):
            yield bounds, s

    def score(self, bounds: tuple[int, ...], slices: tuple[int, ...]) -> float:
        self.evals += 1
        return self.evaluate(bounds, slices)

    def climb(self, makespan: float, bounds: tuple[int, ...], slices: tuple[int, ...]):
        """First-improvement hill climb: take the first better neighbour, look again from there."""
        improved = True
        while improved and not self.spent():
            improved = False
            for b, s in self.moves(bounds, slices):
                if self.spent():
                    break
                t = self.score(b, s)
                if t < makespan - 1e-12:
                    makespan, bounds, slices, improved = t, b, s, True
                    break
        return makespan, bounds, slices

    def kick(self, bounds: tuple[int, ...], slices: tuple[int, ...], rng: random.Random) -> Move:
        for _ in range(rng.randint(*KICK_MOVES)):
            bounds, slices = rng.choice(list(self.moves(bounds, slices)))
        return bounds, slices


def refine(evaluate: Evaluate, bounds: tuple[int, ...], slices: tuple[int, ...], *, granularity: int = 16,
           feasible: Callable[[tuple[int, ...]], bool] = lambda b: True, max_evals: int = 4000,
           time_budget_s: float = 5.0, patience: int = PATIENCE,
           seed: int = 0) -> tuple[float, tuple[int, ...], tuple[int, ...]]:
    """Iterated local search of (cuts, slices) for a lower ``evaluate``; returns (makespan, bounds, slices)."""
    search = _Search(evaluate, granularity, feasible, max_evals, time.perf_counter() + time_budget_s)
    best = search.climb(search.score(bounds, slices), bounds, slices)
    rng = random.Random(seed)
    stale = 0
    while stale < patience and not search.spent():
        b, s = search.kick(best[1], best[2], rng)
        found = search.climb(search.score(b, s), b, s)
        if found[0] < best[0] - 1e-12:
            best, stale = found, 0
        else:
            stale += 1
    return best
