"""How well does a profile predict? Held-out stage times and link transfers vs direct measurement.

    python benchmarks/profile_accuracy.py --profile profile.json --cluster clusters/local-3.yaml [--points 20]

Compute: random unit ranges, slice lengths and context offsets that are not grid points; the
prediction is the planner's (sum of interpolated unit times), the measurement a forward of that
stage with random weights in this process, with the daemon's thread count (the daemons of a
local cluster run on this machine, idle meanwhile). Links: random activation-sized payloads
between every directed pair, predicted by the fitted latency + bytes/bandwidth, measured by the
daemons themselves over gRPC. Prints the median absolute relative error of each.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from hpipe.model import StageModel
from hpipe.units import UnitRange
from planner.costs import CostModel
from profiler.schema import Profile
from runtime.channels import StageClient
from runtime.cluster import ClusterSpec
from runtime.wire import pb


def measure_stage(cfg, a, b, s, c, dtype, repeats=5) -> float:
    stage = StageModel.random(cfg, UnitRange(a, b, cfg.num_layers), dtype=dtype)
    x = (torch.randint(0, cfg.vocab_size, (1, s)) if a == 0 else torch.randn(1, s, cfg.hidden_size, dtype=dtype))
    times = []
    for i in range(repeats + 1):
        cache = stage.new_cache(1, c + s)
        cache.length = c  # the prefix's values do not change the work
        t0 = time.perf_counter()
        stage(x, c, cache)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--points", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="the daemons' torch threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    profile = Profile.from_json(open(args.profile).read())
    cluster = ClusterSpec.load(args.cluster)
    cost = CostModel(profile)
    cfg = profile.model
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[profile.dtype]
    max_len = profile.meta.get("max_len", cfg.max_position_embeddings)
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    rows = []
    for _ in range(args.points):
        a = rng.randrange(cost.num_units)
        b = rng.randint(a + 1, min(cost.num_units, a + 16))
        s = rng.randint(2, max_len // 2)
        c = rng.randint(0, max_len - s)
        dev = rng.randrange(len(cost.devices))
        pred = cost.stage_time(dev, a, b, s, c, 1)
        meas = measure_stage(cfg, a, b, s, c, dtype)
        rows.append({"units": [a, b], "tokens": s, "context": c, "predicted_s": pred, "measured_s": meas,
                     "error": abs(pred - meas) / meas})
    compute_err = statistics.median(r["error"] for r in rows)

    security = cluster.security()
    link_rows = []
    act = cfg.hidden_size * profile.itemsize
    for la in cluster.daemons:
        client = StageClient(la.address, security)
        for lb in cluster.daemons:
            if la is lb:
                continue
            sizes = [act * rng.randint(2, max_len) for _ in range(3)]
            reply = client.call("MeasureLink", pb.LinkRequest(target_address=lb.address, sizes=sizes, repeats=21),
                                timeout=120)
            link = profile.link(la.name, lb.name)
            for n, t in zip(reply.sizes, reply.seconds):
                link_rows.append({"link": f"{la.name}->{lb.name}", "bytes": n, "predicted_s": link.time(n),
                                  "measured_s": t, "error": abs(link.time(n) - t) / t})
        client.close()
    link_err = statistics.median(r["error"] for r in link_rows)
    result = {"compute_median_abs_error": compute_err, "link_median_abs_error": link_err,
              "compute_points": rows, "link_points": link_rows}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{'units':<10} {'tokens':>6} {'context':>7} {'pred ms':>9} {'meas ms':>9} {'err':>6}")
        for r in rows:
            print(f"{str(r['units']):<10} {r['tokens']:>6} {r['context']:>7} {r['predicted_s'] * 1e3:>9.2f} "
                  f"{r['measured_s'] * 1e3:>9.2f} {r['error']:>6.1%}")
        print(f"compute: median absolute error {compute_err:.1%} over {len(rows)} held-out points")
        print(f"links:   median absolute error {link_err:.1%} over {len(link_rows)} transfers "
              f"({min(r['bytes'] for r in link_rows)}-{max(r['bytes'] for r in link_rows)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
