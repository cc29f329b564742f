"""``hpipe run``'s long documents as requests of its engine (:mod:`hpipe.app.long_docs` says how
a document is cut and combined).

Each part's prompt, and each reduce or refine prompt, is a request of the job's engine, tagged
with its document: all parts of all documents are in flight together (up to ``--parallel``), and
a document's next prompts are added as its answers come in. Every answer is written to the results
file as it comes (a line with ``"part"``), keyed by its prompt like any answer, so a job stopped
half-way reads them back and asks again only what it had not: no part is computed twice. The
document's own line, written last, has the final answer and ``"long"``: the method, each part's
token span and answer, the reduce rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from hpipe.app.long_docs import SLACK, LongDocument, Templates, cut, groups
from hpipe.app.results import answer_key
from hpipe.core.errors import InputError
from hpipe.model.generate.local import encode_prompt


@dataclass
class Prompt:
    """One prompt to ask: its ids, answer budget, key, and what to do with its answer."""

    ids: list[int]
    key: str
    done: Callable[[str], None]
    row: dict = field(default_factory=dict)  # what its results line says besides the answer


class LongJob:
    """The long documents of one job: their prompts, as their answers allow.

    ``submit(prompt)`` asks the engine (the answer comes back through :meth:`answered`);
    ``emit(row)`` writes a results line; ``stored`` holds the answers the results file has already,
    by key."""

    def __init__(self, tokenizer, chat: bool, limit: int, max_new_tokens: int, templates: Templates,
                 settings: dict, stored: dict[str, str], submit: Callable[[Prompt], None],
                 emit: Callable[[LongDocument, dict], None]):
        self.tokenizer, self.chat, self.limit, self.max_new_tokens = tokenizer, chat, limit, max_new_tokens
        self.templates, self.settings, self.stored = templates, settings, stored
        self.submit, self.emit = submit, emit
        self.computed = self.reused = 0

    # --- cutting -------------------------------------------------------------------------------
    def tokens(self, text: str) -> list[int]:
        return encode_prompt(self.tokenizer, text, self.chat)

    def document(self, name: str, question: str, text: str, method: str) -> LongDocument:
        """``text`` cut for ``method``, every part's prompt within the plan's length."""
        probe = LongDocument(name, question, method, [], self.templates)
        template = self.templates.refine if method == "refine" else self.templates.map
        overhead = len(self.tokens(template.format(instruction=question, text="", part=99, parts=99,
                                                   answer="", answers="")))
        if method == "refine":  # the answer so far rides along in every prompt but the first
            overhead += self.max_new_tokens
        size = self.limit - overhead - self.max_new_tokens - SLACK
        for _ in range(4):  # a part whose prompt still runs over: cut smaller
            probe.parts = cut(self.tokenizer, text, size)
            longest = max(len(self.tokens(probe.map_text(i))) for i in range(len(probe.parts)))
            if longest + (self.max_new_tokens if method == "refine" else 0) <= self.limit:
                return probe
            size -= longest - self.limit + SLACK
        raise InputError(f"{name}: could not cut the document into parts of {self.limit} tokens")

    # --- asking --------------------------------------------------------------------------------
    def ask(self, doc: LongDocument, text: str, row: dict, done: Callable[[str], None]) -> None:
        """Ask ``text`` of the engine, or take its stored answer."""
        ids = self.tokens(text)
        if len(ids) > self.limit:
            raise InputError(f"{doc.name}: a {row.get('stage')} prompt has {len(ids)} tokens, over the "
                             f"plan's {self.limit} (a template too long for it?)")
        key = answer_key(ids, **self.settings)
        if key in self.stored:
            self.reused += 1
            done(self.stored[key])
            return
        self.computed += 1
        self.submit(Prompt(ids, key, done, {"document": doc.name, **row}))

    def start(self, doc: LongDocument) -> None:
        if doc.method == "refine":
            self._refine(doc, 0)
            return
        for i, p in enumerate(doc.parts):
            self.ask(doc, doc.map_text(i), {"stage": "map", "part": i + 1, "of": len(doc.parts),
                                            "span": [p.start, p.end]},
                     lambda answer, i=i: self._mapped(doc, i, answer))

    def _mapped(self, doc: LongDocument, i: int, answer: str) -> None:
        doc.answers[i] = answer
        if len(doc.answers) == len(doc.parts):
            kept = doc.supported()
            if len(kept) == 1:  # one part bears an answer out: that is the answer
                doc.answer = doc.answers[kept[0]]
                self.emit(doc, {})
                return
            self._reduce(doc, [doc.answers[j] for j in kept])

    def _reduce(self, doc: LongDocument, answers: list[str]) -> None:
        """One round: groups of answers that fit one reduce prompt each; their answers the next
        round's, until one answer is left."""
        if len(answers) == 1 and doc.reduce_rounds:
            doc.answer = answers[0]
            self.emit(doc, {})
            return
        overhead = len(self.tokens(doc.reduce_text([])))
        lengths = [len(self.tokenizer(a, add_special_tokens=False)["input_ids"]) + 8 for a in answers]
        runs = groups(lengths, self.limit - overhead - self.max_new_tokens - SLACK)
        combined: dict[int, str] = {}
        round_no = len(doc.reduce_rounds) + 1
        doc.reduce_rounds.append([])

        def reduced(g: int, answer: str) -> None:
            combined[g] = answer
            if len(combined) == len(runs):
                doc.reduce_rounds[round_no - 1] = [combined[j] for j in range(len(runs))]
                self._reduce(doc, doc.reduce_rounds[round_no - 1])

        for g, (a, b) in enumerate(runs):
            self.ask(doc, doc.reduce_text(answers[a:b], a + 1), {"stage": "reduce", "round": round_no,
                                                                 "answers": [a + 1, b]},
                     lambda answer, g=g: reduced(g, answer))

    def _refine(self, doc: LongDocument, i: int) -> None:
        p = doc.parts[i]

        def refined(answer: str) -> None:
            doc.answers[i] = doc.answer = answer
            if i + 1 < len(doc.parts):
                self._refine(doc, i + 1)
            else:
                self.emit(doc, {})

        self.ask(doc, doc.refine_text(i), {"stage": "refine", "part": i + 1, "of": len(doc.parts),
                                           "span": [p.start, p.end]}, refined)
