"""Questions about a document through the daemons, with and without speculative decoding, side by side.

    python benchmarks/speculative_job.py --plan plan.json --cluster clusters/local-3.yaml \
        [--parallel 1,16] [--max-new-tokens 64] [--rounds 2]

The bundled sample report and its bundled questions (``hpipe/data/questions/sample_report.txt``:
16 questions whose answers quote it), greedy, as ``hpipe run --questions`` jobs, each ``--parallel``
value with ``--speculate off`` and ``ngram`` in turn (the order flipped every round). Prints each
job's seconds (median over rounds), the answers' tokens a second, off / ngram, and the guesses
kept; every answer must be the same token for token with speculation on and off (else exit 1).
``--parallel 1`` is one stream's decode; 16 is the pipeline full, where speculation must not lose.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from hpipe.app.jobs import JobConfig, read_questions, run_job
from hpipe.core.cluster import ClusterSpec
from hpipe.core.plan import Plan
from hpipe.model.weights.sources import resolve_model
from runtime.coordinator.pipeline import coordinate_on_one_thread

DATA = Path(__file__).parents[1] / "hpipe" / "data"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", required=True)
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--parallel", default="1,16", help="comma-separated questions-in-flight values")
    ap.add_argument("--document", default=str(DATA / "sample_report.md"))
    ap.add_argument("--questions", default=str(DATA / "questions" / "sample_report.txt"))
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    values = list(dict.fromkeys(int(v) for v in args.parallel.split(",")))
    if any(v < 1 for v in values) or args.rounds < 1:
        ap.error("--parallel values and --rounds must be >= 1")
    plan = Plan.from_json(Path(args.plan).read_text())
    source = resolve_model(plan.model_name)
    questions = read_questions(args.questions)
    cluster = ClusterSpec.load(args.cluster)
    coordinate_on_one_thread()  # as hpipe run does
    work = Path(tempfile.mkdtemp(prefix="hpipe-speculative-job-"))
    times = {(v, s): [] for v in values for s in ("off", "ngram")}
    new_tokens, kept, answers, failed = {}, {}, {}, {}
    for r in range(args.rounds):
        for v in values:
            for spec in (("off", "ngram") if r % 2 == 0 else ("ngram", "off")):
                out = work / f"p{v}-{spec}-r{r}.jsonl"
                t0 = time.perf_counter()
                summary = run_job(plan, cluster, source, [args.document], out,
                                  JobConfig(instruction="", questions=questions, chat=True, parallel=v,
                                            max_new_tokens=args.max_new_tokens, speculate=spec))
                times[v, spec].append(time.perf_counter() - t0)
                failed.update(summary["failed"])
                new_tokens[v, spec] = summary["new_tokens"]
                for k, n in (summary.get("speculation") or {}).items():  # summed over the rounds
                    kept.setdefault(v, {}).setdefault(k, 0)
                    kept[v][k] += n
                rows = [json.loads(line) for line in out.read_text().splitlines()]
                answers[v, spec, r] = {(row["document"], row.get("question")): row["token_ids"] for row in rows}
                print(f"round {r + 1}, parallel {v}, speculate {spec}: {times[v, spec][-1]:.1f} s", file=sys.stderr)
    first = next(iter(answers.values()))
    same = len(first) == len(questions) and all(a == first for a in answers.values())
    out_rows = []
    for v in values:
        off, on = statistics.median(times[v, "off"]), statistics.median(times[v, "ngram"])
        out_rows.append({"parallel": v, "off_s": round(off, 2), "ngram_s": round(on, 2),
                         "off_tokens_per_s": round(new_tokens[v, "off"] / off, 1),
                         "ngram_tokens_per_s": round(new_tokens[v, "ngram"] / on, 1),
                         "ngram_over_off": round(off / on, 3), "speculation": kept.get(v)})
    if args.json:
        print(json.dumps({"questions": len(questions), "same_answers": same, "failed": failed, "rows": out_rows}))
    else:
        print(f"{len(questions)} questions about {Path(args.document).name}, up to {args.max_new_tokens} new tokens "
              f"each; job seconds, median of {args.rounds}")
        print(f"{'parallel':>8} {'off s':>7} {'ngram s':>8} {'off tok/s':>10} {'ngram tok/s':>12} {'ngram/off':>10}  guesses")
        for row in out_rows:
            spec = row["speculation"] or {}
            print(f"{row['parallel']:>8} {row['off_s']:>7.1f} {row['ngram_s']:>8.1f} {row['off_tokens_per_s']:>10.1f} "
                  f"{row['ngram_tokens_per_s']:>12.1f} {row['ngram_over_off']:>10.2f}  "
                  f"{spec.get('kept', '-')} kept of {spec.get('drafted', '-')}")
        print("the same answers with and without speculation" if same else "ANSWERS DIFFER")
    return 0 if same and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
