"""Seconds each Seesaw layout switch's Load takes on a cluster's daemons (no requests in flight).

    hpipe cluster up clusters/local-3.yaml     # daemons started afresh: they keep nothing yet
    python benchmarks/seesaw_switch.py [--cluster clusters/local-3.yaml] [--model smollm2-135m] [--switches 6]

Two layouts of three stages over the cluster's first three daemons (cuts at a third and two thirds
of the units, and at a sixth and a half, the daemons rotated), loaded as Seesaw loads them: one
pipeline of the stages between any two cuts (``fine_stages``). The first switch reads the weights
of the stages each daemon gains; later ones take them from the weights the daemons kept
(``runtime/daemon/parking.py``) where memory allows.
"""

import argparse
import time

import torch

from hpipe.core.cluster import ClusterSpec
from hpipe.model.weights.sources import resolve_model
from runtime.coordinator.pipeline import Pipeline, cut_stages
from runtime.coordinator.seesaw import fine_stages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="clusters/local-3.yaml")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--switches", type=int, default=6)
    args = ap.parse_args()
    cluster = ClusterSpec.load(args.cluster)
    n = resolve_model(args.model).config.num_units
    names = [d.name for d in cluster.daemons[:3]]
    layouts = fine_stages({"prefill": cut_stages(cluster, [n // 3, 2 * n // 3], n),
                           "decode": cut_stages(cluster, [n // 6, n // 2], n, daemons=names[1:] + names[:1])})
    pipe = Pipeline(cluster)
    try:
        pipe.load(args.model, layouts["prefill"], torch.float32, adjacent=True)
        for k in range(args.switches):
            phase = ("decode", "prefill")[k % 2]
            t0 = time.perf_counter()
            pipe.load(args.model, layouts[phase], torch.float32, adjacent=True)
            print(f"switch {k + 1} to {phase}: {time.perf_counter() - t0:.3f} s", flush=True)
    finally:
        pipe.close()


if __name__ == "__main__":
    main()
