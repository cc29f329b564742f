"""``hpipe run``: analyse many documents with one instruction on a deployed plan.

Each document becomes one prompt (document, blank line, instruction; in the chat template with
``--chat``: small models answer a question asked after the text far better than one asked before
it), sliced by the plan's schedule for its length, prefilled through the pipeline and
decoded greedily. Several documents are in flight at once so that every stage has work while
another document's slices or decode steps are elsewhere in the pipeline. Results are appended
to a JSONL file one line per document as they finish; documents already in it are skipped, so
an interrupted job resumes where it stopped.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from hpipe.core.errors import HpipeError, InputError
from hpipe.core.plan import Plan
from hpipe.model.generate import encode_prompt, generate_ids
from hpipe.model.sampling import SamplingParams
from hpipe.model.stage import DTYPES
from runtime.coordinator import Pipeline, RemoteRunner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobConfig:
    instruction: str
    chat: bool = False
    max_new_tokens: int = 128
    truncate: str = "none"  # none | head (keep the start) | tail (keep the end)
    parallel: int = 2
    strategy: str | None = None


def read_document(name: str) -> str:
    if name == "-":
        return sys.stdin.read()
    try:
        return Path(name).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read {name}: {e}") from None


def prompt_text(instruction: str, document: str) -> str:
    return f"{document}\n\n{instruction}"


def build_prompt(tokenizer, instruction: str, document: str, chat: bool, limit: int, truncate: str) -> tuple[list[int], int]:
    """Prompt ids within ``limit`` tokens (truncating the document if asked) and tokens dropped."""
    ids = encode_prompt(tokenizer, prompt_text(instruction, document), chat)
    if len(ids) <= limit:
        return ids, 0
    if truncate == "none":
        raise InputError(f"the prompt has {len(ids)} tokens; the plan supports at most {limit} "
                         "(use --truncate head|tail)")
    doc_ids = tokenizer(document, add_special_tokens=False)["input_ids"]
    over = len(ids) - limit
    for _ in range(4):  # re-tokenising the cut text can shift the count by a few tokens
        keep = doc_ids[: max(0, len(doc_ids) - over)] if truncate == "head" else doc_ids[over:]
        ids = encode_prompt(tokenizer, prompt_text(instruction, tokenizer.decode(keep)), chat)
        if len(ids) <= limit:
            return ids, len(doc_ids) - len(keep)
        over += len(ids) - limit
    raise InputError(f"could not truncate the document to {limit} tokens")


def done_documents(results: Path) -> set[str]:
    done = set()
    if results.exists():
        for line in results.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "answer" in row and "error" not in row:
                done.add(row["document"])
    return done


def run_job(plan: Plan, pipe: Pipeline, source, documents: list[str], results: Path, job: JobConfig) -> dict:
    """Analyse ``documents``; returns a summary. Raises nothing per document: failures are collected."""
    tokenizer = source.tokenizer()
    eos = source.eos_token_ids()
    context = source.config.max_position_embeddings
    strategy = job.strategy or plan.strategy
    sp = plan.strategies[strategy]
    pipe.deploy(plan.model_name, sp.stages, DTYPES[plan.dtype])
    skip = done_documents(results)
    todo = [d for d in documents if d not in skip]
    if skip & set(documents):
        log.warning("skipping %d documents already in %s", len(set(documents) & skip), results)
    lock = threading.Lock()
    failures: dict[str, str] = {}
    stats = {"documents": 0, "prompt_tokens": 0, "new_tokens": 0}
    t0 = time.perf_counter()
    bar = tqdm(total=len(todo), desc="documents", unit="doc", file=sys.stderr, disable=not sys.stderr.isatty())

    def one(name: str) -> dict:
        ids, dropped = build_prompt(tokenizer, job.instruction, read_document(name), job.chat, plan.max_len,
                                    job.truncate)
        slices = plan.slices_for(len(ids), strategy)
        seqs = []

        def open_runner(max_len):
            seq = pipe.open(max_len)
            seqs.append(seq)
            return RemoteRunner(seq)

        try:
            r = generate_ids(open_runner, tokenizer, ids, context=context, eos_ids=eos,
                             max_new_tokens=job.max_new_tokens, sampling=SamplingParams(), slices=slices)
        finally:
            for seq in seqs:
                seq.close()
        return {"document": name, "answer": r.text, "prompt_tokens": r.prompt_tokens,
                "answer_tokens": len(r.token_ids), "truncated_tokens": dropped, "slices": len(slices),
                "prefill_s": round(r.prefill_s, 4),
                "decode_tokens_per_s": round(len(r.token_ids) / r.decode_s, 2) if r.decode_s > 0 else None,
                "token_ids": r.token_ids}

    results.parent.mkdir(parents=True, exist_ok=True)
    with results.open("a", encoding="utf-8") as out, ThreadPoolExecutor(max_workers=max(1, job.parallel)) as pool:
        futures = {pool.submit(one, d): d for d in todo}
        for fut in as_completed(futures):
            name = futures[fut]
            try:
                row = fut.result()
            except HpipeError as e:
                failures[name] = str(e)
                log.error("%s: %s", name, e)
            else:
                with lock:
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    stats["documents"] += 1
                    stats["prompt_tokens"] += row["prompt_tokens"]
                    stats["new_tokens"] += row["answer_tokens"]
            bar.update(1)
            elapsed = time.perf_counter() - t0
            bar.set_postfix_str(f"{(stats['prompt_tokens'] + stats['new_tokens']) / max(elapsed, 1e-9):.0f} tok/s")
    bar.close()
    elapsed = time.perf_counter() - t0
    return {**stats, "skipped": len(documents) - len(todo), "failed": failures, "elapsed_s": round(elapsed, 3),
            "tokens_per_s": round((stats["prompt_tokens"] + stats["new_tokens"]) / elapsed, 1) if elapsed else None,
            "strategy": strategy}
