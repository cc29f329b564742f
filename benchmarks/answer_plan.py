"""A plan made for the prompt alone against one made for the prompt and its answer, side by side.

    python benchmarks/answer_plan.py --profile P.json --cluster clusters/local-3.yaml \
        [--seq-len 1024] [--max-len 1024] [--output-len 128] [--rounds 2]

Plans ``--seq-len`` tokens from the profile twice: as HPipe does (the prompt's prefill the
objective) and with ``--output-len`` answer tokens decoded after it (``hpipe plan --output-len``,
what ``hpipe run --model`` plans for its ``--max-new-tokens``). Each plan then runs, in turn and
``--rounds`` times in alternating order, ``hpipe run`` of one document of ``--seq-len`` tokens (the
shipped licence text) with ``--output-len`` greedy answer tokens (``--ignore-eos``). Prints, per
plan, its stages, the predicted and measured prefill (time to the first token), the predicted and
measured seconds per answer token, and the job; both must give the same answer (else exit 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from hpipe.app.jobs import JobConfig, run_job
from hpipe.core.cluster import ClusterSpec
from hpipe.core.profile import Profile
from hpipe.model.weights.sources import resolve_model
from planner.costs import Workload
from planner.strategies import plan as make_plan
from runtime.coordinator.pipeline import coordinate_on_one_thread

TEXT = Path(__file__).parents[1] / "tests" / "data" / "apache-2.0.txt"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--max-len", type=int)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    profile = Profile.from_json(Path(args.profile).read_text())
    max_len = args.max_len or args.seq_len + args.output_len
    plans = {"prefill": make_plan(profile, Workload(args.seq_len, 1, max_len)),
             "answer": make_plan(profile, Workload(args.seq_len, 1, max_len, output_len=args.output_len))}
    token_s = {name: _token_s(profile, p, args.output_len) for name, p in plans.items()}
    source = resolve_model(plans["prefill"].model_name)
    ids = source.tokenizer()(TEXT.read_text(encoding="utf-8"))["input_ids"]
    prompt_len = args.seq_len - 16  # room for the decoded text tokenizing to a few more tokens
    work = Path(tempfile.mkdtemp(prefix="hpipe-answer-plan-"))
    doc = work / "doc.txt"
    doc.write_text(source.tokenizer().decode(ids[:prompt_len]), encoding="utf-8")
    cluster = ClusterSpec.load(args.cluster)
    coordinate_on_one_thread()  # as hpipe run does
    runs = {name: {"job": [], "first": [], "token": []} for name in plans}
    answers = {}
    for r in range(args.rounds):
        for name in (("prefill", "answer") if r % 2 == 0 else ("answer", "prefill")):
            out = work / f"{name}-{r}.jsonl"
            t0 = time.perf_counter()
            summary = run_job(plans[name], cluster, source, [str(doc)], out,
                              JobConfig(instruction="", parallel=1, max_new_tokens=args.output_len, ignore_eos=True))
            runs[name]["job"].append(time.perf_counter() - t0)
            if summary["failed"]:
                print(f"failed: {summary['failed']}", file=sys.stderr)
                return 1
            row = json.loads(out.read_text().splitlines()[0])
            runs[name]["first"].append(row["first_token_s"])
            runs[name]["token"].append(1.0 / row["decode_tokens_per_s"])
            answers[name, r] = row["token_ids"]
            print(f"round {r + 1}, plan for the {name}: job {runs[name]['job'][-1]:.1f} s", file=sys.stderr)
    same = len({tuple(a) for a in answers.values()}) == 1
    rows = []
    for name, p in plans.items():
        sp = p.chosen
        med = {k: statistics.median(v) for k, v in runs[name].items()}
        rows.append({"plan": name, "stages": [f"{st.daemon}[{st.units.start},{st.units.end})" for st in sp.stages],
                     "prefill_predicted_s": round(sp.predicted_s, 3), "prefill_measured_s": round(med["first"], 3),
                     "token_predicted_ms": round(token_s[name] * 1e3, 2), "token_measured_ms": round(med["token"] * 1e3, 2),
                     "job_s": round(med["job"], 2)})
    if args.json:
        print(json.dumps({"same_answers": same, "rows": rows}))
    else:
        print(f"{args.seq_len}-token prompt, {args.output_len}-token answer, one at a time; medians of {args.rounds}")
        print(f"{'plan for':<9} {'stages':>6} {'prefill pred / meas s':>22} {'token pred / meas ms':>21} {'job s':>7}")
        for row in rows:
            print(f"{row['plan']:<9} {len(row['stages']):>6} {row['prefill_predicted_s']:>10.3f} / "
                  f"{row['prefill_measured_s']:<9.3f} {row['token_predicted_ms']:>9.2f} / {row['token_measured_ms']:<9.2f}"
                  f" {row['job_s']:>7.2f}")
        print("the same answer from both plans" if same else "ANSWERS DIFFER")
    return 0 if same else 1


def _token_s(profile: Profile, p, output_len: int) -> float:
    """The predicted seconds per answer token of plan ``p``'s hpipe chain (made with an answer or not)."""
    from planner.costs import CostModel
    from planner.strategies import answer_token_s

    names = [d.name for d in profile.daemons]
    sp = p.chosen
    bounds = (0, *sp.cuts, p.model.num_units)
    return answer_token_s(CostModel(profile), Workload(p.seq_len, 1, p.max_len, output_len=output_len),
                          bounds, tuple(names.index(st.daemon) for st in sp.stages))


if __name__ == "__main__":
    sys.exit(main())
