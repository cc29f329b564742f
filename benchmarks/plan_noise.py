"""How much a profile's noise costs its plan: each profile's hpipe plan re-simulated on the others' median.

    python benchmarks/plan_noise.py P1.json P2.json ... [--seq-len 2048] [--max-ranges V]

Profiles of one cluster (same devices and grid points). For each, its plan (made as ``hpipe plan
--max-ranges-per-device V`` would) is simulated on the per-point median grid of all the *other*
profiles, a far less noisy yardstick, and printed next to its own prediction; the last line is the
mean and the worst of ideal / simulated (docs/decisions/profile-sweeps.md). The yardstick shares
whatever bias all profiles share: it cannot see how a live pipeline differs from the profiler's
measurements.
"""

from __future__ import annotations

import argparse
import copy
import json

import numpy as np

from hpipe.core.profile import Profile
from planner.costs import CostModel, Workload
from planner.strategies import MAX_RANGES, ideal_seconds, plan, simulate_schedule


def median_profile(raws: list[dict]) -> Profile:
    out = copy.deepcopy(raws[0])
    for d in out["daemons"]:
        for kind, grid in d["compute"].items():
            same = [next(x for x in r["daemons"] if x["name"] == d["name"])["compute"][kind]["seconds"] for r in raws]
            grid["seconds"] = np.median(np.array(same), axis=0).tolist()
    return Profile.from_dict(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profiles", nargs="+")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--max-ranges", type=int, default=MAX_RANGES, help="as hpipe plan --max-ranges-per-device")
    args = ap.parse_args()
    raws = [json.load(open(p)) for p in args.profiles]
    work = Workload(args.seq_len, 1, args.seq_len)
    print(f"{'profile':40s} sweeps stages  pred s  on others s  others/pred  ideal/others")
    ratios = []
    for i, (path, raw) in enumerate(zip(args.profiles, raws)):
        pooled = CostModel(median_profile([r for j, r in enumerate(raws) if j != i]))
        sp = plan(Profile.from_dict(raw), work, max_ranges=args.max_ranges).strategies["hpipe"]
        names = [d.name for d in pooled.daemons]
        bounds = tuple(s.units.start for s in sp.stages) + (sp.stages[-1].units.end,)
        devices = tuple(names.index(s.daemon) for s in sp.stages)
        t = simulate_schedule(pooled, work, bounds, devices, sp.micro_batches, sp.slices)
        ratios.append(ideal_seconds(pooled, work) / t)
        print(f"{path[-40:]:40s} {raw['meta']['repeats']:6d} {len(sp.stages):6d} {sp.predicted_s:7.3f} {t:12.3f} "
              f"{t / sp.predicted_s:12.3f} {ratios[-1]:13.3f}", flush=True)
    print(f"ideal / on others: mean {np.mean(ratios):.3f}, worst {min(ratios):.3f}")


if __name__ == "__main__":
    main()
