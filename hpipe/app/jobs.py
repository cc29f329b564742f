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
the same settings are skipped, so an interrupted job resumes where it stopped. A document longer
than the plan allows is cut into parts and answered part by part (``--long``,
:mod:`hpipe.app.long_docs`; each part a request beside the others), refused, or truncated.
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

from hpipe.app.long_docs import METHODS, LongDocument, Templates
from hpipe.app.long_job import LongJob, Prompt
from hpipe.app.results import ResultsFile, answer_key
from hpipe.core.cluster import ClusterSpec
from hpipe.core.errors import HpipeError, InputError
from hpipe.core.plan import Plan, Stage
from hpipe.model.generate.local import encode_prompt
from hpipe.model.generate.speculate import refused
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
    truncate: str = "none"  # --long truncate keeps the start (head, also for "none") or the end (tail)
    long: str = "map-reduce"  # documents over the plan's length: map-reduce | refine | truncate | refuse
    templates: Templates = Templates()  # the long methods' prompts (hpipe.app.long_docs)
    speculate: str = "off"  # "ngram": decode speculatively (runtime.coordinator.speculation)
    parallel: int = 16      # prompts in flight at once (a long document's parts each count)
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
                         "in the model's context for the answer; use --long map-reduce|refine|truncate)")
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
    long = summary.get("long")
    if long and long["documents"]:
        line += (f"; {long['documents']} long documents in {long['parts']} parts ({long['computed']} prompts "
                 f"computed, {long['reused']} read back)")
    cache = summary["prefix_cache"]
    if cache and cache["lookups"]:
        line += (f"; prefix cache: {cache['hits']} of {cache['lookups']} prompts hit, {cache['cached_tokens']} "
                 f"tokens not prefilled, {cache['evictions']} blocks evicted")
    return line


def stored_answers(path: Path) -> dict[str, str]:
    """The answers a results file holds, by key (the long methods' parts among them)."""
    out = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and "answer" in row and "error" not in row and "key" in row:
                out[row["key"]] = row["answer"]
    return out


