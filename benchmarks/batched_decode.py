"""Many documents decoding together against one at a time, on a live cluster, side by side.

    python benchmarks/batched_decode.py --plan plan.json --cluster clusters/local-3.yaml \
        [--documents 16] [--new-tokens 128] [--rounds 2] [--decode-only-tokens 64]

Job: ``--documents`` documents of 400-1,500 tokens (paragraphs of the bundled sample report) and
``--new-tokens`` answer tokens each (end of sequence ignored, so every answer is that long), as
``hpipe run`` does it now (``--parallel`` = documents, micro-batches of every ready decode token
and prefill chunks) and as it did before batching (``--policy single --parallel 2``: one sequence
per micro-batch), alternating, ``--rounds`` times. Both must give the same tokens.

Decode: the aggregate decode rate of N sequences decoding together (short prompts, so the time
is decode), for N = 1 and N = documents, alternating: decode tokens / the time from the first
request's first token to the last request's end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from importlib.resources import files
from pathlib import Path

from hpipe.app.jobs import JobConfig, run_job
from hpipe.core.cluster import ClusterSpec
from hpipe.core.plan import Plan
from hpipe.model.weights.sources import resolve_model
from runtime.coordinator.deploy import deploy
from runtime.coordinator.engine import Engine, Request
from runtime.coordinator.pipeline import coordinate_on_one_thread
from runtime.coordinator.policies import POLICIES

INSTRUCTION = "Summarize this report."


def documents(tokenizer, n: int, folder: Path) -> list[str]:
    """``n`` documents of 400-1,500 tokens, cut from the sample report's paragraphs."""
    paragraphs = [p for p in files("hpipe").joinpath("data/sample_report.md").read_text().split("\n\n") if p.strip()]
    out = []
    for i in range(n):
        target = 400 + (1100 * i) // max(1, n - 1)
        text, k = "", i
        while len(tokenizer(text)["input_ids"]) < target:
            text += paragraphs[k % len(paragraphs)] + "\n\n"
            k += 1
        ids = tokenizer(text)["input_ids"][:target]
        path = folder / f"doc{i:02d}.md"
        path.write_text(tokenizer.decode(ids))
        out.append(str(path))
    return out


def job(plan, cluster, source, docs, folder: Path, policy: str, parallel: int, new: int, tag: str) -> tuple[float, dict]:
    out = folder / f"{tag}.jsonl"
    out.unlink(missing_ok=True)
    t0 = time.perf_counter()
    summary = run_job(plan, cluster, source, docs, out, JobConfig(instruction=INSTRUCTION, max_new_tokens=new,
                                                               parallel=parallel, policy=policy, ignore_eos=True))
    elapsed = time.perf_counter() - t0
    if summary["failed"]:
        raise SystemExit(f"{tag}: failed documents {summary['failed']}")
    answers = {json.loads(line)["document"]: json.loads(line)["token_ids"] for line in out.read_text().splitlines()}
    return elapsed, answers


def decode_rate(pipe, n: int, new: int, vocab: int) -> float:
    """Aggregate decode tokens/s of ``n`` sequences decoding together."""
    session = pipe.session()
    try:
        engine = Engine(session, POLICIES["gllm"](), depth=len(pipe.stages), max_running=n)
        requests = [engine.add(Request([(7 * i + 3 * j) % vocab for j in range(32)], new)) for i in range(n)]
        engine.run()
    finally:
        session.close()
    start = min(r.first_token_s for r in requests)
    return sum(len(r.tokens) - 1 for r in requests) / (max(r.done_s for r in requests) - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", required=True)
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--documents", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--decode-only-tokens", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    plan = Plan.from_json(Path(args.plan).read_text())
    source = resolve_model(plan.model_name)
    folder = Path(tempfile.mkdtemp(prefix="hpipe-batched-"))
    docs = documents(source.tokenizer(), args.documents, folder)
    coordinate_on_one_thread()  # as hpipe run and hpipe serve do
    cluster = ClusterSpec.load(args.cluster)
    times = {"gllm": [], "single": []}
    decode = {1: [], args.documents: []}
    reference = None
    for r in range(args.rounds):
        modes = [("gllm", args.documents), ("single", 2)]
        for mode, parallel in (modes if r % 2 == 0 else modes[::-1]):
            elapsed, answers = job(plan, cluster, source, docs, folder, mode, parallel, args.new_tokens, mode)
            reference = reference or answers
            same = sum(answers[d] == reference[d] for d in docs)
            print(f"round {r + 1} {mode:<8} --parallel {parallel:<3} job {elapsed:7.1f} s; same answers "
                  f"{same}/{len(docs)}", file=sys.stderr, flush=True)
            times[mode].append(elapsed)
        with deploy(plan, cluster) as deployed:
            for n in (decode if r % 2 == 0 else list(decode)[::-1]):
                rate = decode_rate(deployed.pipe, n, args.decode_only_tokens, plan.model.vocab_size)
                decode[n].append(rate)
                print(f"round {r + 1} decode of {n:>3} sequences together: {rate:7.1f} tokens/s",
                      file=sys.stderr, flush=True)
    out = {"documents": args.documents, "new_tokens": args.new_tokens, "job_s": times,
           "job_ratio": statistics.median(b / s for b, s in zip(times["gllm"], times["single"])),
           "decode_tokens_per_s": {str(k): v for k, v in decode.items()},
           "decode_ratio": statistics.median(m / o for m, o in zip(decode[args.documents], decode[1]))}
    if args.json:
        print(json.dumps(out))
        return
    print(f"job: gllm / single = {out['job_ratio']:.2f} (gllm {times['gllm']}, single {times['single']} s)")
    print(f"decode: {args.documents} sequences / 1 = {out['decode_ratio']:.2f} "
          f"({decode[args.documents]} vs {decode[1]} tokens/s)")


if __name__ == "__main__":
    main()
