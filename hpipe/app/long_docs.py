"""Documents longer than the plan's length (#68): cut into parts on token boundaries, each part
answered, the answers combined, as LangChain's map-reduce and refine chains and LlamaIndex's tree
summarize do it, but with every part a request of the same engine, so that a pipeline that holds
many sequences computes the parts of all documents together.

- ``map-reduce``: each part is asked the instruction (the map prompt); the partial answers, in
  order, are asked to be combined (the reduce prompt); where they do not fit in one prompt, groups
  that fit are combined first, and their answers again, until one remains. Before that, a partial
  answer its part does not support is left out (:func:`support`: fewer than half of its words
  beyond the question's occur in its part, or "nothing relevant"), unless no answer is supported;
  where one answer alone is, it is the answer. A small model asked about a part that has nothing
  on the question answers anyway, and its reduce then picks among inventions: SmolLM2-135M, asked
  for a code planted in one part of eleven, gave it from that part and ten other "codes" from the
  rest, and the reduce chose one of those.
- ``refine``: the parts in order, each asked to improve the answer so far (the refine prompt).

Parts end at a paragraph or a sentence end where one lies in a part's second half, and the next
part begins ``overlap`` tokens before, so that a sentence cut by a part's end is read whole by one
of them. A part is sized to the plan's length less its prompt's other tokens and the answer
budget. Every prompt is a template a user can replace (``--map-prompt`` ...); placeholders:
``{instruction}``, ``{text}`` (a part), ``{part}`` and ``{parts}`` (its number, from 1, and how
many), ``{answers}`` (reduce: the partial answers, each under a heading), ``{answer}`` (refine:
the answer so far).
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field

from hpipe.core.errors import InputError

METHODS = ("map-reduce", "refine", "truncate", "refuse")
MAP_PROMPT = ("This is part {part} of {parts} of a document:\n\n{text}\n\n{instruction}\n"
              "Answer from this part alone; if it says nothing about this, answer \"Nothing relevant.\"")
REDUCE_PROMPT = ("Answers to one question, each from a part of the same document, in order:\n\n{answers}\n\n"
                 "{instruction}\nCombine them into one answer; leave out the parts with nothing relevant.")
REFINE_PROMPT = ("The answer so far, from the first parts of a document:\n{answer}\n\n"
                 "The next part ({part} of {parts}):\n\n{text}\n\n{instruction}\n"
                 "Give the answer again, improved with what this part adds.")
#: tokens of overlap between consecutive parts
OVERLAP = 64
#: tokens a part keeps in reserve: a part's text tokenised inside its prompt can take a few more
#: tokens than alone
SLACK = 16
_NEEDS = {"map": {"text", "instruction"}, "reduce": {"answers", "instruction"},
          "refine": {"answer", "text", "instruction"}}
#: where a paragraph or a sentence ends: before a blank line, after a full stop followed by space
_BOUNDARY = re.compile(r"(?<=\S)(?=[ \t]*\n\s*\n)|[.!?。][\"')\]]?(?=\s)")


@dataclass(frozen=True)
class Templates:
    map: str = MAP_PROMPT
    reduce: str = REDUCE_PROMPT
    refine: str = REFINE_PROMPT

    def __post_init__(self) -> None:
        allowed = {"instruction", "text", "part", "parts", "answers", "answer"}
        for kind, needs in _NEEDS.items():
            text = getattr(self, kind)
            try:
                names = {f for _, f, _, _ in string.Formatter().parse(text) if f is not None}
            except ValueError as e:
                raise InputError(f"the {kind} prompt is not a template ({e}); write a literal brace as {{{{ or }}}}") \
                    from None
            if names - allowed:
                raise InputError(f"the {kind} prompt names {sorted(names - allowed)}; it may use "
                                 f"{', '.join('{' + n + '}' for n in sorted(allowed))}")
            if needs - names:
                raise InputError(f"the {kind} prompt must contain {', '.join('{' + n + '}' for n in sorted(needs))}")


@dataclass(frozen=True)
class Part:
    """Tokens ``[start, end)`` of the document (as it tokenises alone) and their text."""

    start: int
    end: int
    text: str


def cut(tokenizer, document: str, size: int, overlap: int = OVERLAP) -> list[Part]:
    """``document`` in parts of at most ``size`` tokens, each ending at the last paragraph or
    sentence end in its second half (else at ``size``), the next beginning ``overlap`` tokens
    before that end."""
    if size < 16:
        raise InputError(f"a part would hold {size} tokens: the instruction and the answer budget leave no room "
                         "for the document in the plan's length (raise --max-len in the plan, or lower "
                         "--max-new-tokens)")
    enc = tokenizer(document, add_special_tokens=False, return_offsets_mapping=True)
    offsets = [tuple(o) for o in enc["offset_mapping"]]
    n = len(offsets)
    ends = {m.end() for m in _BOUNDARY.finditer(document)}
    # token t ends a boundary when the document's text up to its end closes a paragraph or sentence
    closes = [any(e in ends for e in range(offsets[t][1], offsets[t + 1][0] + 1)) if t + 1 < n else True
              for t in range(n)]
    overlap = min(overlap, size // 4)
    parts, start = [], 0
    while start < n:
        end = min(n, start + size)
        if end < n:
            best = next((t + 1 for t in range(end - 1, start + size // 2 - 1, -1) if closes[t]), None)
            end = best or end
        parts.append(Part(start, end, document[offsets[start][0]:offsets[end - 1][1]]))
        if end >= n:
            break
        start = max(end - overlap, start + 1)
    return parts


_WORD = re.compile(r"\w+")
_COMMON = frozenset("""a an the of to in on at by for from with and or but not no is are was were be been it its this
that these those there here as so if then than which who whom what when where why how do does did has have had
i you he she we they them his her our your their my me us part document text answer answers say says said""".split())


def support(answer: str, text: str, question: str) -> float:
    """How much of ``answer`` its part's ``text`` bears out: the share of its words, beyond common
    ones and the question's, that occur in the text (0 for an answer that says the part has nothing)."""
    if "nothing relevant" in answer.lower():
        return 0.0
    seen = set(_WORD.findall(text.lower()))
    asked = set(_WORD.findall(question.lower()))
    words = [w for w in _WORD.findall(answer.lower()) if w not in _COMMON and w not in asked]
    if not words:
        return 0.0
    return sum(w in seen for w in words) / len(words)


