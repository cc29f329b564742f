"""Where could Seesaw's two layouts pay on clusters made of this machine's cores? A planner sweep.

    hpipe profile --cluster clusters/local-3.yaml --model smollm2-135m --max-len 4096 -o local-3.json
    python benchmarks/seesaw_sweep.py --profile local-3.json [--prompt 1500 --output 192] [--top 5]

A machine's daemons can differ only in what cgroups and ``tc`` give them: a share of the cores (a
daemon's measured grids scaled, which slows its prefill and its decode alike) and its links (rate
and delay, which slow prefill's prompt-sized transfers far more than decode's one-token ones). To
these it adds what another CPU could bring: a daemon whose prompt slices are 2 or 4 times slower
at the same decode speed. This takes a measured profile and, for every combination of per-daemon
compute factors, one daemon's slower prefill (or none) and one daemon behind a slower link (or
none), asks the planner (:func:`planner.seesaw.seesaw`, pure, no daemons)
how Seesaw's throughput compares with the best single layout's for the request mix: at the batch
the layouts' pools hold, with every request of a workload in one phase (``--batch``: what a host
tier that holds them all allows, the most a switch can be spread over), and with a switch that
costs nothing (the two layouts' disagreement alone). It prints the best cases and the largest
gain found. It does not price what the planner leaves out (a single layout's
decode batch shrinking under memory pressure, which the runtime's parking does win back: see
docs/decisions/seesaw.md).
"""

import argparse
import itertools
import time
from dataclasses import replace

from hpipe.app.inputs import load_profile
from planner.costs import CostModel, Workload
from planner.seesaw import seesaw
from planner.serving import Mix

#: compute factors tried per daemon (2: half the core share it was measured with)
FACTORS = (1.0, 1.5, 2.0, 3.0)
#: links tried for the daemon behind a slower one: (bits a second, one-way delay in seconds)
LINKS = tuple((rate, 0.005) for rate in (100e6, 50e6, 20e6, 10e6, 5e6))
#: prefill-only factors tried on one daemon at a time (its decode unchanged): a CPU without the
#: others' fast GEMM for prompt slices (no bfloat16 or VNNI, say) decodes as fast from memory
PREFILL_FACTORS = (2.0, 4.0)


def prefill_slower(profile, name: str, factor: float):
    """``profile`` with ``name``'s slices of more than one token ``factor`` times slower."""
    def grid(g):
        seconds = tuple(tuple(tuple(t * (factor if n > 1 else 1.0) for t in row) for n, row in zip(g.tokens, plane))
                        for plane in g.seconds)
        return replace(g, seconds=seconds)
    daemons = tuple(replace(d, compute={k: grid(g) for k, g in d.compute.items()}) if d.name == name else d
                    for d in profile.daemons)
    return replace(profile, daemons=daemons)


def far(profile, name: str, rate_bps: float, delay_s: float):
    """``profile`` with every link to and from ``name`` at ``rate_bps`` bits a second and ``delay_s``."""
    links = tuple(replace(l, bandwidth_Bps=min(l.bandwidth_Bps, rate_bps / 8), latency_s=max(l.latency_s, delay_s))
                  if name in (l.src, l.dst) else l for l in profile.links)
    return replace(profile, links=links)


def cases(profile):
    names = [d.name for d in profile.daemons]
    slower = [(None, 1.0)] + list(itertools.product(names, PREFILL_FACTORS))
    for factors, (who, k) in itertools.product(itertools.product(FACTORS, repeat=len(names)), slower):
        scaled = profile.scaled(dict(zip(names, factors)))
        if who is not None:
            scaled = prefill_slower(scaled, who, k)
        yield factors, who and (who, k), None, scaled
        for name, (rate, delay) in itertools.product(names, LINKS):
            yield factors, who and (who, k), (name, rate, delay), far(scaled, name, rate, delay)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--prompt", type=int, default=1500, help="mean prompt tokens (the issue's mix: 1,000-2,000)")
    ap.add_argument("--output", type=int, default=192, help="mean answer tokens (128-256)")
    ap.add_argument("--decode-batch", type=int, default=16)
    ap.add_argument("--batch", type=int, default=64, help="requests in one phase where a host tier holds them")
    ap.add_argument("--top", type=int, default=5)
    args = ap.parse_args()
    profile = load_profile(args.profile)
    work = Workload(args.prompt, 1, args.prompt + args.output)
    mix = Mix(args.prompt, args.output, args.decode_batch)
    t0, rows = time.perf_counter(), []
    for factors, slow_prefill, link, prof in cases(profile):
        cost = CostModel(prof)
        pooled = seesaw(cost, work, mix, break_even=False)
        tiered = seesaw(cost, work, mix, max(args.batch, pooled.batch), break_even=False)
        best = min(t for way, t in tiered.request_s.items() if way != "seesaw")
        free = best / (tiered.phase_s["prefill"] + tiered.phase_s["decode"])  # a switch that cost nothing
        rows.append((tiered.gain, pooled.gain, free, (factors, slow_prefill), link, tiered))
    rows.sort(key=lambda r: -r[0])
    names = [d.name for d in profile.daemons]
    print(f"{len(rows)} clusters from {args.profile} ({', '.join(names)}), requests of {args.prompt} + "
          f"{args.output} tokens, {time.perf_counter() - t0:.0f} s")
    print("seesaw / best single layout: tiered batch, pools' batch, free switch | compute factors, slower prefill | "
          "slower link | layouts")
    for gain, pooled, free, factors, link, s in rows[:args.top]:
        where = "none" if link is None else f"{link[0]} at {link[1] / 1e6:g} Mbit/s, {link[2] * 1e3:g} ms"
        lay = lambda l: " ".join(f"{names[m]}{a}-{b}" for m, a, b in l.stages())  # noqa: E731
        print(f"  {gain:5.3f} {pooled:5.3f} {free:5.3f} | {factors} | {where} | prefill {lay(s.prefill)}; decode "
              f"{lay(s.decode)}; switch {s.switch.seconds:.2f} s for {s.batch}")
    free = max(rows, key=lambda r: r[2])
    print(f"with a switch that cost nothing, at most {free[2]:.3f}x: {free[3]} | "
          f"{'none' if free[4] is None else f'{free[4][0]} at {free[4][1] / 1e6:g} Mbit/s'}")
    paying = sum(r[0] >= 1.2 for r in rows)
    print(f"largest gain {rows[0][0]:.3f}x; {paying} of {len(rows)} clusters at 1.2x or more; "
          f"{sum(r[0] > 1.0 for r in rows)} above 1.0x")


if __name__ == "__main__":
    main()
