"""Link measurement: time Probe calls carrying activation-sized payloads, fit latency + bytes/bandwidth.

The probes travel over the same gRPC transport (channel options, TLS, token) that carries
activations between daemons, so what is measured is what slices will see.
"""

from __future__ import annotations

import random
import statistics
import time

import numpy as np


def time_probes(send, sizes: list[int], repeats: int) -> list[float]:
    """Median seconds of ``send(payload)`` for each payload size.

    Every size is sent once to warm the channel, then ``repeats`` rounds each send every size
    once in shuffled order, so slow drift on the link affects all sizes alike instead of biasing
    whichever size happened to be measured during it.
    """
    payloads = [b"\x5a" * n for n in sizes]
    for p in payloads:
        send(p)
    samples: list[list[float]] = [[] for _ in sizes]
    order = list(range(len(sizes)))
    rng = random.Random(len(sizes) * 7919 + repeats)
    for _ in range(repeats):
        rng.shuffle(order)
        for i in order:
            t0 = time.perf_counter()
            send(payloads[i])
            samples[i].append(time.perf_counter() - t0)
    return [statistics.median(s) for s in samples]


def fit_link(sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """Least-squares fit of ``seconds = latency + size / bandwidth`` (relative error weighted).

    Weighting each point by 1/seconds makes the fit accurate in relative terms across sizes
    that span three orders of magnitude. Returns (latency s, bandwidth bytes/s).
    """
    x = np.asarray(sizes, dtype=float)
    y = np.asarray(seconds, dtype=float)
    w = 1.0 / np.maximum(y, 1e-9)
    a = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (lat, inv_bw), *_ = np.linalg.lstsq(a, y * w, rcond=None)
    inv_bw = max(inv_bw, 1e-15)  # bandwidth cannot be infinite or negative
    lat = max(lat, 0.0)
    return float(lat), float(1.0 / inv_bw)
