"""The compute grid a daemon measures: which slice lengths, contexts and batches, how many sweeps.

A device's time per unit is measured on a grid of (batch, tokens, context) points, and the planner
interpolates between them (:class:`hpipe.core.profile.ComputeGrid`). The grid is dense where costs
bend (small slices, block boundaries) and reaches ``max_len``; attention alone varies with context.
"""

from __future__ import annotations

from hpipe.core.errors import HpipeError
from hpipe.core.profile import ComputeGrid

#: bumped when how a daemon measures changes, so that cached grids measured the old way are not reused
METHOD = 8  # 6: quantized prefill rows marked as a stage marks them (bfloat16 where the prefill is); 7: long points
# 8: one-token points through the C++ decode kernel where a daemon decodes through it
#: passes over the compute grid (each point's median is over these). Noise picks plans: on the
#: emulated cluster, plans from 3-sweep profiles re-simulated on the median of ten others took
#: 4.42 s on average (1.00-1.20x their prediction), from 9-sweep ones 4.15 s (0.95-1.04x).
#: See docs/decisions/profile-sweeps.md.
SWEEPS = 7
#: the longest input profiled when none is asked for. Beyond it the planner extrapolates attention
#: linearly in context from the last two grid columns. A 2048-token profile of the emulated CPU
#: cluster took about 3.5 minutes, and the grid's cost grows about with the square of max_len.
DEFAULT_MAX_LEN = 4096
#: the shortest a short grid point is timed for in all (profiler.device.MIN_MEASURED_S), and its
#: untimed warm-up calls (profiler.device.WARMUP_CALLS), for the estimate below
_MIN_POINT_S, _WARMUP_CALLS = 0.06, 2
#: a point whose first (warm-up) call takes this long is a long point: one warm-up call, and timed
#: in the first ``LONG_SWEEPS`` sweeps only. One call of it already averages over a second of its
#: neighbours' phases and the machine's drift, which is what the sweeps of short points are for,
#: and a billion-parameter block's long slices made most of a profile's time: up to 4,096 tokens,
#: an 8B's grid forecast 41 minutes on local-3 with every point timed 9 times (stop 76).
LONG_CALL_S, LONG_SWEEPS = 1.0, 3

#: slice lengths whose successor is a grid point too, so that a kernel whose cost steps up just past
#: a block boundary reads as a step, not as a ramp over the whole next interval. Measured on the
#: 2-core Xeon VM (SmolLM2 fp32 MLP, MKL, one thread, 7 sweeps): 128 -> 129 tokens cost 13% more,
#: 512 -> 513 7.5%, and from 129 to 256 the cost is a line again; with no point at 129, slices of
#: 144-176 tokens were predicted 7-11% short. Past 512 the steps measured were 4-7% (768 -> 769: 6.6%),
#: left to interpolation: each point costs profiling time, and long slices are few.
STEP_POINTS = (128, 256, 384, 512)


