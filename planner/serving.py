"""A split for serving many requests: every daemon gets an equal share of a request mix's work.

HPipe's split (Algorithm 1) balances the stages of one long document's prefill, where a device's
time grows with its compute speed. Serving many requests mixes that with decode, where every
token reads the weights of every stage and a device's time grows with its share of the weights:
a split that gives the fastest device most layers for the prefill makes it the bottleneck of the
decode (on ``clusters/emulated-hetero.yaml`` the fast daemon was busy 95% of a 64-request run and
the slow one 71%). Under load every daemon is busy at once, so what bounds throughput is the
busiest daemon's work per request, summed over its stages:

    W(m, a, b) = prefill of a ``prompt``-token request in ``chunk``-token pieces on units [a, b)
               + ``output`` decode tokens, each a ``1 / decode_batch`` share of a micro-batch
                 of ``decode_batch`` tokens at the request's mean context

and the split that minimises ``max_m W`` is the same min-max DP as Algorithm 1 over these
per-request times (:func:`planner.cuts.min_max_cuts`). The grids are used as measured: they
describe each device with its neighbours busy, which is what serving is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from planner.costs import CostModel, Workload
from planner.cuts import Cuts, comm_matrix, count_matrices, min_max_cuts, stage_table

PHASES = ("prefill", "decode", "both")


@dataclass(frozen=True)
class Mix:
    """The mean request a serving split is made for."""
    prompt: int          # prompt tokens
    output: int          # answer tokens
    decode_batch: int = 16   # decode tokens in one micro-batch (of as many sequences)
    chunk: int = 256     # prefill tokens in one micro-batch

    def __post_init__(self) -> None:
        if min(self.prompt, self.decode_batch, self.chunk) < 1 or self.output < 0:
            raise ValueError(f"a serving mix needs positive lengths and batch: {self}")


def unit_work(cost: CostModel, dev: int, mix: Mix, phase: str = "both") -> np.ndarray:
    """Seconds one mean request costs on ``dev``, per unit kind: ``[embed, attn, mlp, head]``; its
    ``phase``: ``prefill``, ``decode`` or ``both`` (their sum)."""
    if phase not in PHASES:
        raise ValueError(f"a request's phase is one of {', '.join(PHASES)}, not {phase!r}")
    g = cost.daemons[dev].compute
    n = math.ceil(mix.prompt / mix.chunk)
    s = np.array([min(mix.chunk, mix.prompt - i * mix.chunk) for i in range(n)], dtype=float)
    c = np.arange(n, dtype=float) * mix.chunk
    b = float(mix.decode_batch)
    ctx = mix.prompt + mix.output / 2
    per_token = mix.output / b  # a request's share of decode micro-batches

    def decode(kind: str) -> float:
        return per_token * g[kind].time(b, ctx if kind == "attn" else 0, 1)

    prefill = np.array([
        float(g["embed"].times(s, c, 1).sum()),
        float(g["attn"].times(s, c, 1).sum()),
        float(g["mlp"].times(s, np.zeros_like(c), 1).sum()),
        # the head computes the logits of each sampled row: the prompt's last, then each answer token's
        g["head"].time(1, 0, 1),
    ])
    decoding = np.array([decode(kind) for kind in ("embed", "attn", "mlp", "head")])
    return {"prefill": prefill, "decode": decoding, "both": prefill + decoding}[phase]


def serving_table(cost: CostModel, work: Workload, mix: Mix, phase: str = "both") -> np.ndarray:
    """``W[m, a, b]``: seconds of one mean request (its ``phase``: :func:`unit_work`) on units
    [a, b) of device m (inf where they do not fit)."""
    counts = count_matrices(cost.L)
    fits = np.isfinite(stage_table(cost, work))
    table = np.full(fits.shape, math.inf)
    for m in range(len(cost.daemons)):
        w = unit_work(cost, m, mix, phase)
        t = sum(k * w[i] for i, k in enumerate(counts))
        table[m][fits[m]] = t[fits[m]]
    return table


def serving_cuts(cost: CostModel, table: np.ndarray, mix: Mix) -> Cuts:
    """The contiguous split (devices chosen and ordered) whose busiest daemon does the least per
    request, from the mix's :func:`serving_table`."""
    comm = comm_matrix(cost, mix.prompt + mix.output, 1)
    return min_max_cuts(table, comm, list(range(len(cost.daemons))), cost.num_units)


def daemon_loads(cost: CostModel, table: np.ndarray, bounds, devices) -> dict[str, float]:
    """Seconds of one mean request on each daemon of a split (its stages summed), from the mix's
    :func:`serving_table`: the busiest bounds serving throughput."""
    loads: dict[str, float] = {}
    for j, (a, b) in enumerate(zip(bounds, bounds[1:])):
        name = cost.daemons[devices[j]].name
        loads[name] = loads.get(name, 0.0) + float(table[devices[j], a, b])
    return loads
