"""A bench's hpipe latency against the ideal bound, as planned and at the bench's own speeds.

    python benchmarks/ideal_now.py BENCH.json PROFILE.json [BENCH.json PROFILE.json ...]

``BENCH.json`` is ``hpipe bench --profile PROFILE.json --json`` output; ``PROFILE.json`` the
profile its plan came from. The bound at the bench's speeds is what ``hpipe bench`` now reports as
``ideal_now_s`` (the profile scaled by the calibration factors); this recomputes it for bench files
written before it did.
"""

from __future__ import annotations

import argparse
import json

from hpipe.core.profile import Profile
from planner.costs import CostModel, Workload
from planner.strategies import ideal_seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="pairs: bench JSON, then its profile JSON")
    args = ap.parse_args()
    if len(args.files) % 2:
        ap.error("give the files in pairs: BENCH.json PROFILE.json")
    print(f"{'bench':40s} {'hpipe s':>8} {'ideal s':>8} {'now s':>8} {'ideal/hpipe':>11} {'now/hpipe':>9}")
    for bench_path, profile_path in zip(args.files[::2], args.files[1::2]):
        bench = json.load(open(bench_path))
        cal = bench.get("calibration")
        if not cal:
            print(f"{bench_path[-40:]:40s} no calibration: run hpipe bench with --profile")
            continue
        profile = Profile.from_json(open(profile_path).read())
        work = Workload(bench["seq_len"], bench["batch"], profile.meta.get("max_len", bench["seq_len"]))
        now = ideal_seconds(CostModel(profile.scaled(cal["factors"])), work)
        hpipe = bench["strategies"]["hpipe"]["latency_s"]
        print(f"{bench_path[-40:]:40s} {hpipe:8.3f} {bench['ideal_s']:8.3f} {now:8.3f} "
              f"{bench['ideal_s'] / hpipe:11.2f} {now / hpipe:9.2f}")


if __name__ == "__main__":
    main()
