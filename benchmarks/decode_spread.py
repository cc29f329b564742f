"""gLLM's decode spread, side by side: decode tokens split over the pipeline's stages (eq. 4 as
the paper writes it) or over its decode lanes (what ``gllm`` does; ``hpipe.core.lanes.decode_lane``),
on a live cluster, in interleaved rounds.

    python benchmarks/decode_spread.py --plan plan.json --cluster clusters/local-3.yaml \
        [--requests 16] [--rounds 2] [--seed 0]

The workload is ``hpipe bench --workload generate``'s (all at once; prompts of 64-2,048 tokens,
outputs of 16-256); each round runs both variants on one deployment, the order reversed from one
round to the next. Prints total tokens/s per round, the medians and their ratio, and checks that
both give every request the same tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from hpipe.app.workload_bench import run_once
from hpipe.core import workload
from hpipe.core.cluster import ClusterSpec
from hpipe.core.plan import Plan
from runtime.coordinator.deploy import deploy
from runtime.coordinator.pipeline import coordinate_on_one_thread
from runtime.coordinator.policies import GLLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", required=True)
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    plan = Plan.from_json(Path(args.plan).read_text())
    items = workload.generate(args.requests, args.seed)
    coordinate_on_one_thread()  # as hpipe run and hpipe serve do
    variants = ["lanes", "stages"]
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    with deploy(plan, ClusterSpec.load(args.cluster)) as deployed:
        pipe = deployed.pipe
        lanes = pipe.lanes
        print(f"{len(pipe.stages)} stages on {len(pipe.daemons)} daemons, {lanes} decode lane(s)",
              file=sys.stderr)
        for r in range(args.rounds):
            for v in variants if r % 2 == 0 else variants[::-1]:
                run = run_once(plan, pipe, items, "gllm", args.seed, make_policy=lambda v=v: GLLM(spread=v))
                runs[v].append(run)
                print(f"round {r + 1} spread over {v:<8} {run['total_tokens_per_s']:7.1f} tokens/s, "
                      f"{run['micro_batches']} micro-batches, busy "
                      + " ".join(f"{d} {b:.2f}" for d, b in run["daemon_busy"].items()), file=sys.stderr, flush=True)
    med = {v: statistics.median(run["total_tokens_per_s"] for run in rs) for v, rs in runs.items()}
    same = all(a["outputs"] == b["outputs"] for a, b in zip(runs["lanes"], runs["stages"]))
    print(json.dumps({"lanes": lanes, "tokens_per_s": med, "lanes_over_stages":
                      round(med["lanes"] / med["stages"], 3), "same_outputs": same,
                      "rounds": {v: [run["total_tokens_per_s"] for run in rs] for v, rs in runs.items()}}))


if __name__ == "__main__":
    main()
