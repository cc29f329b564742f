"""How well does a profile predict? Held-out stage times and link transfers vs direct measurement.

    python benchmarks/profile_accuracy.py --profile profile.json --cluster clusters/local-3.yaml [--points 20]

Compute: random devices, unit ranges, slice lengths and context offsets that are not grid points;
the prediction is the planner's (sum of interpolated unit times), the measurement a forward of
that stage with random weights timed by the daemon itself (``TimeStage``), so a throttled or
remote device is measured at its own speed. The daemon times it alone, so the prediction leaves
out the profile's co-location factor. Links: random activation-sized payloads between every
directed pair, predicted by the fitted latency + bytes/bandwidth, measured by the daemons over
gRPC. Prints the median absolute relative error of each.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys

from hpipe.core.cluster import ClusterSpec
from hpipe.core.profile import Profile
from planner.costs import CostModel
from runtime.wire.channels import DaemonClient, Security
from runtime.wire.messages import pb


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--points", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    profile = Profile.from_json(open(args.profile).read())
    cluster = ClusterSpec.load(args.cluster)
    cost = CostModel(profile)
    cfg = profile.model
    wire_dtype = pb.DType.Value(profile.dtype.upper())  # FLOAT32, BFLOAT16, FLOAT16
    max_len = profile.meta.get("max_len", cfg.max_position_embeddings)
    security = Security.of(cluster)
    clients = {d.name: DaemonClient(d.address, security, d.name) for d in cluster.daemons}
    rng = random.Random(args.seed)
    rows = []
    for _ in range(args.points):
        a = rng.randrange(cost.num_units)
        b = rng.randint(a + 1, min(cost.num_units, a + 16))
        s = rng.randint(2, max_len // 2)
        c = rng.randint(0, max_len - s)
        dev = rng.randrange(len(cost.daemons))
        # the daemon times the stage alone: predict at its speed alone (without its co-location factor)
        pred = cost.stage_time(dev, a, b, s, c, 1) * cost.alone_scale[dev]
        name = cost.daemons[dev].name
        meas = clients[name].call("TimeStage", pb.StageTimeRequest(
            config_json=json.dumps(cfg.to_dict()), dtype=wire_dtype, unit_start=a, unit_end=b, batch=1,
            tokens=s, context=c, repeats=5), timeout=300).seconds
        rows.append({"device": name, "units": [a, b], "tokens": s, "context": c, "predicted_s": pred,
                     "measured_s": meas, "error": abs(pred - meas) / meas})
    for client in clients.values():
        client.close()
    compute_err = statistics.median(r["error"] for r in rows)

    link_rows = []
    act = cfg.hidden_size * profile.itemsize
    for la in cluster.daemons:
        client = DaemonClient(la.address, security)
        for lb in cluster.daemons:
            if la is lb:
                continue
            sizes = [act * rng.randint(2, max_len) for _ in range(3)]
            port = DaemonClient(lb.address, security).call("Status", pb.StatusRequest()).data_port
            reply = client.call("MeasureLink", pb.LinkRequest(target_address=lb.address, target_data_port=port,
                                                              sizes=sizes, repeats=21), timeout=120)
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
        print(f"{'device':<10} {'units':<10} {'tokens':>6} {'context':>7} {'pred ms':>9} {'meas ms':>9} {'err':>6}")
        for r in rows:
            print(f"{r['device']:<10} {str(r['units']):<10} {r['tokens']:>6} {r['context']:>7} {r['predicted_s'] * 1e3:>9.2f} "
                  f"{r['measured_s'] * 1e3:>9.2f} {r['error']:>6.1%}")
        print(f"compute: median absolute error {compute_err:.1%} over {len(rows)} held-out points")
        print(f"links:   median absolute error {link_err:.1%} over {len(link_rows)} transfers "
              f"({min(r['bytes'] for r in link_rows)}-{max(r['bytes'] for r in link_rows)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