def grid_axes(max_len: int, batch: int) -> tuple[list[int], list[int], list[int]]:
    # dense enough that piecewise-linear interpolation follows attention's s^2 term (~5% between points)
    tokens = {t for t in (1, 16, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192,
                          12288, 16384, 24576, 32768) if t <= max_len} | {max_len}
    tokens = sorted(tokens | {t + 1 for t in STEP_POINTS if t + 1 <= max_len})
    contexts = sorted({0, max_len // 8, max_len // 4, max_len // 2, (3 * max_len) // 4})
    batches = sorted({1, batch} | {b for b in range(1, batch + 1) if batch % b == 0})
    return batches, tokens, contexts


def grids_from_reply(d, reply) -> dict[str, ComputeGrid]:
    grids = {}
    for u in reply.units:
        nb, nt, nc = len(u.batches), len(u.tokens), len(u.contexts)
        if len(u.seconds) != nb * nt * nc or any(not (t >= 0) for t in u.seconds):
            raise HpipeError(f"daemon {d.name} ({d.address}) returned a malformed {u.kind} profile")
        secs = tuple(tuple(tuple(u.seconds[(i * nt + j) * nc + k] for k in range(nc)) for j in range(nt))
                     for i in range(nb))
        grids[u.kind] = ComputeGrid(tuple(u.batches), tuple(u.tokens), tuple(u.contexts), secs)
    missing = {"embed", "attn", "mlp", "head"} - set(grids)
    if missing:
        raise HpipeError(f"daemon {d.name} ({d.address}) returned no profile for {sorted(missing)}")
    return grids


def estimate_seconds(axes: tuple[list[int], list[int], list[int]], sweeps: int, block_s_per_token: float,
                     attention_s_per_token_context: float) -> float:
    """About how long one daemon takes to measure its grid, from a pilot timing of one block.

    ``block_s_per_token``: one block (attention + MLP) per token of a slice at context 0;
    ``attention_s_per_token_context``: what each token of context adds per token. An MLP is taken
    as 60% of a block and attention as 40% plus its context term; every point is timed once a
    sweep for at least its share of ``_MIN_POINT_S``, after ``_WARMUP_CALLS`` untimed calls (a long
    point: once, and in ``LONG_SWEEPS`` sweeps)."""
    batches, tokens, contexts = axes
    total = 0.0
    for b in batches:
        for s in tokens:
            points = [0.6 * block_s_per_token * s * b]
            points += [(0.4 * block_s_per_token * s + attention_s_per_token_context * s * (c + s / 2)) * b
                       for c in contexts]
            total += sum(_point_seconds(t, sweeps) for t in points)
    return total


def _point_seconds(call_s: float, sweeps: int) -> float:
    if call_s >= LONG_CALL_S:
        return (1 + min(sweeps, LONG_SWEEPS)) * call_s
    return sweeps * max(call_s, _MIN_POINT_S / sweeps) + _WARMUP_CALLS * call_s


def split_tokens(tokens: list[int], shares: int, cost=None) -> list[list[int]]:
    """The token axis dealt to ``shares`` identical co-located daemons, each to time its part of
    the grid beside the others (:func:`profiler.measure._group_grids`): the costliest slice length
    first, each to the share that costs least so far, so the shares take about as long. ``cost(t)``:
    seconds to time length ``t``'s points (default: ``t``). A share may be empty where there are
    more daemons than slice lengths."""
    cost = cost or float
    parts: list[list[int]] = [[] for _ in range(shares)]
    for t in sorted(tokens, key=lambda t: (cost(t), t), reverse=True):
        min(parts, key=lambda p: sum(map(cost, p))).append(t)
    return [sorted(p) for p in parts]


def merge_grids(parts: list[dict[str, ComputeGrid]]) -> dict[str, ComputeGrid]:
    """One device's grids from the parts of its token axis that several daemons timed (same
    batches and contexts in every part)."""
    out = {}
    for kind in parts[0]:
        grids = [p[kind] for p in parts]
        batches, contexts = grids[0].batches, grids[0].contexts
        if any(g.batches != batches or g.contexts != contexts for g in grids):
            raise HpipeError(f"the parts of a {kind} grid were timed on different batches or contexts")
        column = {t: (g, j) for g in grids for j, t in enumerate(g.tokens)}
        tokens = tuple(sorted(column))
        if len(tokens) != sum(len(g.tokens) for g in grids):
            raise HpipeError(f"the parts of a {kind} grid overlap")
        secs = tuple(tuple(column[t][0].seconds[i][column[t][1]] for t in tokens) for i in range(len(batches)))
        out[kind] = ComputeGrid(batches, tokens, contexts, secs)
    return out


def group_twins(group, infos) -> dict[str, list]:
    """The daemons of a share group by fingerprint: twins are the same device beside each other."""
    twins: dict[str, list] = {}
    for d in group:
        twins.setdefault(infos[d.name].fingerprint, []).append(d)
    return twins


def twin_shares(group, infos, tokens: list[int], costs: dict[str, dict[int, float]]) -> dict[str, list[int]]:
    """The slice lengths each daemon of a share group times. Twins (the same fingerprint: the same
    hardware, threads, quota and software, like ``local-3``'s three daemons) time one grid between
    them, each a share of its token axis while the others keep the machine as busy, rather than
    the whole grid each: a pipeline's stages run beside each other just so, and the grid they would
    each have measured is the same device's (they share its cache entry already)."""
    shares = {}
    for twins in group_twins(group, infos).values():
        cost = costs.get(twins[0].name)  # the forecast's estimate of each length's points, else its tokens
        shares.update(zip((d.name for d in twins), split_tokens(tokens, len(twins), cost.get if cost else None)))
    return shares
