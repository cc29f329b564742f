"""``hpipe run``: analyse many documents with one instruction, or several questions, on a deployed plan.

Each document becomes one prompt per question (document, blank line, question; in the chat template
with ``--chat``: small models answer a question asked after the text far better than one asked
before it), sliced by the plan's slicing for its length. The document comes first, so that every
question about it shares its prompt's blocks: the prefix cache
(:mod:`runtime.coordinator.prefix_cache`) prefills a document once, and each later question only
its own tokens. Questions are added document by document, so one document's questions run close
together while its blocks are cached. Up to ``parallel`` prompts run at once on one engine
(:mod:`runtime.coordinator.engine`): their prefill chunks and decode tokens share micro-batches, so
one pass over each stage's weights serves every prompt in flight. Results are appended to a JSONL
file, one whole line per answer as it finishes, a failed one with its error
(:mod:`hpipe.app.results`); answers already given to the same prompt (document and question) with
the same settings are skipped, so an interrupted job resumes where it stopped.
"""

from __future__ import annotations

import itertools
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from hpipe.app.results import ResultsFile, answer_key
from hpipe.core.cluster import ClusterSpec
from hpipe.core.errors import HpipeError, InputError
from hpipe.core.plan import Plan, Stage
from hpipe.model.generate.local import encode_prompt
from runtime.coordinator.deploy import deploy
from runtime.coordinator.engine import Request
from runtime.coordinator.policies import POLICIES
from runtime.coordinator.recovery import GRACE_S

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobConfig:
    instruction: str
    chat: bool = False
    max_new_tokens: int = 128
    truncate: str = "none"  # none | head (keep the start) | tail (keep the end)
    parallel: int = 16      # documents in flight at once
    strategy: str | None = None
    policy: str = "gllm"     # how micro-batches are formed (runtime.coordinator.policies)
    ignore_eos: bool = False  # decode max_new_tokens whatever the model says (for benchmarks)
    grace_s: float = GRACE_S  # how long a broken pipeline waits for its daemons (runtime.coordinator.recovery)
    dequantize: bool = False  # a GGUF model's weights as float32, not the file's blocks
    questions: tuple[str, ...] = ()  # ask each of these about each document (instead of the instruction)
    prefix_cache: float | None = 1.0  # the cache's budget of idle blocks, a share of the pool (None: off)


def read_document(name: str) -> str:
    if name == "-":
        return sys.stdin.read()
    try:
        return Path(name).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read {name}: {e}") from None


def read_questions(name: str) -> tuple[str, ...]:
    """Questions from a file: one a line, or JSON lines (a string, or an object with "question")."""
    try:
        lines = Path(name).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read the questions in {name}: {e}") from None
    out = []
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        if line[0] in '{"':
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{name}:{n}: not a JSON line ({e})") from None
            if isinstance(item, dict):
                item = item.get("question")
            if not isinstance(item, str) or not item.strip():
                raise InputError(f'{name}:{n}: a JSON line is a question string or an object with "question"')
            line = item.strip()
        out.append(line)
    if not out:
        raise InputError(f"{name} holds no question")
    return tuple(out)


def prompt_text(instruction: str, document: str) -> str:
    return f"{document}\n\n{instruction}"


def prompt_limit(plan: Plan) -> int:
    """The longest prompt a job takes: the plan's length, and one position less than the model's
    context, so that there is room for at least one answer token."""
    return min(plan.max_len, plan.model.max_position_embeddings - 1)


def answer_budget(max_new_tokens: int, prompt_tokens: int, context: int) -> int:
    """The answer tokens a prompt leaves room for, up to ``max_new_tokens``."""
    return max(1, min(max_new_tokens, context - prompt_tokens))


def build_prompt(tokenizer, instruction: str, document: str, chat: bool, limit: int, truncate: str) -> tuple[list[int], int]:
    """Prompt ids within ``limit`` tokens (truncating the document if asked) and tokens dropped."""
    ids = encode_prompt(tokenizer, prompt_text(instruction, document), chat)
    if len(ids) <= limit:
        return ids, 0
    if truncate == "none":
        raise InputError(f"the prompt has {len(ids)} tokens; at most {limit} fit (the plan's length, with room "
                         "in the model's context for the answer; use --truncate head|tail)")
    doc_ids = tokenizer(document, add_special_tokens=False)["input_ids"]
    over = len(ids) - limit
    for _ in range(4):  # re-tokenising the cut text can shift the count by a few tokens
        keep = doc_ids[: max(0, len(doc_ids) - over)] if truncate == "head" else doc_ids[over:]
        ids = encode_prompt(tokenizer, prompt_text(instruction, tokenizer.decode(keep)), chat)
        if len(ids) <= limit:
            return ids, len(doc_ids) - len(keep)
        over += len(ids) - limit
    raise InputError(f"could not truncate the document to {limit} tokens")


def describe(summary: dict) -> str:
    """A job's summary in one line."""
    line = (f"{summary['documents']} documents, {summary['answers']} answers, {summary['skipped']} skipped, "
            f"{len(summary['failed'])} failed; {summary['tokens_per_s']} tokens/s")
    cache = summary["prefix_cache"]
    if cache and cache["lookups"]:
        line += (f"; prefix cache: {cache['hits']} of {cache['lookups']} prompts hit, {cache['cached_tokens']} "
                 f"tokens not prefilled, {cache['evictions']} blocks evicted")
    return line


