"""What a speculative verification entry costs against one decode step, in one process.

    python benchmarks/verify_cost.py [--model smollm2-135m] [--context 600] [--rows 8] [--repeat 15]
    . scripts/avx2.env; python benchmarks/verify_cost.py      # the AVX2 paths on an AVX-512 CPU

After a prompt of ``--context`` random tokens, times a plain step and entries of 2 to ``--rows``
decode rows (``LocalRunner.verify``, rewound each time), the median of ``--repeat`` each, and
prints each entry's time over the step's: what prompt lookup must beat with the tokens a pass keeps
(``PromptLookup.worth`` weighs the same ratio from a sequence's own timings).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hpipe.core import cpuinfo
from hpipe.model.generate.local import LocalModel
from hpipe.model.weights.sources import resolve_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    runner = LocalModel(resolve_model(args.model)).open(args.context + args.rows + 1)
    g = torch.Generator().manual_seed(0)
    runner.prefill(torch.randint(100, 10000, (1, args.context), generator=g), [args.context])
    start = runner.position

    def median_ms(rows: int) -> float:
        times = []
        for _ in range(args.repeat):
            runner.rewind(start)
            t = time.perf_counter()
            runner.step(123) if rows == 1 else runner.verify([123] * rows)
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3

    print(f"{cpuinfo.model_name()}, {args.threads} threads, {args.model}, {args.context} positions before")
    step = median_ms(1)
    print(f"{'rows':>4} {'ms':>7} {'/ step':>7}\n{1:>4} {step:>7.2f} {1.0:>7.2f}")
    for rows in range(2, args.rows + 1):
        ms = median_ms(rows)
        print(f"{rows:>4} {ms:>7.2f} {ms / step:>7.2f}")


if __name__ == "__main__":
    main()
