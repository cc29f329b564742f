"""Many questions about a few documents, with the prefix cache and without, side by side.

    python benchmarks/prefix_cache.py --plan plan4096.json --cluster clusters/local-3.yaml \
        [--documents 4] [--questions 8] [--rounds 2] [--max-new-tokens 16] [--no-server]

The job: ``--documents`` documents of 2,500-3,500 tokens (built from the bundled sample report as
in ``run_equivalence.py``), each asked ``--questions`` questions with ``hpipe run --questions``'s
code, once with the prefix cache and once with ``--no-prefix-cache``, the order swapped every
round (each job deploys afresh). Prints each side's job seconds, the ratio cached / uncached per
round, whether every answer is the same (greedy), and, with the cache, each document's time to
first token of its later questions against its first's (from when each question started
running, so that time queued behind other questions is left out). Then the same cached job once
more with one question at a time (``--parallel 1``: an analyst asking one question after another),
where a question's first token waits for nothing but its own prefill, and the same ratio.

The server: ``hpipe serve`` on the same plan and cluster, asked twice, one request after the
other, about one 3,000-token document with two different questions (streamed); prints each
request's time to first token and the second's cached tokens, and the same with
``--no-prefix-cache``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from run_equivalence import documents

from hpipe.app.jobs import JobConfig, run_job
from hpipe.core.cluster import ClusterSpec
from hpipe.core.plan import Plan
from hpipe.model.weights.sources import resolve_model
from runtime.coordinator.pipeline import coordinate_on_one_thread

QUESTIONS = ("Who wrote this report?", "What is its main finding?", "Which risks does it name?",
             "What does it recommend?", "Which numbers does it give?", "Who is it for?",
             "What period does it cover?", "Summarize it in one sentence.")


def job(plan: Plan, cluster: ClusterSpec, source, docs: list[str], questions: tuple[str, ...], out: Path,
        cache: bool, max_new_tokens: int, parallel: int = 16) -> tuple[float, dict, list[dict]]:
    t0 = time.perf_counter()
    summary = run_job(plan, cluster, source, docs, out,
                      JobConfig(instruction="", chat=True, max_new_tokens=max_new_tokens, questions=questions,
                                prefix_cache=1.0 if cache else None, ignore_eos=True, parallel=parallel))
    return time.perf_counter() - t0, summary, [json.loads(line) for line in out.read_text().splitlines()]


def first_token_ratios(rows: list[dict]) -> list[float]:
    """Per document: the mean time to first token of its later questions over its first's (the
    question that prefilled the document: the one that read no more than the others from the cache)."""
    out = []
    for doc in sorted({r["document"] for r in rows}):
        mine = sorted((r for r in rows if r["document"] == doc), key=lambda r: r["cached_tokens"])
        later = [r["first_token_after_start_s"] for r in mine[1:]]
        out.append(statistics.mean(later) / mine[0]["first_token_after_start_s"])
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_side(plan_path: str, cluster_path: str, document: str, cache: bool) -> list[dict]:
    """Two streamed chats about ``document`` through ``hpipe serve``: each one's time to first token
    and cached tokens."""
    port = free_port()
    cmd = [sys.executable, "-m", "hpipe", "serve", "--plan", plan_path, "--cluster", cluster_path, "--port", str(port)]
    proc = subprocess.Popen(cmd + ([] if cache else ["--no-prefix-cache"]), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"hpipe serve did not come up: {proc.stderr.read() if proc.poll() is not None else ''}")
            time.sleep(0.5)
        out = []
        for question in QUESTIONS[:2]:
            body = {"model": plan_model(plan_path), "max_tokens": 8, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True},
                    "messages": [{"role": "user", "content": f"{document}\n\n{question}"}]}
            t0, first, usage = time.perf_counter(), None, None
            with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if first is None and event.get("choices") and event["choices"][0]["delta"].get("content"):
                        first = time.perf_counter() - t0
                    usage = event.get("usage") or usage
            out.append({"first_token_s": round(first, 3), "prompt_tokens": usage["prompt_tokens"],
                        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]})
        return out
    finally:
        proc.terminate()
        proc.wait(60)


def plan_model(plan_path: str) -> str:
    return Plan.from_json(Path(plan_path).read_text()).model_name


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", required=True)
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--documents", type=int, default=4)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--min-tokens", type=int, default=2500)
    ap.add_argument("--max-tokens", type=int, default=3500)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-server", dest="server", action="store_false")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    plan = Plan.from_json(Path(args.plan).read_text())
    source = resolve_model(plan.model_name)
    work = Path(tempfile.mkdtemp(prefix="hpipe-prefix-"))
    docs = [str(d) for d in documents(source.tokenizer(), args.documents, args.min_tokens, args.max_tokens, work)]
    questions = QUESTIONS[:args.questions]
    coordinate_on_one_thread()  # as hpipe run does
    cluster = ClusterSpec.load(args.cluster)
    sides = {"cached": True, "uncached": False}
    times: dict[str, list[float]] = {s: [] for s in sides}
    answers: dict[str, dict] = {}
    same, failed, ttft = True, {}, []
    for r in range(args.rounds):
        for side in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            seconds, summary, rows = job(plan, cluster, source, docs, questions, work / f"{side}-r{r}.jsonl",
                                         sides[side], args.max_new_tokens)
            times[side].append(seconds)
            failed.update(summary["failed"])
            got = {(row["document"], row["question"]): row["token_ids"] for row in rows}
            same = same and len(got) == len(docs) * len(questions) and all(a == got for a in answers.values())
            answers[side] = got
            if side == "cached":
                ttft += first_token_ratios(rows)
            print(f"round {r + 1}, {side}: {seconds:.1f} s", file=sys.stderr)
    ratios = [c / u for c, u in zip(times["cached"], times["uncached"])]
    report = {"documents": len(docs), "questions": len(questions), "max_new_tokens": args.max_new_tokens,
              "same_answers": same, "failed": failed,
              "job_s": {s: round(statistics.median(t), 2) for s, t in times.items()},
              "runs_s": {s: [round(x, 2) for x in t] for s, t in times.items()},
              "ratio": round(statistics.median(ratios), 3), "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
              "later_first_token_ratio": round(statistics.median(ttft), 3),
              "later_first_token_range": [round(min(ttft), 3), round(max(ttft), 3)]}
    seconds, summary, rows = job(plan, cluster, source, docs, questions, work / "one-at-a-time.jsonl", True,
                                 args.max_new_tokens, parallel=1)
    alone = first_token_ratios(rows)
    report["one_at_a_time"] = {"job_s": round(seconds, 2), "later_first_token_ratio": round(statistics.median(alone), 3),
                               "later_first_token_range": [round(min(alone), 3), round(max(alone), 3)],
                               "same_answers": {(r["document"], r["question"]): r["token_ids"] for r in rows}
                               == answers["uncached"]}
    same = report["same_answers"] = same and report["one_at_a_time"]["same_answers"]
    if args.server:
        (work / "server").mkdir()
        text = documents(source.tokenizer(), 1, 3000, 3000, work / "server")[0].read_text()
        report["server"] = {side: server_side(args.plan, args.cluster, text, cache) for side, cache in sides.items()}
        first, second = report["server"]["cached"]
        report["server_second_first_token_ratio"] = round(second["first_token_s"] / first["first_token_s"], 3)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{len(docs)} documents x {len(questions)} questions, {args.max_new_tokens} new tokens each; "
              f"job seconds, median of {args.rounds}")
        for s in sides:
            print(f"  {s:9} {report['job_s'][s]:8.1f}  runs {', '.join(f'{t:.1f}' for t in times[s])}")
        print(f"  cached / uncached: {report['ratio']:.2f} (rounds {report['ratio_range'][0]:.2f}-"
              f"{report['ratio_range'][1]:.2f}); " + ("same answers" if same else "ANSWERS DIFFER"))
        print(f"  later questions' first token / the first question's: {report['later_first_token_ratio']:.3f} "
              f"(documents {report['later_first_token_range'][0]:.3f}-{report['later_first_token_range'][1]:.3f})")
        one = report["one_at_a_time"]
        print(f"  one question at a time: {one['job_s']:.1f} s; later / first question's first token "
              f"{one['later_first_token_ratio']:.3f} ({one['later_first_token_range'][0]:.3f}-"
              f"{one['later_first_token_range'][1]:.3f}); " + ("same answers" if one["same_answers"] else "ANSWERS DIFFER"))
        if args.server:
            for side, reqs in report["server"].items():
                print(f"  server, {side}: first tokens after " + ", ".join(
                    f"{q['first_token_s']:.2f} s ({q['cached_tokens']} of {q['prompt_tokens']} cached)" for q in reqs))
            print(f"  server, second / first request's first token: {report['server_second_first_token_ratio']:.3f}")
    return 0 if same and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
