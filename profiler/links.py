"""Link measurement: time probes carrying activation-sized payloads, fit latency + bytes/bandwidth.

The probes travel over the data plane (:mod:`runtime.wire.transport`: a daemon-to-daemon data
connection, its TLS and token) that carries activations between daemons, so what is measured is
what slices will see.
"""

from __future__ import annotations

import random
import statistics
import time

import numpy as np

#: the largest probe payload (the profiler's and what a daemon accepts)
MAX_PROBE_BYTES = 32 << 20


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


#: seconds a link's probes may take, each direction, by a first rough estimate of its rate: on a
#: fast link every size and repeat fits; on a Wi-Fi-class one (20 Mbit/s) all of them would take
#: minutes per pair, so fewer rounds and then fewer of the largest sizes are sent
LINK_PROBE_BUDGET_S = 10.0
#: a pilot probe's bytes, sent once to estimate the rate
PILOT_BYTES = 1 << 20


def fit_probes(sizes: list[int], repeats: int, bytes_per_s: float, budget_s: float = LINK_PROBE_BUDGET_S,
               min_repeats: int = 7, min_sizes: int = 3) -> tuple[list[int], int]:
    """The probe ``sizes`` (ascending) and ``repeats`` that fit ``budget_s`` on a link of about
    ``bytes_per_s`` (:func:`time_probes` sends every size ``repeats + 1`` times): rounds first
    go down to ``min_repeats``, then the largest sizes go, down to ``min_sizes``."""
    def seconds(s: list[int], r: int) -> float:
        return (r + 1) * sum(s) / bytes_per_s

    sizes = sorted(sizes)
    while repeats > min_repeats and seconds(sizes, repeats) > budget_s:
        repeats -= 1
    while len(sizes) > min_sizes and seconds(sizes, repeats) > budget_s:
        sizes = sizes[:-1]
    return sizes, repeats


def fit_link(sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """``seconds = latency + size / bandwidth``: bandwidth from the larger sizes, latency from the smallest.

    Bandwidth is the least-squares slope over the upper half of the sizes: activation transfers
    are what the planner needs right, and small messages can pass faster than the link's rate (a
    ``tc tbf`` bucket lets its burst through at line rate: on a 100 Mbit/s link a 37 KB probe
    moved at 16 MB/s, every probe from 147 KB up at 11.4-12.9 MB/s, and a fit that let the small
    ones pull the slope said 13.7). Latency is what the smallest message took beyond its bytes.
    Returns (latency s, bandwidth bytes/s).
    """
    pts = sorted(zip((float(x) for x in sizes), (float(y) for y in seconds)))
    big = pts[len(pts) // 2:] if len(pts) >= 4 else pts
    x = np.array([p[0] for p in big])
    y = np.array([p[1] for p in big])
    if len(big) >= 2 and np.ptp(x) > 0:
        inv_bw = float(np.polyfit(x, y, 1)[0])
    else:
        inv_bw = float(y[-1] / max(x[-1], 1.0))
    inv_bw = max(inv_bw, 1e-15)  # bandwidth cannot be infinite or negative
    lat = max(pts[0][1] - pts[0][0] * inv_bw, 0.0)
    return float(lat), float(1.0 / inv_bw)


#: slice sizes (tokens) at which a link's host CPU cost is measured: per message + per byte
HOST_CPU_TOKENS = (16, 512)


def fit_host_cpu(sizes: list[int], messages: list[int], cpu_seconds: list[float]) -> tuple[float, float]:
    """``cpu_seconds[i] = messages[i] * (per_message + sizes[i] * per_byte)``, least squares (exact
    through two sizes); each term clamped at 0, since a noisy difference can come out negative.
    Returns (seconds per message, seconds per byte)."""
    x = np.array(sizes, dtype=float)
    y = np.array(cpu_seconds, dtype=float) / np.maximum(np.array(messages, dtype=float), 1.0)
    if len(x) >= 2 and np.ptp(x) > 0:
        per_byte, per_message = (float(v) for v in np.polyfit(x, y, 1))
        if per_message >= 0:
            return per_message, max(per_byte, 0.0)
    # one size, or a negative per-message part: the line through the origin
    return 0.0, max(float(np.dot(x, y) / max(float(np.dot(x, x)), 1.0)), 0.0)
