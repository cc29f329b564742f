"""How long does planning take? Every length up to --max-len, a 32-layer model, 6 devices.

    python benchmarks/plan_speed.py [--model random:llama3-8b] [--max-len 8192] [--batch 1]

Uses a what-if profile of clusters/paper-hpipe.yaml (6 devices), so it needs no daemons.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from hpipe.core.cluster import ClusterSpec
from hpipe.model.weights.sources import model_shape
from planner.costs import Workload
from planner.strategies import plan
from profiler.roofline import simulated_profile


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="clusters/paper-hpipe.yaml")
    ap.add_argument("--model", default="random:llama3-8b")
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    cluster = ClusterSpec.load(args.cluster)
    name, cfg = model_shape(args.model)
    profile = simulated_profile(name, cfg, cluster.daemons, cluster.link_specs(), "float16", args.max_len, args.batch)
    t0 = time.perf_counter()
    p = plan(profile, Workload(args.max_len, args.batch))
    elapsed = time.perf_counter() - t0
    print(json.dumps({"model": name, "layers": cfg.num_layers, "daemons": len(profile.daemons),
                      "lengths_planned": len(p.slicing), "max_len": args.max_len, "planning_s": round(elapsed, 2),
                      "predicted": {k: round(v.predicted_s, 4) for k, v in p.strategies.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