def answers_text(answers: list[str], first: int = 1) -> str:
    """Partial answers under headings, for the reduce prompt."""
    return "\n\n".join(f"Part {first + i}: {a.strip() or '(no answer)'}" for i, a in enumerate(answers))


@dataclass
class LongDocument:
    """One long document's parts and answers as they come in; what to ask next."""

    name: str
    question: str
    method: str
    parts: list[Part]
    templates: Templates
    answers: dict[int, str] = field(default_factory=dict)  # map: part -> its answer
    answer: str = ""  # refine: the answer so far; both: the final one
    next_part: int = 0  # refine: the part to ask next
    reduce_rounds: list[list[str]] = field(default_factory=list)  # the answers each reduce round gave

    def map_text(self, i: int) -> str:
        p = self.parts[i]
        return self.templates.map.format(instruction=self.question, text=p.text, part=i + 1, parts=len(self.parts),
                                         answers="", answer="")

    def refine_text(self, i: int) -> str:
        p = self.parts[i]
        if i == 0:  # nothing to refine yet: the first part is asked as map asks it
            return self.map_text(0)
        return self.templates.refine.format(instruction=self.question, text=p.text, part=i + 1,
                                            parts=len(self.parts), answer=self.answer, answers="")

    def reduce_text(self, answers: list[str], first: int = 1) -> str:
        return self.templates.reduce.format(instruction=self.question, answers=answers_text(answers, first),
                                            text="", part="", parts=len(self.parts), answer="")

    def supported(self) -> list[int]:
        """The parts whose answers their text supports (every part where none is)."""
        scores = [support(self.answers.get(i, ""), p.text, self.question) for i, p in enumerate(self.parts)]
        kept = [i for i, s in enumerate(scores) if s >= 0.5]
        return kept or list(range(len(self.parts)))

    def record(self) -> dict:
        """What the result line says of how the answer came about."""
        used = set(self.supported()) if self.method == "map-reduce" and self.answers else set(self.answers)
        out = {"method": self.method,
               "parts": [{"span": [p.start, p.end], "answer": self.answers.get(i, ""),
                          "support": round(support(self.answers.get(i, ""), p.text, self.question), 2),
                          "used": i in used}
                         for i, p in enumerate(self.parts)]}
        if self.method == "map-reduce":
            out["reduce_rounds"] = len(self.reduce_rounds)
        return out


def groups(lengths: list[int], room: int) -> list[tuple[int, int]]:
    """Consecutive runs ``[a, b)`` of items whose lengths add up to at most ``room`` (at least one
    item each, and at least two where there is more than one, so that every round shrinks)."""
    out, a = [], 0
    while a < len(lengths):
        b, used = a, 0
        while b < len(lengths) and (used + lengths[b] <= room or b - a < 2):
            used += lengths[b]
            b += 1
        out.append((a, b))
        a = b
    return out
