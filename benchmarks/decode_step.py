"""What a decode step costs in-process, against the time to stream the model's weights once.

    python benchmarks/decode_step.py [--model smollm2-135m] [--prompt 619] [--batches 1,4,16,64]
                                     [--rounds 5] [--threads 2] [--stages 3]

The bound: a sum over one tensor as large as the model's weights (what one pass over them costs
in memory traffic alone, on the same threads). Then, in interleaved rounds: one sequence's decode
step of the whole model (after a ``--prompt``-token prefill) through the C++ decode kernel
(:mod:`hpipe.model.kernels.library`) and eagerly, and a decode micro-batch of each ``--batches`` size
split in ``--stages`` even stages, timed per stage, through the kernel (where it is built) and
eagerly. Medians over the rounds; the spread is the rounds' range.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hpipe.core.units import even_cuts, ranges_from_cuts
from hpipe.model.compute.stage import StageModel
from hpipe.model.kernels import library
from hpipe.model.kv.pool import Entry
from hpipe.model.weights.sources import resolve_model


def timed(fn, n: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def summary(args, rounds: dict, weight_bytes: int, kernel: bool, stages: list, batches: list[int]) -> dict:
    """The rounds' medians and ranges, and the step's ratios to streaming the weights."""
    out = {"model": args.model, "weight_bytes": weight_bytes, "threads": args.threads, "prompt": args.prompt,
           "kernel": kernel, "one_step_eager_s": statistics.median(rounds["one_step_eager_s"]),
           "one_step_eager_range_s": [min(rounds["one_step_eager_s"]), max(rounds["one_step_eager_s"])],
           "stream_s": statistics.median(rounds["stream_s"]), "stream_range_s": [min(rounds["stream_s"]),
                                                                                   max(rounds["stream_s"])],
           "one_step_s": statistics.median(rounds["one_step_s"]),
           "one_step_range_s": [min(rounds["one_step_s"]), max(rounds["one_step_s"])],
           "stages": [str(s.units) for s in stages],
           "batch_step_s": {b: [statistics.median(r[j] for r in rounds[f"batch{b}"]) for j in range(len(stages))]
                            for b in batches},
           "batch_step_eager_s": {b: [statistics.median(r[j] for r in rounds[f"eager{b}"])
                                      for j in range(len(stages))] for b in batches}}
    out["one_step_over_stream"] = out["one_step_s"] / out["stream_s"]
    out["one_step_eager_over_stream"] = out["one_step_eager_s"] / out["stream_s"]
    # each round's own ratio (the step and the stream timed side by side), for the spread
    ratios = [s / b for s, b in zip(rounds["one_step_s"], rounds["stream_s"])]
    out["one_step_over_stream_range"] = [min(ratios), max(ratios)]
    return out


def report(args, out: dict, weight_bytes: int, kernel: bool) -> None:
    print(f"{args.model}: {weight_bytes / 1e6:.0f} MB of weights, {args.threads} threads")
    print(f"stream the weights once: {out['stream_s'] * 1e3:.1f} ms "
          f"({out['stream_range_s'][0] * 1e3:.1f}-{out['stream_range_s'][1] * 1e3:.1f})")
    path = "the C++ kernel" if kernel else "eager: the kernel is not built (python -m hpipe.model.kernels)"
    print(f"one sequence's decode step (whole model, after {args.prompt} tokens), {path}: "
          f"{out['one_step_s'] * 1e3:.1f} ms ({out['one_step_range_s'][0] * 1e3:.1f}-"
          f"{out['one_step_range_s'][1] * 1e3:.1f}); {out['one_step_over_stream']:.2f}x the stream "
          f"(rounds {out['one_step_over_stream_range'][0]:.2f}-{out['one_step_over_stream_range'][1]:.2f})")
    print(f"  eager: {out['one_step_eager_s'] * 1e3:.1f} ms ({out['one_step_eager_range_s'][0] * 1e3:.1f}-"
          f"{out['one_step_eager_range_s'][1] * 1e3:.1f}); {out['one_step_eager_over_stream']:.2f}x the stream")
    print("decode micro-batch per stage, ms (" + ", ".join(out["stages"]) + "), and per sequence in all;"
          " eager in the same rounds:")
    for b, per in out["batch_step_s"].items():
        eager = out["batch_step_eager_s"][b]
        print(f"  {b:>3} sequences: " + " / ".join(f"{t * 1e3:6.1f}" for t in per)
              + f"   total {sum(per) * 1e3:6.1f} ms, {sum(per) * 1e3 / b:5.2f} ms per sequence"
              + f"   (eager {sum(eager) * 1e3:6.1f} ms: {sum(per) / sum(eager):.2f}x)")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt", type=int, default=619)
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    source = resolve_model(args.model)
    cfg = source.config
    store = source.weights()
    whole = StageModel.from_checkpoint(store, cfg, ranges_from_cuts([], cfg.num_layers)[0])
    weight_bytes = whole.weight_bytes()
    stream = torch.ones(weight_bytes // 4)
    stages = [StageModel.from_checkpoint(store, cfg, r)
              for r in ranges_from_cuts(even_cuts(cfg.num_units, args.stages), cfg.num_layers)]
    batches = [int(b) for b in args.batches.split(",")]
    gen = torch.Generator().manual_seed(0)

    # one sequence, whole model, its cache filled by a prefill
    cache = whole.new_cache(1, args.prompt + args.rounds * (args.steps + 1) * 2 + 2)
    whole(torch.randint(0, cfg.vocab_size, (1, args.prompt), generator=gen), 0, cache, logits=False)

    def one_step():
        whole(torch.tensor([[7]]), cache.length, cache)

    # decode micro-batches: each stage its own pool holding max(batches) sequences of the prompt
    most = max(batches)
    length = args.prompt + 2 * args.rounds * (args.steps + 1) + 2  # each round: kernel, then eager
    pools = [s.new_pool(most * (-(-length // 16)) + 1) for s in stages]
    seqs = [[p.sequence(length) if p else None for _ in range(most)] for p in pools]
    for j, (stage, pool) in enumerate(zip(stages, pools)):
        for s in seqs[j]:
            if s is not None:
                s.grow(args.prompt)
                for layer in pool.layers:  # the prompt's keys: values do not change the work
                    a, b = s.run(args.prompt)
                    pool.k[layer][:, a:b].normal_(generator=gen)
                    pool.v[layer][:, a:b].normal_(generator=gen)
    position = {b: args.prompt for b in batches}

    def batch_step(b: int) -> list[float]:
        pos = position[b]
        x = torch.randint(0, cfg.vocab_size, (b,), generator=gen)
        per_stage = []
        for j, stage in enumerate(stages):
            entries = []
            for s in seqs[j][:b]:
                if s is not None:
                    s.grow(pos + 1)
                entries.append(Entry(pos, 1, s, "last"))
            t0 = time.perf_counter()
            x = stage.forward_batch(x, entries, pools[j])
            per_stage.append(time.perf_counter() - t0)
            if stage.units.has_head:
                x = None
        position[b] += 1
        return per_stage

    kernel = library.available()
    rounds = {"stream_s": [], "one_step_s": [], "one_step_eager_s": [], **{f"batch{b}": [] for b in batches},
              **{f"eager{b}": [] for b in batches}}
    for _ in range(args.rounds):
        rounds["stream_s"].append(timed(lambda: stream.sum(), 10))
        library.enable(False)
        rounds["one_step_eager_s"].append(timed(one_step, args.steps))
        library.enable(True)
        rounds["one_step_s"].append(timed(one_step, args.steps))
        for b in batches:
            for key, on in ((f"batch{b}", True), (f"eager{b}", False)):
                library.enable(on)
                steps = [batch_step(b) for _ in range(args.steps)]
                rounds[key].append([statistics.median(s[j] for s in steps) for j in range(len(stages))])
        library.enable(True)
    out = summary(args, rounds, weight_bytes, kernel, stages, batches)
    if args.json:
        print(json.dumps(out))
        return
    report(args, out, weight_bytes, kernel)


if __name__ == "__main__":
    main()
