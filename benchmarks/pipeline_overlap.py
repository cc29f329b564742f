"""Do slices overlap across stages? Prefill wall time vs the sum of all stages' compute times.

    python benchmarks/pipeline_overlap.py [--cluster clusters/local-3.yaml] [--tokens 1024] [--slices 1,4,8]

Starts the cluster if it is not running (and stops it again), deploys an even 3-way split of
SmolLM2, and for each slice count prefills the same random prompt. Without overlap, wall time
would be at least the sum of stage compute; the ratio printed is wall / sum(compute).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from hpipe.core.cluster import ClusterSpec
from hpipe.core.units import even_cuts
from hpipe.model.weights.sources import resolve_model
from runtime.cluster import launcher
from runtime.coordinator.pipeline import Pipeline, RemoteRunner, cut_stages


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="clusters/local-3.yaml")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--slices", default="1,4,8")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cluster = ClusterSpec.load(args.cluster)
    started = launcher.up(cluster)
    try:
        cfg = resolve_model(args.model).config
        pipe = Pipeline(cluster)
        pipe.load(args.model, cut_stages(cluster, even_cuts(cfg.num_units, len(cluster.daemons)), cfg.num_units),
                    torch.float32)
        ids = torch.randint(0, cfg.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
        rows = []
        for k in [int(x) for x in args.slices.split(",")]:
            base, rest = divmod(args.tokens, k)
            slices = [base + (1 if i < rest else 0) for i in range(k)]
            best = None
            for _ in range(args.repeat):
                with pipe.open(args.tokens) as seq:
                    t0 = time.perf_counter()
                    RemoteRunner(seq).prefill(ids, slices)
                    wall = time.perf_counter() - t0
                stats = seq.stats
                row = {"slices": k, "wall_s": wall, "stage_compute_s": [s["compute_s"] for s in stats],
                       "sum_compute_s": sum(s["compute_s"] for s in stats)}
                row["wall_over_sum"] = row["wall_s"] / row["sum_compute_s"]
                best = row if best is None or row["wall_s"] < best["wall_s"] else best
            rows.append(best)
        pipe.close()
    finally:
        if any(v.startswith("started") for v in started.values()):
            launcher.down(cluster)
    if args.json:
        print(json.dumps(rows))
    else:
        print(f"{'slices':>6} {'wall s':>8} {'sum compute s':>14} {'wall/sum':>9}   per-stage compute s")
        for r in rows:
            print(f"{r['slices']:>6} {r['wall_s']:>8.3f} {r['sum_compute_s']:>14.3f} {r['wall_over_sum']:>9.2f}   "
                  + " ".join(f"{c:.3f}" for c in r["stage_compute_s"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
