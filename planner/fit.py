"""A measured MLP grid, read through a straight line where one fits: the planner's defence against noise.

Each grid point of a measured profile is the median of a few sweeps, and on a shared machine one
point can read 10% off its neighbours. A search over slicings then picks the slice lengths whose
points read fast by chance, and predicts low. An MLP's time is ``a + b * s`` in the slice length
``s`` once ``s`` is past the small sizes where fixed costs dominate, so the planner reads the long
end of each device's MLP grid through a weighted least-squares line: a point's noise is spread over
all the points the line is fitted to.

Only CPU grids are read this way. A GPU's MLP is memory-bound up to some length and compute-bound
after it, and a line through the bend would be off by up to ``TOLERANCE`` exactly where the planner
likes to cut slices; its grid is also far less noisy (no shared cores). Simulated profiles are
noise-free. Both are left as they are. On a CPU grid, the longest run of long-slice points that one
line fits to within ``TOLERANCE`` is replaced by the line, and the points below it are kept as
measured; if no four points fit, the grid is left as it is.

Cross-validated on seventeen profiles of ``clusters/emulated-hetero.yaml`` (each plan simulated on
the per-point median of the other sixteen, ``benchmarks/plan_noise.py``): plain chains 0.755 ->
0.755 (ideal / simulated), interleaved chains 0.809 -> 0.829. Fitting attention as well did worse
than the MLP alone. But live, side by side on one fresh profile (docs/benchmarks.md, "Ninth day"),
the fitted plans ran slower: plain 4.70 / 4.42 s against 3.87 / 4.06 s unfitted.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from profiler.schema import ComputeGrid, Profile

#: the largest relative residual a point may have for the line to stand for it
TOLERANCE = 0.15
#: the fewest points a line is fitted to
MIN_POINTS = 4
#: the shortest slice a line may stand for: below it fixed costs bend the curve (on the CPU the
#: 1- and 16-token points fit a line too, but they pull its slope where the planner cuts slices)
MIN_TOKENS = 64
#: unit kinds read through a line (attention depends on context, and fitting it did worse)
FITTED_KINDS = ("mlp",)


def line_fit(tokens, seconds) -> np.ndarray | None:
    """``seconds`` with the longest fitting tail replaced by the line, or None if no tail fits.

    The line minimises relative squared error (each point weighted by its own inverse), so long
    slices do not outweigh short ones.
    """
    t = np.asarray(tokens, dtype=float)
    y = np.asarray(seconds, dtype=float)
    for i0 in range(int(np.searchsorted(t, MIN_TOKENS)), len(t) - MIN_POINTS + 1):
        ts, ys = t[i0:], y[i0:]
        if np.any(ys <= 0):
            continue
        x = np.stack([np.ones_like(ts), ts], axis=1)
        w = 1.0 / ys
        coef, *_ = np.linalg.lstsq(x * w[:, None], ys * w, rcond=None)
        fitted = x @ coef
        if np.all(fitted > 0) and np.max(np.abs(fitted / ys - 1.0)) <= TOLERANCE:
            out = y.copy()
            out[i0:] = fitted
            return out
    return None


def fitted_grid(grid: ComputeGrid) -> ComputeGrid:
    """``grid`` with each (batch, context) column along the tokens read through a line where one fits."""
    sec = np.asarray(grid.seconds, dtype=float)
    changed = False
    for b in range(sec.shape[0]):
        for c in range(sec.shape[2]):
            got = line_fit(grid.tokens, sec[b, :, c])
            if got is not None:
                sec[b, :, c] = got
                changed = True
    if not changed:
        return grid
    return ComputeGrid(grid.batches, grid.tokens, grid.contexts,
                       tuple(tuple(tuple(float(x) for x in col) for col in plane) for plane in sec))


def fitted_profile(profile: Profile) -> Profile:
    """The profile the planner reads: measured CPU MLP grids through their lines, all else as measured."""
    if profile.source != "measured":
        return profile
    devices = tuple(replace(d, compute={k: fitted_grid(g) if k in FITTED_KINDS else g for k, g in d.compute.items()})
                    if d.device == "cpu" else d for d in profile.devices)
    return replace(profile, devices=devices)
