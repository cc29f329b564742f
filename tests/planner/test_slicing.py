"""Algorithm 2's DP equals brute force over all slicings of small lengths."""

import itertools
import math
import random

import numpy as np

from hpipe.core.plan import fit_slices, uniform
from planner.costs import CostModel
from planner.slicing import CostStage, slice_times, slicing_table
from tests.planner.synthetic import make_profile


def compositions(n):
    for k in range(1, n + 1):
        for cut in itertools.combinations(range(1, n), k - 1):
            bounds = (0, *cut, n)
            yield [b - a for a, b in zip(bounds, bounds[1:])]


def test_table_is_optimal_for_its_objective():
    rng = random.Random(3)
    profile = make_profile(rng, n=3, layers=2)
    cost = CostModel(profile)
    stages = [CostStage(0, 0, 2, 1), CostStage(1, 2, 4, 2), CostStage(2, 4, 6, None)]
    g, levels = 16, 64
    table = slicing_table(cost, stages, 9 * g, batch=1, granularity=g, levels=levels)

    def cost_of(sl):
        c, per = 0, []
        for s in sl:
            per.append(float(slice_times(cost, stages, [s * g], [c * g], 1).max()))
            c += s
        return per

    all_h = []
    for p in range(1, 10):
        for s in range(1, p + 1):
            all_h.append(float(slice_times(cost, stages, [s * g], [(p - s) * g], 1).max()))
    t_levels = np.unique(np.geomspace(min(all_h), max(all_h), levels))
    for p in range(1, 10):
        best = math.inf
        for sl in compositions(p):
            per = cost_of(sl)
            for t in t_levels:
                if max(per) <= t:
                    best = min(best, sum(per) + 2 * t)
        assert math.isclose(table.estimate[p * g], best, rel_tol=1e-9), p
        assert sum(table.slices[p * g]) == p * g


def test_fit_and_uniform():
    assert fit_slices((64, 32, 32), 100) == [64, 32, 4]
    assert fit_slices((64,), 10) == [10]
    assert uniform(10, 3) == [4, 3, 3] and sum(uniform(2048, 7)) == 2048