class JobRun:
    """One ``hpipe run``: its prompts, its results file, its tallies."""

    def __init__(self, plan: Plan, source, out: ResultsFile, job: JobConfig, stored: dict[str, str]):
        self.plan, self.job, self.out = plan, job, out
        self.tokenizer = source.tokenizer()
        self.eos = frozenset(() if job.ignore_eos else source.eos_token_ids())
        self.strategy = job.strategy or plan.strategy
        self.settings = {"model": plan.model_name, "dtype": plan.dtype, "max_new_tokens": job.max_new_tokens,
                         "ignore_eos": job.ignore_eos, "sampling": "greedy"}
        self.failures: dict[str, str] = {}
        self.stats = {"documents": 0, "answers": 0, "prompt_tokens": 0, "cached_tokens": 0, "new_tokens": 0}
        self.prompts: list[tuple] = []  # (name, question, ids, dropped, key)
        self.long_docs: list[tuple[LongDocument, str]] = []  # and the key of its own line
        self.skipped = self.documents_read = 0
        self.engine = self.bar = None
        self.t0 = time.perf_counter()
        self.long = LongJob(self.tokenizer, job.chat, prompt_limit(plan), job.max_new_tokens, job.templates,
                            self.settings, stored, self._submit, self._long_done)

    def label(self, name: str, question: str | None) -> str:
        return name if not self.job.questions or question is None else f"{name} [{question}]"

    def failed(self, name: str, question: str | None, key: str | None, error: str) -> None:
        self.failures[self.label(name, question)] = error
        log.error("%s: %s", self.label(name, question), error)
        self.out.append({"document": name, **({"question": question} if self.job.questions else {}), "key": key,
                         "error": error})

    # --- reading ----------------------------------------------------------------------------------
    def read(self, documents: list[str], answered: set[str]) -> None:
        """Every (document, question) prompt not answered yet; a long document's parts where its
        method cuts it."""
        for name in documents:
            try:
                text = read_document(name)
                if not text.strip():
                    raise InputError("the document is empty")
            except HpipeError as e:
                self.failed(name, None, None, str(e))
                continue
            self.documents_read += 1
            for question in self.job.questions or (self.job.instruction,):
                try:
                    self._prompt(name, question, text, answered)
                except HpipeError as e:
                    self.failed(name, question, None, str(e))

    def _prompt(self, name: str, question: str, text: str, answered: set[str]) -> None:
        job, limit = self.job, prompt_limit(self.plan)
        ids = encode_prompt(self.tokenizer, prompt_text(question, text), job.chat)
        method = job.long if len(ids) > limit else "fits"
        if method in ("map-reduce", "refine"):
            key = answer_key(ids, **self.settings, long=method, templates=vars(job.templates), limit=limit)
            if key in answered:
                self.skipped += 1
            else:
                self.long_docs.append((self.long.document(name, question, text, method), key))
            return
        side = "none" if method in ("fits", "refuse") else "head" if job.truncate == "none" else job.truncate
        ids, dropped = build_prompt(self.tokenizer, question, text, job.chat, limit, side)
        key = answer_key(ids, **self.settings)
        if key in answered:
            self.skipped += 1
        else:
            self.prompts.append((name, question, ids, dropped, key))

    # --- answers ----------------------------------------------------------------------------------
    def _row(self, r: Request) -> dict:
        return {"answer": self.tokenizer.decode(r.tokens, skip_special_tokens=True),
                "prompt_tokens": len(r.prompt), "cached_tokens": r.cached_tokens, "answer_tokens": len(r.tokens),
                # the answer budget, cut below --max-new-tokens where the context is short
                "max_new_tokens": r.max_new_tokens, "slices": len(r.slices),
                "first_token_s": round(r.first_token_s - r.arrival_s, 4),
                # from when it started running: what its prefill took, queueing aside
                "first_token_after_start_s": round(r.first_token_s - r.admitted_s, 4),
                "decode_tokens_per_s": round((len(r.tokens) - 1) / (r.done_s - r.first_token_s), 2)
                if len(r.tokens) > 1 and r.done_s > r.first_token_s else None,
                "token_ids": r.tokens}

    def _count(self, r: Request) -> None:
        self.stats["prompt_tokens"] += len(r.prompt)
        self.stats["cached_tokens"] += r.cached_tokens
        self.stats["new_tokens"] += len(r.tokens)
        self.bar.update(1)
        elapsed = time.perf_counter() - self.t0
        self.bar.set_postfix_str(f"{(self.stats['prompt_tokens'] + self.stats['new_tokens']) / max(elapsed, 1e-9):.0f}"
                                 " tok/s")

    def finished(self, r: Request) -> None:
        name, question, key, dropped = r.tag
        if r.error:
            self.failed(name, question, key, r.error)
        else:
            self.out.append({"document": name, **({"question": question} if self.job.questions else {}),
                             "key": key, **self._row(r), "truncated_tokens": dropped})
            self.stats["answers"] += 1
        self._count(r)

    def _submit(self, p: Prompt) -> None:
        budget = answer_budget(self.job.max_new_tokens, len(p.ids), self.plan.model.max_position_embeddings)
        self.bar.total += 1  # a long document's prompts are counted as they are asked
        self.bar.refresh()
        self.engine.add(Request(p.ids, budget, eos=self.eos, slicer=self.plan.slicer(self.strategy), tag=p,
                                on_done=self._part_done))

    def _part_done(self, r: Request) -> None:
        p: Prompt = r.tag
        if r.error:
            self.failed(p.row["document"], None, p.key, f"{p.row.get('stage')} prompt: {r.error}")
        else:
            row = self._row(r)
            self.out.append({**p.row, "key": p.key, **row})
            try:
                p.done(row["answer"])  # the document's next prompts (a reduce that cannot fit: its error)
            except HpipeError as e:
                self.failed(p.row["document"], None, None, str(e))
        self._count(r)

    def _long_done(self, doc: LongDocument, extra: dict) -> None:
        key = next(k for d, k in self.long_docs if d is doc)
        if self.label(doc.name, doc.question) in self.failures:
            return
        self.out.append({"document": doc.name, **({"question": doc.question} if self.job.questions else {}),
                         "key": key, "answer": doc.answer, "long": doc.record(), **extra})
        self.stats["answers"] += 1

    # --- running ----------------------------------------------------------------------------------
    def run(self, engine) -> None:
        self.engine = engine
        long = bool(self.long_docs)
        self.bar = tqdm(total=len(self.prompts), desc="prompts" if long else "documents",
                        unit="prompt" if long else "doc", file=sys.stderr, disable=not sys.stderr.isatty())
        for name, question, ids, dropped, key in self.prompts:
            budget = answer_budget(self.job.max_new_tokens, len(ids), self.plan.model.max_position_embeddings)
            if budget < self.job.max_new_tokens:
                log.warning("%s: the model's context leaves room for %d answer tokens of the %d asked", name, budget,
                            self.job.max_new_tokens)
            engine.add(Request(ids, budget, eos=self.eos, slicer=self.plan.slicer(self.strategy),
                               tag=(name, question, key, dropped), on_done=self.finished))
        for doc, _ in self.long_docs:
            try:
                self.long.start(doc)
            except HpipeError as e:
                self.failed(doc.name, doc.question, None, str(e))
        try:
            engine.run()  # Ctrl-C stops it here: every answer so far is on disk, whole
        except HpipeError as e:
            engine.fail_all(str(e))
        finally:
            self.bar.close()

    def summary(self, deployed, redeploy) -> dict:
        elapsed = time.perf_counter() - self.t0
        stats, engine = self.stats, self.engine
        stats["documents"] = self.documents_read if self.job.questions else stats["answers"]
        return {**stats, "skipped": self.skipped, "failed": self.failures, "elapsed_s": round(elapsed, 3),
                "tokens_per_s": round((stats["prompt_tokens"] + stats["new_tokens"]) / elapsed, 1) if elapsed else None,
                "strategy": self.strategy, "policy": self.job.policy, "micro_batches": engine.micro_batches,
                "prefix_cache": engine.cache.stats() if engine.cache is not None else None,
                "seesaw_switches": deployed.phases.switches if deployed.phases is not None else None,
                "speculation": {"drafted": engine.drafted, "kept": engine.kept} if self.job.speculate != "off" else None,
                "long": {"documents": len(self.long_docs), "parts": sum(len(d.parts) for d, _ in self.long_docs),
                         "computed": self.long.computed, "reused": self.long.reused},
                "recoveries": [{**event, **(resumed or {})}
                               for event, resumed in itertools.zip_longest(redeploy.events, engine.resumes)]}