def run_job(plan: Plan, cluster: ClusterSpec, source, documents: list[str], results: Path, job: JobConfig,
            replan: Callable[[list[str], list[Stage]], list[Stage]] | None = None) -> dict:
    """Analyse ``documents``; returns a summary. Raises nothing per document: each failure is
    recorded in the results file with its error, and in the summary. A stage that dies is waited
    for and redeployed, or (``replan(survivors, stages)`` given, :mod:`hpipe.app.replan`) planned around, and the documents in
    flight go on (:mod:`runtime.coordinator.recovery`); the summary's ``recoveries`` says what happened."""
    tokenizer = source.tokenizer()
    eos = frozenset(() if job.ignore_eos else source.eos_token_ids())
    strategy = job.strategy or plan.strategy
    if job.policy not in POLICIES and job.policy != "seesaw":
        raise InputError(f"unknown policy {job.policy!r} (choose from {', '.join(POLICIES)}, seesaw)")
    settings = {"model": plan.model_name, "dtype": plan.dtype, "max_new_tokens": job.max_new_tokens,
                "ignore_eos": job.ignore_eos, "sampling": "greedy"}
    questions = job.questions or (job.instruction,)
    failures: dict[str, str] = {}
    stats = {"documents": 0, "answers": 0, "prompt_tokens": 0, "cached_tokens": 0, "new_tokens": 0}
    with ResultsFile(results) as out:
        answered = out.answered()

        def failed(name: str, question: str | None, key: str | None, error: str) -> None:
            label = name if not job.questions or question is None else f"{name} [{question}]"
            failures[label] = error
            log.error("%s: %s", label, error)
            out.append({"document": name, **({"question": question} if job.questions else {}), "key": key,
                        "error": error})

        prompts, skipped, documents_read = [], 0, 0
        for name in documents:
            try:
                text = read_document(name)
                if not text.strip():
                    raise InputError("the document is empty")
            except HpipeError as e:
                failed(name, None, None, str(e))
                continue
            documents_read += 1
            for question in questions:
                try:
                    ids, dropped = build_prompt(tokenizer, question, text, job.chat, prompt_limit(plan), job.truncate)
                except HpipeError as e:
                    failed(name, question, None, str(e))
                    continue
                key = answer_key(ids, **settings)
                if key in answered:
                    skipped += 1
                else:
                    prompts.append((name, question, ids, dropped, key))
        if skipped:
            log.warning("skipping %d answers already given in %s", skipped, results)
        deployed = deploy(plan, cluster, strategy=strategy, grace_s=job.grace_s, replan=replan,
                          dequantize=job.dequantize, seesaw=job.policy == "seesaw")
        redeploy = deployed.recovery
        t0 = time.perf_counter()
        bar = tqdm(total=len(prompts), desc="documents", unit="doc", file=sys.stderr, disable=not sys.stderr.isatty())
        policy = deployed.phases if job.policy == "seesaw" else POLICIES[job.policy]()
        engine = deployed.engine(policy, max_running=max(1, job.parallel),
                                 prefix_cache=job.prefix_cache)

        def finished(r: Request) -> None:
            name, question, key, dropped = r.tag
            if r.error:
                failed(name, question, key, r.error)
            else:
                out.append({"document": name, **({"question": question} if job.questions else {}), "key": key,
                            "answer": tokenizer.decode(r.tokens, skip_special_tokens=True),
                            "prompt_tokens": len(r.prompt), "cached_tokens": r.cached_tokens,
                            "answer_tokens": len(r.tokens),
                            # the answer budget, cut below --max-new-tokens where the context is short
                            "max_new_tokens": r.max_new_tokens,
                            "truncated_tokens": dropped, "slices": len(r.slices),
                            "first_token_s": round(r.first_token_s - r.arrival_s, 4),
                            # from when it started running: what its prefill took, queueing aside
                            "first_token_after_start_s": round(r.first_token_s - r.admitted_s, 4),
                            "decode_tokens_per_s": round((len(r.tokens) - 1) / (r.done_s - r.first_token_s), 2)
                            if len(r.tokens) > 1 and r.done_s > r.first_token_s else None,
                            "token_ids": r.tokens})
                stats["answers"] += 1
                stats["prompt_tokens"] += len(r.prompt)
                stats["cached_tokens"] += r.cached_tokens
                stats["new_tokens"] += len(r.tokens)
            bar.update(1)
            elapsed = time.perf_counter() - t0
            bar.set_postfix_str(f"{(stats['prompt_tokens'] + stats['new_tokens']) / max(elapsed, 1e-9):.0f} tok/s")

        for name, question, ids, dropped, key in prompts:
            budget = answer_budget(job.max_new_tokens, len(ids), plan.model.max_position_embeddings)
            if budget < job.max_new_tokens:
                log.warning("%s: the model's context leaves room for %d answer tokens of the %d asked", name, budget,
                            job.max_new_tokens)
            engine.add(Request(ids, budget,
                               eos=eos, slicer=plan.slicer(strategy), tag=(name, question, key, dropped),
                               on_done=finished))
        try:
            engine.run()  # Ctrl-C stops it here: every answer so far is on disk, whole
        except HpipeError as e:
            engine.fail_all(str(e))
        finally:
            engine.close()
            deployed.close()
            bar.close()
    elapsed = time.perf_counter() - t0
    stats["documents"] = documents_read if job.questions else stats["answers"]
    return {**stats, "skipped": skipped, "failed": failures, "elapsed_s": round(elapsed, 3),
            "tokens_per_s": round((stats["prompt_tokens"] + stats["new_tokens"]) / elapsed, 1) if elapsed else None,
            "strategy": strategy, "policy": job.policy, "micro_batches": engine.micro_batches,
            "prefix_cache": engine.cache.stats() if engine.cache is not None else None,
            "seesaw_switches": deployed.phases.switches if deployed.phases is not None else None,
            "recoveries": [{**event, **(resumed or {})}
                           for event, resumed in itertools.zip_longest(redeploy.events, engine.resumes)]}
