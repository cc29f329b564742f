"""Decode rows of quantized weights: GB/s of blocks read, float32 activations against ggml's
integer products (``HPIPE_DECODE_DOT=int8``, or ``int15``: x in 15 bits; docs/decisions/int8-decode.md),
beside the memory's.

    python benchmarks/kquant_rows.py [--rows 8192] [--k 3072] [--m 1,16] [--rounds 3] [--threads 2]
    . scripts/avx2.env; python benchmarks/kquant_rows.py     # the AVX2 paths on an AVX-512 CPU

For each block type, ``m`` decode rows of x times a ``rows`` x ``k`` matrix of random blocks
(``torch.ops.hpipe.qlinear`` with every row marked a decode row), each way in turn, in
interleaved rounds; the median time of each. The floor: a sum over 256 MiB on the same threads.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from decode_step import timed

from hpipe.core import cpuinfo
from hpipe.model.kernels import library
from hpipe.model.weights.blocks import TYPES, random_weight


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--k", type=int, default=3072)
    ap.add_argument("--m", default="1,16")
    ap.add_argument("--types", default="Q4_K,Q5_K,Q6_K,Q5_0,Q8_0")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    library.require("this benchmark")
    torch.set_num_threads(args.threads)
    cpu = cpuinfo.model_name()
    big = torch.ones(64 << 20)
    floor = big.nbytes / min(timed(big.sum, 5) for _ in range(args.rounds))
    print(f"{cpu}, {args.threads} threads, kernels: {torch.ops.hpipe.quant_variant()}; memory: {floor / 1e9:.1f} GB/s")
    ids = {name: t for t, (name, _, _) in TYPES.items()}
    g = torch.Generator().manual_seed(0)
    before = torch.ops.hpipe.decode_dot("")
    modes = ("float32", "int8", "int15")
    print(f"{'type':6} {'m':>3} " + " ".join(f"{mode + ' GB/s':>11}" for mode in modes)
          + " " + " ".join(f"{mode + '/float32':>14}" for mode in modes[1:]))
    try:
        for name in args.types.split(","):
            w = random_weight(ids[name], args.rows, args.k, g)
            for m in map(int, args.m.split(",")):
                x, low = torch.randn(m, args.k, generator=g), torch.zeros(m, dtype=torch.bool)
                times: dict[str, list[float]] = {mode: [] for mode in modes}
                for _ in range(args.rounds):
                    for mode in times:
                        torch.ops.hpipe.decode_dot(mode)
                        times[mode].append(timed(lambda: torch.ops.hpipe.qlinear(x, w.data, w.parts, torch.empty(0),
                                                                                 low), 20))
                t = {mode: statistics.median(times[mode]) for mode in modes}
                print(f"{name:6} {m:>3} " + " ".join(f"{w.data.numel() / t[mode] / 1e9:>11.1f}" for mode in modes)
                      + " " + " ".join(f"{t['float32'] / t[mode]:>14.2f}" for mode in modes[1:]))
    finally:
        torch.ops.hpipe.decode_dot(before)


if __name__ == "__main__":
    main()
