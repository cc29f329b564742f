"""Does ``hpipe run`` answer every document exactly as single-process generation does?

    python benchmarks/run_equivalence.py --plan plan.json --cluster clusters/emulated-hetero.yaml [--documents 8]
        [--kill NAME --at SECONDS|decode]

Builds --documents documents of 1k-3k tokens from the bundled sample report (its paragraphs,
rotated and repeated to each target length), runs them as one ``hpipe run`` job on the cluster
(sliced by the plan, several in flight), then generates each prompt greedily in this process with
the whole model, and compares the answers token by token. Exits non-zero on any difference.

With ``--kill NAME``, daemon NAME of the cluster (started by ``hpipe cluster up``, whose supervisor
restarts it) is SIGKILLed ``--at`` seconds into the job (0: as it deploys), or once the first
answer is written (``decode``): the job must still answer every document exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from importlib.resources import files
from pathlib import Path

from hpipe.app.demo import INSTRUCTION
from hpipe.app.jobs import JobConfig, build_prompt, prompt_limit, run_job
from hpipe.core.cluster import ClusterSpec
from hpipe.core.errors import HpipeError
from hpipe.core.plan import Plan
from hpipe.model.generate.local import LocalModel, generate_ids
from hpipe.model.weights.sources import resolve_model
from runtime.cluster.launcher import state_dir


def documents(tokenizer, count: int, lo: int, hi: int, folder: Path) -> list[Path]:
    paragraphs = [p for p in files("hpipe").joinpath("data/sample_report.md").read_text().split("\n\n") if p.strip()]
    out = []
    for i in range(count):
        target = lo + (hi - lo) * i // max(count - 1, 1)
        parts, k = [], i
        while len(tokenizer("\n\n".join(parts))["input_ids"]) < target:
            parts.append(paragraphs[k % len(paragraphs)])
            k += 1
        path = folder / f"doc{i}.md"
        path.write_text("\n\n".join(parts), encoding="utf-8")
        out.append(path)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", required=True)
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--documents", type=int, default=8)
    ap.add_argument("--min-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=3000)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--kill", help="SIGKILL this daemon of the cluster during the job")
    ap.add_argument("--at", default="0", help="seconds into the job, or 'decode': after the first answer")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    plan = Plan.from_json(Path(args.plan).read_text())
    source = resolve_model(plan.model_name)
    tok = source.tokenizer()
    work = Path(tempfile.mkdtemp(prefix="hpipe-equiv-"))
    docs = documents(tok, args.documents, args.min_tokens, args.max_tokens, work)
    cluster = ClusterSpec.load(args.cluster)
    out = work / "results.jsonl"
    t0 = time.perf_counter()
    done: dict = {}

    def run() -> None:
        try:
            done.update(run_job(plan, cluster, source, [str(d) for d in docs], out,
                                JobConfig(instruction=INSTRUCTION, chat=True, max_new_tokens=args.max_new_tokens)))
        except Exception as e:  # noqa: BLE001 - reported below, as the job's failure
            done["error"] = repr(e)
    job = threading.Thread(target=run)
    job.start()
    killed_at = None
    if args.kill:
        while job.is_alive() and not (out.exists() and out.read_text().strip() if args.at == "decode"
                                      else time.perf_counter() - t0 >= float(args.at)):
            time.sleep(0.05)
        if job.is_alive():
            os.kill(int((state_dir(cluster) / f"{args.kill}.pid").read_text()), signal.SIGKILL)
            killed_at = round(time.perf_counter() - t0, 2)
            print(f"killed {args.kill} {killed_at} s into the job", file=sys.stderr)
    job.join()
    if "error" in done:
        print(f"the job failed: {done['error']}", file=sys.stderr)
        return 1
    summary = done
    job_s = time.perf_counter() - t0
    rows = {r["document"]: r for r in map(json.loads, out.read_text().splitlines())}
    model = LocalModel(source)
    table, same = [], 0
    for d in docs:
        try:
            ids, _ = build_prompt(tok, INSTRUCTION, d.read_text(), True, prompt_limit(plan), "none")
        except HpipeError as e:  # refused by the job too (its row says why)
            table.append({"document": d.name, "prompt_tokens": None, "slices": None, "equal": False,
                          "answer": str(e)[:70]})
            continue
        ref = generate_ids(model.open, tok, ids, context=source.config.max_position_embeddings,
                           eos_ids=source.eos_token_ids(), max_new_tokens=args.max_new_tokens)
        row = rows.get(str(d))
        equal = row is not None and row["token_ids"] == ref.token_ids
        same += equal
        table.append({"document": d.name, "prompt_tokens": len(ids), "slices": row["slices"] if row else None,
                      "equal": equal, "answer": (row or {}).get("answer", "").strip()[:70]})
    result = {"documents": len(docs), "identical": same, "job_s": round(job_s, 2), "failed": summary["failed"],
              "killed_at_s": killed_at, "recoveries": summary["recoveries"], "rows": table}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{'document':<10} {'tokens':>6} {'slices':>6}  same  answer")
        for r in table:
            print(f"{r['document']:<10} {r['prompt_tokens'] or '-':>6} {r['slices'] or '-':>6}  {'yes' if r['equal'] else 'NO':<4}  "
                  f"{r['answer']}")
        print(f"{same}/{len(docs)} documents answered exactly as single-process generation "
              f"(job {job_s:.1f} s on {args.cluster})")
    return 0 if same == len(docs) and not summary["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
