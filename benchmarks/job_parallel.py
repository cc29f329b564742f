"""How many documents should ``hpipe run`` keep in flight? Job time for each ``--parallel``, side by side.

    python benchmarks/job_parallel.py --plan plan.json --cluster clusters/emulated-hetero.yaml \
        [--parallel 1,2,3,4] [--documents 8] [--rounds 2]

Runs the same documents (1k-3k tokens, built from the bundled sample report as in
``run_equivalence.py``) as one job per ``--parallel`` value on one deployment, the values' order
reversed every round, and prints each value's job seconds (median over rounds), tokens per second,
and its ratio to the current default. Every job must give every document the same answer; a
difference exits non-zero.
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

DEFAULT = JobConfig(instruction="").parallel


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", required=True)
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--parallel", default="1,2,3,4", help="comma-separated documents-in-flight values")
    ap.add_argument("--documents", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    values = list(dict.fromkeys(int(v) for v in args.parallel.split(",")))
    if any(v < 1 for v in values) or args.rounds < 1 or args.documents < 1:
        ap.error("--parallel values, --rounds and --documents must be >= 1")
    plan = Plan.from_json(Path(args.plan).read_text())
    source = resolve_model(plan.model_name)
    work = Path(tempfile.mkdtemp(prefix="hpipe-parallel-"))
    docs = [str(d) for d in documents(source.tokenizer(), args.documents, 1000, 3000, work)]
    coordinate_on_one_thread()  # as hpipe run and hpipe serve do
    cluster = ClusterSpec.load(args.cluster)
    times: dict[int, list[float]] = {v: [] for v in values}
    tokens: dict[int, int] = {}
    answers: list[dict[str, list[int]]] = []  # one per job: document -> answer token ids
    failed = {}
    for r in range(args.rounds):
        for v in (values if r % 2 == 0 else values[::-1]):
            out = work / f"p{v}-r{r}.jsonl"
            t0 = time.perf_counter()
            summary = run_job(plan, cluster, source, docs, out,
                              JobConfig(instruction=INSTRUCTION, chat=True, max_new_tokens=args.max_new_tokens,
                                        parallel=v))
            times[v].append(time.perf_counter() - t0)
            failed.update(summary["failed"])
            tokens[v] = summary["prompt_tokens"] + summary["new_tokens"]
            rows = [json.loads(line) for line in out.read_text().splitlines()]
            answers.append({row["document"]: row["token_ids"] for row in rows})
            print(f"round {r + 1}, parallel {v}: {times[v][-1]:.1f} s", file=sys.stderr)
    same = len(answers[0]) == len(docs) and all(a == answers[0] for a in answers)
    base = statistics.median(times[DEFAULT]) if DEFAULT in times else None
    rows = [{"parallel": v, "job_s": round(statistics.median(times[v]), 2), "runs_s": [round(t, 2) for t in times[v]],
             "tokens_per_s": round(tokens[v] / statistics.median(times[v]), 1),
             "vs_default": round(statistics.median(times[v]) / base, 3) if base else None} for v in values]
    if args.json:
        print(json.dumps({"documents": len(docs), "default": DEFAULT, "same_answers": same, "failed": failed,
                          "rows": rows}))
    else:
        print(f"{len(docs)} documents, {args.max_new_tokens} new tokens each; job seconds, median of {args.rounds}")
        print(f"{'parallel':>8} {'job s':>8} {'tokens/s':>9} {'/ default':>10}  runs")
        for row in rows:
            ratio = f"{row['vs_default']:.2f}" if row["vs_default"] else "-"
            print(f"{row['parallel']:>8} {row['job_s']:>8.1f} {row['tokens_per_s']:>9.0f} {ratio:>10}  "
                  f"{', '.join(f'{t:.1f}' for t in row['runs_s'])}")
        print("same answers from every job" if same else "ANSWERS DIFFER between jobs")
    return 0 if same and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
