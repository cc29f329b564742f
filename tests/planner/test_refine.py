"""The local search: never worse, deterministic, and able to move work between any two stages."""

import random

from planner.refine import refine


def _valley(bounds, slices):
    """Best at cuts (3, 6); any schedule whose middle stage is not 3 units wide is far worse."""
    _, a, b, _ = bounds
    return abs(a - 3) + abs(b - 6) + (0 if b - a == 3 else 10) + 0.01 * len(slices)


def test_moves_work_between_stages_that_single_cut_moves_cannot():
    """From cuts (5, 8) every single-cut move widens or narrows the middle stage (worse); moving both
    cuts together, which moves units from the last stage to the first, reaches the best."""
    makespan, bounds, _ = refine(_valley, (0, 5, 8, 10), (16,), patience=0)
    assert bounds == (0, 3, 6, 10)
    assert makespan == _valley(bounds, (16,))


def test_never_worse_and_deterministic():
    rng = random.Random(3)
    target = [rng.randint(1, 60) for _ in range(8)]

    def bumpy(bounds, slices):  # many local minima over the slices
        return sum(abs(s - t) + 5 * (s % 48 == 0) for s, t in zip(slices, target)) + 7 * abs(len(slices) - 8)

    start = (0, 4, 10), (32,) * 8
    runs = [refine(bumpy, *start, max_evals=3000) for _ in range(2)]
    assert runs[0] == runs[1]
    assert runs[0][0] <= bumpy(*start)
    climb_only = refine(bumpy, *start, max_evals=3000, patience=0)
    assert runs[0][0] <= climb_only[0]  # the kicks never lose what the first climb found
    assert sum(runs[0][2]) == sum(start[1])  # slices keep the sequence length


def test_infeasible_cuts_are_never_taken():
    makespan, bounds, _ = refine(_valley, (0, 5, 8, 10), (16,), feasible=lambda b: b[1] >= 4)
    assert bounds[1] >= 4
