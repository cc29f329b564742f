"""MKL-packed weights vs plain ``F.linear`` on the CPU, float32: one projection, then a whole stage.

    python benchmarks/packed_linear.py [--model smollm2-135m] [--threads 1] [--rounds 5] [--json]

1. One ``hidden -> intermediate`` projection of the model, over enough distinct weight copies that
   they stream from memory as a stage's do: microseconds per row at several row counts.
2. A stage of ten blocks with random weights, packed and plain, prefilling 2048 tokens in slices
   of 64 .. 2048 tokens: seconds per prefill, and each slicing's cost over the unsliced prefill.
Everything compared runs in alternation, round by round (the VM's speed drifts); medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from hpipe.core.units import UnitRange
from hpipe.model.compute import packed
from hpipe.model.compute.stage import StageModel
from hpipe.model.weights.sources import model_shape

ROWS = (64, 128, 256, 512, 2048)
SLICES = (64, 128, 256, 2048)
PREFILL = 2048


def _alternate(fns: dict, rounds: int) -> dict[str, float]:
    samples = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            samples[k].append(fn())
    return {k: statistics.median(v) for k, v in samples.items()}


def projection(hidden: int, inter: int, rounds: int) -> list[dict]:
    copies = max(4, (96 << 20) // (hidden * inter * 4))  # ~96 MiB of weights: they cannot stay cached
    lins = [nn.Linear(hidden, inter, bias=False) for _ in range(copies)]
    weights = [lin.weight.detach().clone() for lin in lins]
    packs = [packed.PackedLinear(lin) for lin in lins]
    rows_out = []
    for rows in ROWS:
        x = torch.randn(rows, hidden)

        def timed(fn):
            def run():
                t = time.perf_counter()
                for i in range(copies):
                    fn(i)
                return (time.perf_counter() - t) / copies / rows * 1e6
            return run

        with torch.inference_mode():
            r = _alternate({"plain": timed(lambda i: F.linear(x, weights[i])),
                            "packed": timed(lambda i: packs[i](x))}, rounds)
        rows_out.append({"rows": rows, "plain_us_per_row": r["plain"], "packed_us_per_row": r["packed"],
                         "ratio": r["packed"] / r["plain"]})
    return rows_out


def stage(cfg, rounds: int) -> list[dict]:
    units = UnitRange(1, 21, cfg.num_layers)  # ten blocks, as a middle stage
    models = {"plain": StageModel.random(cfg, units, pack=False), "packed": StageModel.random(cfg, units, pack=True)}
    caches = {k: m.new_cache(1, PREFILL) for k, m in models.items()}

    def prefill(k, s):
        def run():
            x = torch.randn(1, s, cfg.hidden_size)
            caches[k].length = 0  # the same sequence again, from its first position
            t = time.perf_counter()
            for start in range(0, PREFILL, s):
                models[k](x, start, caches[k])
            return time.perf_counter() - t
        return run

    # every (layout, slice) pair once per round, so that drift of the machine's speed hits all alike
    r = _alternate({(k, s): prefill(k, s) for s in SLICES for k in models}, rounds)
    return [{"slice": s, "plain_s": r[("plain", s)], "packed_s": r[("packed", s)],
             "ratio": r[("packed", s)] / r[("plain", s)],
             "plain_vs_unsliced": r[("plain", s)] / r[("plain", PREFILL)],
             "packed_vs_unsliced": r[("packed", s)] / r[("packed", PREFILL)]} for s in SLICES]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not packed.available():
        print("this PyTorch build has no MKL packed GEMM", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    cfg = model_shape(args.model)[1]
    result = {"model": args.model, "threads": args.threads,
              "projection": projection(cfg.hidden_size, cfg.intermediate_size, args.rounds),
              "stage": stage(cfg, args.rounds)}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{args.model}, {args.threads} thread(s), median of {args.rounds} alternating rounds")
    print(f"projection {cfg.hidden_size} -> {cfg.intermediate_size}, weights streamed: us per row")
    print(f"{'rows':>6} {'plain':>8} {'packed':>8} {'packed/plain':>13}")
    for r in result["projection"]:
        print(f"{r['rows']:>6} {r['plain_us_per_row']:>8.2f} {r['packed_us_per_row']:>8.2f} {r['ratio']:>13.2f}")
    print(f"ten blocks prefilling {PREFILL} tokens: seconds")
    print(f"{'slice':>6} {'plain':>8} {'packed':>8} {'packed/plain':>13} {'plain/unsliced':>15} {'packed/unsliced':>16}")
    for r in result["stage"]:
        print(f"{r['slice']:>6} {r['plain_s']:>8.3f} {r['packed_s']:>8.3f} {r['ratio']:>13.2f} "
              f"{r['plain_vs_unsliced']:>15.2f} {r['packed_vs_unsliced']:>16.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
