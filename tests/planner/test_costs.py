"""The cost model's lookups."""

import random

import numpy as np

from planner.costs import CostModel
from tests.planner.synthetic import make_profile


def test_remembered_unit_times_equal_the_grids():
    """The cost model remembers short item arrays' unit times; they must be the grids' values, and
    callers adding to what it returns must not change what it remembers."""
    profile = make_profile(random.Random(0), n=2, layers=3)
    cost = CostModel(profile)
    s = np.array([16.0, 100.0, 300.0])
    c = np.array([0.0, 16.0, 116.0])
    first = cost.stage_times(1, 0, cost.num_units, s, c, 1)
    again = cost.stage_times(1, 0, cost.num_units, s, c, 1)
    grids = profile.daemons[1].compute
    direct = (grids["embed"].times(s, c, 1) + 3 * grids["attn"].times(s, c, 1)
              + 3 * grids["mlp"].times(s, 0 * c, 1) + grids["head"].time(1, 0, 1))
    np.testing.assert_allclose(first, direct)
    np.testing.assert_array_equal(first, again)
    first += 1.0
    np.testing.assert_array_equal(cost.stage_times(1, 0, cost.num_units, s, c, 1), again)
