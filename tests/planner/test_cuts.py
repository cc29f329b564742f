"""The layer-cut DP equals brute force over device orders, subsets and cut positions."""

import itertools
import math
import random

import pytest

import planner.cuts as cuts_mod
from hpipe.core.units import kind_counts
from planner.costs import CostModel, Workload
from planner.cuts import InfeasibleError, best_cuts, bottleneck_of, count_matrices
from tests.planner.synthetic import make_profile


def brute_force(cost, work, order_fixed=None):
    u, n = cost.num_units, len(cost.daemons)
    best = math.inf
    orders = [order_fixed] if order_fixed else None
    for k in range(1, n + 1):
        seqs = (itertools.permutations(range(n), k) if orders is None
                else itertools.combinations(order_fixed, k))
        for devs in seqs:
            for cut in itertools.combinations(range(1, u), k - 1):
                bounds = (0, *cut, u)
                best = min(best, bottleneck_of(cost, work, bounds, devs))
    return best


@pytest.mark.parametrize("seed", range(8))
def test_subset_dp_equals_brute_force(seed):
    rng = random.Random(seed)
    profile = make_profile(rng, n=rng.randint(1, 4), layers=rng.randint(1, 3))
    cost = CostModel(profile)
    work = Workload(seq_len=rng.choice([64, 512, 2048]), batch=1)
    result = best_cuts(cost, work)
    assert result.bounds[0] == 0 and result.bounds[-1] == cost.num_units
    assert math.isclose(bottleneck_of(cost, work, result.bounds, result.daemons), result.bottleneck, rel_tol=1e-9)
    assert math.isclose(result.bottleneck, brute_force(cost, work), rel_tol=1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_ordered_dp_equals_brute_force_in_that_order(seed, monkeypatch):
    rng = random.Random(100 + seed)
    profile = make_profile(rng, n=4, layers=2)
    cost = CostModel(profile)
    work = Workload(seq_len=256)
    monkeypatch.setattr(cuts_mod, "EXACT_DEVICES", 1)  # force the fixed-order path
    result = best_cuts(cost, work)
    order = sorted(range(4), key=lambda m: cost.stage_time(m, 0, cost.num_units, 256, 0, 1))
    assert math.isclose(result.bottleneck, brute_force(cost, work, order_fixed=order), rel_tol=1e-9)


def test_memory_is_respected_and_devices_are_left_out():
    rng = random.Random(7)
    profile = make_profile(rng, n=3, layers=2)
    cost = CostModel(profile)
    work = Workload(seq_len=128)
    result = best_cuts(cost, work)
    for j, (a, b) in enumerate(zip(result.bounds, result.bounds[1:])):
        assert cost.fits(result.daemons[j], a, b, work)


def test_model_that_fits_nowhere_names_the_shortfall():
    profile = make_profile(random.Random(1), n=2, layers=2, memory=1000)
    with pytest.raises(InfeasibleError, match="does not fit.*GiB"):
        best_cuts(CostModel(profile), Workload(seq_len=64))


def test_count_matrices_match_unit_counts():
    e, at, ml, h = count_matrices(3)
    for a in range(8):
        for b in range(a + 1, 9):
            assert (e[a, b], at[a, b], ml[a, b], h[a, b]) == kind_counts(a, b, 3)
