import random
from dataclasses import replace

import numpy as np
import pytest

from planner.costs import Workload
from planner.fit import MIN_TOKENS, TOLERANCE, fitted_grid, fitted_profile, line_fit
from planner.plan import Plan
from planner.strategies import plan
from profiler.schema import ComputeGrid
from tests.planner.synthetic import make_profile

TOKENS = (1, 16, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)


def test_a_line_through_noisy_points_stands_for_them_and_short_slices_stay_measured():
    t = np.array(TOKENS, dtype=float)
    true = 2e-3 + 1e-5 * t
    long = t >= MIN_TOKENS
    gains = []
    for seed in range(20):
        rng = np.random.default_rng(seed)
        noisy = true * (1 + rng.uniform(-0.08, 0.08, len(t)))
        noisy[:2] *= 3  # fixed costs bend the short end
        got = line_fit(TOKENS, noisy)
        assert np.array_equal(got[~long], noisy[~long])
        rms = lambda y: float(np.sqrt(np.mean((y[long] / true[long] - 1) ** 2)))  # noqa: E731
        gains.append(rms(got) / rms(noisy))
    # the line is closer to the truth than the points were, over the long end (0.42 on average)
    assert np.mean(gains) < 0.6


def test_a_bent_curve_is_fitted_only_where_one_line_holds():
    # flat while memory-bound, then linear once compute-bound: only the long end takes the line
    t = np.array(TOKENS, dtype=float)
    y = np.maximum(1e-3, 2e-6 * t)
    got = line_fit(TOKENS, y)
    assert np.array_equal(got[t < 256], y[t < 256])
    assert np.abs(got / y - 1).max() <= TOLERANCE


def test_no_line_no_change():
    rng = np.random.default_rng(1)
    wild = rng.uniform(1e-3, 1e-2, len(TOKENS))
    assert line_fit(TOKENS, wild) is None
    grid = ComputeGrid((1,), TOKENS, (0,), (tuple((float(x),) for x in wild),))
    assert fitted_grid(grid) is grid


def test_every_fitted_point_is_within_the_tolerance_of_its_measurement():
    rng = np.random.default_rng(2)
    for _ in range(50):
        t = np.array(TOKENS, dtype=float)
        y = (rng.uniform(1e-4, 1e-2) + rng.uniform(1e-7, 1e-4) * t) * (1 + rng.uniform(-0.15, 0.15, len(t)))
        got = line_fit(TOKENS, y)
        if got is not None:
            assert np.all(np.abs(got / y - 1) <= TOLERANCE + 1e-12) and np.all(got > 0)


def _noisy(profile, seed):
    rng = random.Random(seed)
    devices = []
    for d in profile.devices:
        g = d.compute["mlp"]
        secs = tuple(tuple(tuple(x * rng.uniform(0.9, 1.1) for x in col) for col in plane) for plane in g.seconds)
        devices.append(replace(d, compute={**d.compute, "mlp": ComputeGrid(g.batches, g.tokens, g.contexts, secs)}))
    return replace(profile, devices=tuple(devices))


def test_only_measured_mlp_grids_are_fitted():
    measured = _noisy(make_profile(random.Random(3), n=2), seed=3)
    fitted = fitted_profile(measured)
    for a, b in zip(measured.devices, fitted.devices):
        assert a.compute["mlp"] != b.compute["mlp"]
        assert all(a.compute[k] == b.compute[k] for k in ("embed", "attn", "head"))
    simulated = replace(measured, source="simulated")
    assert fitted_profile(simulated) is simulated
    gpu = replace(measured, devices=tuple(replace(d, device="cuda:0") for d in measured.devices))
    assert fitted_profile(gpu).devices == gpu.devices


@pytest.mark.parametrize("fit", [True, False])
def test_a_plan_says_how_it_read_the_profile_and_its_bound_is_the_profiles_own(fit):
    profile = _noisy(make_profile(random.Random(5), n=3, layers=2), seed=5)
    work = Workload(512)
    p = plan(profile, work, fit=fit)
    again = Plan.from_json(p.to_json())
    assert again.fitted is fit
    assert p.ideal_s == plan(profile, work, fit=not fit).ideal_s