def run_job(plan: Plan, cluster: ClusterSpec, source, documents: list[str], results: Path, job: JobConfig,
            replan: Callable[[list[str], list[Stage]], list[Stage]] | None = None,
            on_engine: Callable[[object, object], None] | None = None) -> dict:
    """Analyse ``documents``; returns a summary. Raises nothing per document: each failure is
    recorded in the results file with its error, and in the summary. A stage that dies is waited
    for and redeployed, or (``replan(survivors, stages)`` given, :mod:`hpipe.app.replan`) planned around, and the documents in
    flight go on (:mod:`runtime.coordinator.recovery`); the summary's ``recoveries`` says what happened.
    ``on_engine(deployed, engine)`` is told of the pipeline once it is up (``--serve-page`` watches it)."""
    if job.policy not in POLICIES and job.policy != "seesaw":
        raise InputError(f"unknown policy {job.policy!r} (choose from {', '.join(POLICIES)}, seesaw)")
    if job.long not in METHODS:
        raise InputError(f"unknown --long method {job.long!r} (choose from {', '.join(METHODS)})")
    why = refused(source.gguf is not None and not job.dequantize, [d.device for d in cluster.daemons]) \
        if job.speculate != "off" else None
    if why or (job.speculate != "off" and job.policy == "seesaw"):
        raise InputError(why or "--speculate does not run with --policy seesaw (a layout switch moves KV that "
                                "guesses not kept may still occupy)")
    with ResultsFile(results) as out:
        run = JobRun(plan, source, out, job, stored_answers(results))
        run.read(documents, out.answered())
        if run.skipped:
            log.warning("skipping %d answers already given in %s", run.skipped, results)
        deployed = deploy(plan, cluster, strategy=run.strategy, grace_s=job.grace_s, replan=replan,
                          dequantize=job.dequantize, seesaw=job.policy == "seesaw")
        run.t0 = time.perf_counter()
        policy = deployed.phases if job.policy == "seesaw" else POLICIES[job.policy]()
        engine = deployed.engine(policy, max_running=max(1, job.parallel), prefix_cache=job.prefix_cache,
                                 speculate=job.speculate)
        if on_engine is not None:
            on_engine(deployed, engine)
        try:
            run.run(engine)
        finally:
            engine.close()
            deployed.close()
    return run.summary(deployed, deployed.recovery)
