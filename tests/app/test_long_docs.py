"""Long documents cut into parts (hpipe.app.long_docs): token spans, ends at paragraphs and
sentences, overlap; prompts' templates checked; reduce groups that shrink every round."""

import pytest

from hpipe.app.long_docs import LongDocument, Part, Templates, answers_text, cut, groups
from hpipe.core.errors import InputError

TEXT = "\n\n".join(
    " ".join(f"Sentence {p}.{s} of paragraph {p} says something plain about the harbour." for s in range(6))
    for p in range(12))


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2.tokenizer()


def test_parts_cover_the_document_in_order_with_overlap_and_end_at_sentences(tok):
    n = len(tok(TEXT, add_special_tokens=False)["input_ids"])
    parts = cut(tok, TEXT, size=120, overlap=16)
    assert len(parts) > 3 and parts[0].start == 0 and parts[-1].end == n
    for a, b in zip(parts, parts[1:]):
        assert a.end - a.start <= 120
        assert b.start < a.end and a.end - b.start <= 16 + 1  # they overlap, by about 16 tokens
        assert a.text.rstrip().endswith(".")  # a sentence (or paragraph) end, not mid-word
    assert parts[0].text == TEXT[:len(parts[0].text)]


def test_a_text_without_sentence_ends_is_cut_at_the_size(tok):
    text = "word " * 700
    parts = cut(tok, text, size=100, overlap=10)
    assert all(p.end - p.start <= 100 for p in parts)
    assert parts[-1].end == len(tok(text, add_special_tokens=False)["input_ids"])
    assert sum(p.end - p.start for p in parts) >= 700


def test_no_room_for_a_part_is_a_clear_error(tok):
    with pytest.raises(InputError, match="leave no room for the document"):
        cut(tok, TEXT, size=8)


@pytest.mark.parametrize("templates, message", [
    (dict(map="Summarize."), r"must contain \{instruction\}, \{text\}"),
    (dict(reduce="{answers} {oops}"), r"names \['oops'\]"),
    (dict(refine="{answer {text}"), "not a template"),
])
def test_templates_are_checked(templates, message):
    with pytest.raises(InputError, match=message):
        Templates(**templates)


def test_prompts_fill_the_templates():
    doc = LongDocument("d", "Who?", "map-reduce", [Part(0, 5, "alpha"), Part(4, 9, "beta")], Templates())
    assert "part 2 of 2" in doc.map_text(1) and "beta" in doc.map_text(1) and "Who?" in doc.map_text(1)
    assert "Part 3: x" in doc.reduce_text(["x"], first=3)
    doc.answer = "so far"
    assert doc.refine_text(0) == doc.map_text(0) and "so far" in doc.refine_text(1)
    assert answers_text(["a", " "]) == "Part 1: a\n\nPart 2: (no answer)"


def test_reduce_groups_fit_the_room_and_always_shrink():
    assert groups([10, 10, 10, 10], 25) == [(0, 2), (2, 4)]
    assert groups([10, 10, 10], 100) == [(0, 3)]
    assert groups([50, 50, 50], 10) == [(0, 2), (2, 3)]  # too big alone: still two at a time
    for lengths in ([7] * 9, [30, 1, 1, 30, 2], [5]):
        runs = groups(lengths, 12)
        assert runs[0][0] == 0 and runs[-1][1] == len(lengths)
        assert all(b > a for a, b in runs) and (len(runs) < len(lengths) or len(lengths) == 1)


def _driver(tok, limit, max_new_tokens, stored, answer):
    """A LongJob whose engine answers at once with ``answer(prompt)``; what it asked and wrote."""
    from hpipe.app.long_job import LongJob

    asked, emitted = [], []

    def submit(p):
        asked.append(p)
        p.done(answer(p))

    job = LongJob(tok, False, limit, max_new_tokens, Templates(), {"model": "m"}, stored, submit,
                  lambda doc, extra: emitted.append(doc))
    return job, asked, emitted


def test_reduce_rounds_recurse_until_one_answer_and_every_prompt_fits(tok):
    """Answers too long for one reduce prompt are combined in groups, then again; each prompt
    within the plan's length; a stored answer is read back, not asked again."""
    long_answer = " ".join(["harbour"] * 40)  # supported by every part (the text speaks of the harbour)
    job, asked, emitted = _driver(tok, 256, 48, {}, lambda p: long_answer)
    doc = job.document("d", "Where?", TEXT, "map-reduce")
    assert len(doc.parts) > 6
    job.start(doc)
    assert emitted == [doc] and doc.answer == long_answer
    assert len(doc.reduce_rounds) >= 2 and len(doc.reduce_rounds[-1]) == 1
    assert all(len(p.ids) <= 256 for p in asked)
    maps = [p for p in asked if p.row["stage"] == "map"]
    assert [p.row["part"] for p in maps] == list(range(1, len(doc.parts) + 1))
    # again, with the first three answers stored: they are not asked
    stored = {p.key: long_answer for p in maps[:3]}
    job2, asked2, _ = _driver(tok, 256, 48, stored, lambda p: long_answer)
    job2.start(job2.document("d", "Where?", TEXT, "map-reduce"))
    assert job2.reused == 3 and len(asked2) == len(asked) - 3


def test_one_supported_answer_is_the_answer_and_refine_goes_in_order(tok):
    text = TEXT.replace("Sentence 5.0", "The code is 4729. Sentence 5.0")
    holder = {}

    def answer(p):  # the first part holding the code gives it; the others say they have nothing
        first = next(i for i, part in enumerate(holder["doc"].parts) if "4729" in part.text)
        return "The code is 4729." if p.row.get("part") == first + 1 else "Nothing relevant."

    job, asked, emitted = _driver(tok, 256, 16, {}, answer)
    doc = holder["doc"] = job.document("d", "What is the code?", text, "map-reduce")
    job.start(doc)
    assert emitted == [doc] and doc.answer == "The code is 4729." and doc.reduce_rounds == []
    assert [p["used"] for p in doc.record()["parts"]].count(True) == 1
    job, asked, emitted = _driver(tok, 256, 16, {}, lambda p: f"after part {p.row['part']}")
    doc = job.document("d", "Summarize.", TEXT, "refine")
    job.start(doc)
    assert [p.row["part"] for p in asked] == list(range(1, len(doc.parts) + 1))
    assert doc.answer == f"after part {len(doc.parts)}" and f"after part {len(doc.parts) - 1}" in \
        tok.decode(asked[-1].ids)


def test_answers_too_long_for_any_reduce_prompt_are_a_clear_error(tok):
    """Two answers of the whole budget each do not fit one reduce prompt of the plan: the document
    fails with the reason, not silently (hpipe run records it)."""
    job, asked, emitted = _driver(tok, 256, 100, {}, lambda p: " ".join(["harbour"] * 130))
    doc = job.document("d", "Where?", TEXT, "map-reduce")
    with pytest.raises(InputError, match="reduce prompt has .* tokens, over the plan's 256"):
        job.start(doc)
    assert emitted == []
