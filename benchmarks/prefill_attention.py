"""Prefill with hpipe's own float32 attention against SDPA's, in one process, side by side.

    . scripts/avx2.env   # on a CPU with AVX-512: measure as an AVX2 CPU runs
    python benchmarks/prefill_attention.py [--models smollm2-135m,gemma3-270m] [--lengths 850,2048]
                                           [--slices 4] [--threads 1] [--rounds 3]

For each model and prompt length: the whole model's prefill of one prompt, whole and in
``--slices`` equal slices (as a pipeline's stages compute it), with the attention of every float32
prefill slice through ``kernels/f32_attention.cpp`` and through SDPA (``HPIPE_PREFILL_ATTENTION=sdpa``),
alternating within each round; the medians and their ratio (own / SDPA: below 1 is faster). The
kernel runs where the CPU's widest vectors are AVX2's (``HPIPE_CPU_ISA=avx2`` caps a wider one);
elsewhere both columns are SDPA's and the script says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from hpipe.core import cpuinfo
from hpipe.core.units import ranges_from_cuts
from hpipe.model.compute.stage import StageModel
from hpipe.model.kernels import library, precision
from hpipe.model.weights.sources import resolve_model


def prefill_s(model: StageModel, ids: torch.Tensor, slices: int) -> float:
    n = ids.shape[1]
    cuts = [n * i // slices for i in range(slices + 1)]
    cache = model.new_cache(1, n + 1)
    t0 = time.perf_counter()
    for a, b in zip(cuts, cuts[1:]):
        model(ids[:, a:b], a, cache, logits=False)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--lengths", default="850,2048")
    ap.add_argument("--slices", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    library.require("this benchmark")
    precision.set_prefill_gemm("float32")  # where bfloat16 prefill is the default, hpipe's bfloat16 attention would run
    own = precision.own_f32_attention()
    cpu = cpuinfo.model_name()
    rows = []
    for name in args.models.split(","):
        source = resolve_model(name)
        cfg = source.config
        model = StageModel.from_checkpoint(source.weights(), cfg, ranges_from_cuts([], cfg.num_layers)[0])
        for n in (int(x) for x in args.lengths.split(",")):
            ids = torch.randint(0, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
            for slices in (1, args.slices):
                times: dict[str, list[float]] = {"own": [], "sdpa": []}
                prefill_s(model, ids[:, :64], 1)  # warm
                for r in range(args.rounds):
                    for way in (("own", "sdpa") if r % 2 == 0 else ("sdpa", "own")):
                        os.environ[precision.ATTENTION_ENV] = "sdpa" if way == "sdpa" else ""
                        times[way].append(prefill_s(model, ids, slices))
                os.environ.pop(precision.ATTENTION_ENV, None)
                med = {k: statistics.median(v) for k, v in times.items()}
                rows.append({"model": name, "tokens": n, "slices": slices, "own_s": round(med["own"], 3),
                             "sdpa_s": round(med["sdpa"], 3), "ratio": round(med["own"] / med["sdpa"], 3)})
    if args.json:
        print(json.dumps({"cpu": cpu, "threads": args.threads, "kernel": own, "rows": rows}))
        return
    print(f"{cpu}, {args.threads} thread(s), float32 prefill; own kernel "
          f"{'on' if own else 'off here (the widest vectors are not AVX2: both columns are SDPA)'}")
    print(f"{'model':<14} {'tokens':>6} {'slices':>6} {'own s':>8} {'SDPA s':>8} {'own/SDPA':>9}")
    for row in rows:
        print(f"{row['model']:<14} {row['tokens']:>6} {row['slices']:>6} {row['own_s']:>8.2f} {row['sdpa_s']:>8.2f} "
              f"{row['ratio']:>9.2f}")


if __name__ == "__main__":
    main()
