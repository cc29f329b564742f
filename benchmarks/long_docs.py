"""Documents longer than the plan: the parts of all of them in flight together, against one at a time.

    python benchmarks/long_docs.py --plan plan.json --cluster clusters/local-3.yaml \
        [--times 4] [--documents 2] [--method map-reduce] [--rounds 2] [--max-new-tokens 32] \
        [--parallel 16]

Builds ``--documents`` documents of ``--times`` the plan's length each from the shipped licence
text (``tests/data/apache-2.0.txt``, paragraphs repeated), runs ``hpipe run --long METHOD`` on them
with ``--parallel`` (16 unless told) and with ``--parallel 1`` (the parts one at a time, as a
chain that sends each part as a separate request would), alternating, ``--rounds`` times on one
deployment's cluster, and prints each one's job seconds (median), its prompts, and the ratio
(#68's bar: parallel <= 0.5 x one at a time). Both must give the same final answers; a difference exits
non-zero.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from hpipe.app.jobs import JobConfig, run_job
from hpipe.core import cpuinfo
from hpipe.core.cluster import ClusterSpec
from hpipe.core.plan import Plan
from hpipe.model.weights.sources import resolve_model
from runtime.coordinator.pipeline import coordinate_on_one_thread

TEXT = Path(__file__).parents[1] / "tests" / "data" / "apache-2.0.txt"


def documents(tokenizer, n: int, tokens: int, folder: Path) -> list[str]:
    paragraphs = [p for p in TEXT.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    out = []
    for d in range(n):
        body, i = [], d * 7
        while len(tokenizer("\n\n".join(body))["input_ids"]) < tokens:
            body.append(paragraphs[i % len(paragraphs)])
            i += 1
        path = folder / f"long{d}.txt"
        path.write_text("\n\n".join(body), encoding="utf-8")
        out.append(str(path))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", required=True)
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--times", type=float, default=4.0, help="each document's length, in plan lengths")
    ap.add_argument("--documents", type=int, default=2)
    ap.add_argument("--method", choices=["map-reduce", "refine"], default="map-reduce")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--parallel", type=int, default=16, help="prompts in flight in the together run")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    plan = Plan.from_json(Path(args.plan).read_text())
    source = resolve_model(plan.model_name)
    work = Path(tempfile.mkdtemp(prefix="hpipe-long-"))
    docs = documents(source.tokenizer(), args.documents, int(args.times * plan.max_len), work)
    coordinate_on_one_thread()  # as hpipe run does
    cluster = ClusterSpec.load(args.cluster)
    n = max(2, args.parallel)
    times: dict[int, list[float]] = {n: [], 1: []}
    finals, prompts = {}, {}
    for r in range(args.rounds):
        for parallel in ((n, 1) if r % 2 == 0 else (1, n)):
            out = work / f"p{parallel}-r{r}.jsonl"
            job = JobConfig(instruction="Summarize the obligations this text sets out.", chat=True,
                            max_new_tokens=args.max_new_tokens, parallel=parallel, long=args.method)
            summary = run_job(plan, cluster, source, docs, out, job)
            if summary["failed"]:
                print(f"failed: {summary['failed']}", file=sys.stderr)
                return 1
            times[parallel].append(summary["elapsed_s"])
            prompts[parallel] = summary["long"]["computed"]
            rows = [json.loads(line) for line in out.read_text().splitlines()]
            finals.setdefault(parallel, {row["document"]: row["answer"] for row in rows if "long" in row})
    same = finals[n] == finals[1]
    cpu = cpuinfo.model_name()
    report = {"cpu": cpu, "method": args.method, "documents": args.documents, "times_plan": args.times,
              "plan_max_len": plan.max_len, "prompts": prompts[n], "parallel": n,
              "parallel_n_s": statistics.median(times[n]), "parallel_1_s": statistics.median(times[1]),
              "same_answers": same}
    report["ratio"] = round(report["parallel_n_s"] / report["parallel_1_s"], 3)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{cpu}: {args.documents} documents of {args.times}x the plan's {plan.max_len} tokens, {args.method}, "
              f"{prompts[n]} prompts each run")
        print(f"  --parallel {n}: {report['parallel_n_s']:.1f} s   --parallel 1: {report['parallel_1_s']:.1f} s   "
              f"ratio {report['ratio']:.2f}   same answers: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
