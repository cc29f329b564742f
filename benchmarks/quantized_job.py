"""``hpipe run`` with a GGUF's quantized blocks against ``--dequantize``, side by side.

    python benchmarks/quantized_job.py --plan plan.json --cluster clusters/local-3.yaml \
        [--dequantized-plan plan-f32.json] [--documents 16] [--rounds 2] [--max-new-tokens 32]

The same documents (1k-3k tokens, built from the bundled sample report as in
``run_equivalence.py``) as one job with the daemons holding the file's blocks and one with them
holding float32 weights, the order swapped every round (each job deploys afresh). Each side runs
its own plan where two are given (a plan made from a profile of the blocks suits the blocks: a
bfloat16 prefill GEMM changes what a slice costs). Prints each side's job seconds (median over
rounds, deployment included, and the seconds after it), the ratio quantized / dequantized per
round, and how many documents got the same answer from both (greedy; every one where the
daemons' prefill GEMM is float32, most where it is bfloat16: docs/decisions/quantized-kernels.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from run_equivalence import documents

from hpipe.app.demo import INSTRUCTION
from hpipe.app.jobs import JobConfig, run_job
from hpipe.core.cluster import ClusterSpec
from hpipe.core.plan import Plan
from hpipe.model.weights.sources import resolve_model
from runtime.coordinator.pipeline import coordinate_on_one_thread


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", required=True)
    ap.add_argument("--dequantized-plan", help="the float32 side's plan (default: --plan)")
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--documents", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    plan = Plan.from_json(Path(args.plan).read_text())
    plans = {"quantized": plan, "dequantized": Plan.from_json(Path(args.dequantized_plan or args.plan).read_text())}
    source = resolve_model(plan.model_name)
    work = Path(tempfile.mkdtemp(prefix="hpipe-quantized-"))
    docs = [str(d) for d in documents(source.tokenizer(), args.documents, 1000, 3000, work)]
    coordinate_on_one_thread()  # as hpipe run does
    cluster = ClusterSpec.load(args.cluster)
    sides = {"quantized": False, "dequantized": True}
    times: dict[str, list[float]] = {s: [] for s in sides}
    engine_times: dict[str, list[float]] = {s: [] for s in sides}  # after the deployment
    answers: dict[str, dict[str, list[int]]] = {}
    failed: dict = {}
    for r in range(args.rounds):
        for side in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            out = work / f"{side}-r{r}.jsonl"
            t0 = time.perf_counter()
            summary = run_job(plans[side], cluster, source, docs, out,
                              JobConfig(instruction=INSTRUCTION, chat=True, max_new_tokens=args.max_new_tokens,
                                        dequantize=sides[side]))
            times[side].append(time.perf_counter() - t0)
            engine_times[side].append(summary["elapsed_s"])
            failed.update(summary["failed"])
            got = {row["document"]: row["token_ids"] for row in map(json.loads, out.read_text().splitlines())}
            if side in answers and answers[side] != got:
                print(f"round {r + 1}, {side}: not the answers of its round 1", file=sys.stderr)
            answers[side] = got
            print(f"round {r + 1}, {side}: {times[side][-1]:.1f} s ({engine_times[side][-1]:.1f} s after deploying)",
                  file=sys.stderr)
    ratios = [q / d for q, d in zip(times["quantized"], times["dequantized"])]
    q, d = answers["quantized"], answers["dequantized"]
    same = sum(q.get(doc) == d.get(doc) for doc in d)
    first = sum(bool(q.get(doc)) and q[doc][:1] == d[doc][:1] for doc in d)
    report = {"documents": len(docs), "max_new_tokens": args.max_new_tokens, "same_answers": same,
              "same_first_token": first, "failed": failed,
              "job_s": {s: round(statistics.median(t), 2) for s, t in times.items()},
              "runs_s": {s: [round(x, 2) for x in t] for s, t in times.items()},
              "after_deploy_s": {s: round(statistics.median(t), 2) for s, t in engine_times.items()},
              "ratio": round(statistics.median(ratios), 3), "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)]}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{len(docs)} documents, {args.max_new_tokens} new tokens each; job seconds, median of {args.rounds}")
        for s in sides:
            print(f"  {s:12} {report['job_s'][s]:8.1f}  runs {', '.join(f'{t:.1f}' for t in times[s])}; "
                  f"{report['after_deploy_s'][s]:.1f} after deploying")
        print(f"  quantized / dequantized: {report['ratio']:.2f} (rounds {report['ratio_range'][0]:.2f}-"
              f"{report['ratio_range'][1]:.2f}); the same answer for {same} of {len(docs)} documents, the same "
              f"first token for {first}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
