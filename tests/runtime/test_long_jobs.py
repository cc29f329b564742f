"""hpipe run on documents longer than the plan's length (256 tokens here): map-reduce and refine
through a live cluster, every part's span on record, parts in flight together, a job stopped
half-way resumed without computing a part twice, and a fact planted in one part found."""

import json
from pathlib import Path

import pytest

from hpipe.app.cli import main

DATA = Path(__file__).parents[1] / "data"


def _report(tmp_path: Path, name: str, tok, tokens: int, fact: str | None = None) -> tuple[str, int]:
    """A document of the shipped licence text's paragraphs (repeated) of just over ``tokens``
    tokens, ``fact`` planted in the middle; its path and its length in tokens."""
    paragraphs = [p for p in (DATA / "apache-2.0.txt").read_text(encoding="utf-8").split("\n\n") if p.strip()]
    body: list[str] = []
    while len(tok("\n\n".join(body), add_special_tokens=False)["input_ids"]) <= tokens:
        body.append(paragraphs[len(body) % len(paragraphs)])
    if fact:
        body.insert(len(body) // 2, fact)
    path = tmp_path / name
    path.write_text("\n\n".join(body), encoding="utf-8")
    return str(path), len(tok(path.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"])


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()]


def _args(plan_file, cluster3, out, *extra) -> list[str]:
    return ["run", "--plan", str(plan_file[0]), "--cluster", str(cluster3.path), "--chat", "--max-new-tokens", "12",
            "-o", str(out), "--json", *extra]


def test_map_reduce_answers_a_long_document_part_by_part_and_resumes(cluster3, smollm2, plan_file, tmp_path,
                                                                     capsys):
    doc, tokens = _report(tmp_path, "long.txt", smollm2.tokenizer(), 4 * 256)
    out = tmp_path / "results.jsonl"
    assert main(_args(plan_file, cluster3, out, "--instruction", "Summarize in one sentence.", doc)) == 0
    summary = json.loads(capsys.readouterr().out)
    rows = _rows(out)
    final = rows[-1]
    assert final["document"] == doc and final["answer"].strip() and final["long"]["method"] == "map-reduce"
    spans = [p["span"] for p in final["long"]["parts"]]
    assert spans[0][0] == 0 and spans[-1][1] == tokens and all(b[0] < a[1] for a, b in zip(spans, spans[1:]))
    assert all(p["answer"] for p in final["long"]["parts"]) and any(p["used"] for p in final["long"]["parts"])
    parts = [r for r in rows if r.get("stage") == "map"]
    assert [r["part"] for r in parts] != [] and sorted(r["part"] for r in parts) == list(range(1, len(spans) + 1))
    assert all(r["prompt_tokens"] <= 256 for r in rows if "prompt_tokens" in r)
    assert summary["long"]["computed"] == len(rows) - 1 and summary["long"]["reused"] == 0
    # parts in flight together: the engine interleaved them (fewer micro-batches than prompts times steps)
    assert summary["micro_batches"] < sum(r["answer_tokens"] + r["slices"] for r in rows if "slices" in r)

    # stopped after three parts: the rerun computes only the rest, and answers alike
    done = [r for r in rows if r.get("stage") == "map"][:3]
    out.write_text("".join(json.dumps(r) + "\n" for r in done))
    assert main(_args(plan_file, cluster3, out, "--instruction", "Summarize in one sentence.", doc)) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["long"]["reused"] == 3 and again["long"]["computed"] == len(rows) - 1 - 3
    assert _rows(out)[-1]["answer"] == final["answer"]
    # and a third run has nothing to do
    assert main(_args(plan_file, cluster3, out, "--instruction", "Summarize in one sentence.", doc)) == 0
    assert json.loads(capsys.readouterr().out)["skipped"] == 1


def test_refine_and_refuse_and_a_document_25_times_the_plan(cluster3, smollm2, plan_file, tmp_path, capsys):
    doc, _ = _report(tmp_path, "long.txt", smollm2.tokenizer(), 2 * 256)
    out = tmp_path / "refine.jsonl"
    assert main(_args(plan_file, cluster3, out, "--long", "refine", "--instruction", "Summarize.", doc)) == 0
    capsys.readouterr()
    rows = _rows(out)
    assert [r["stage"] for r in rows[:-1]] == ["refine"] * (len(rows) - 1) and rows[-1]["long"]["method"] == "refine"
    assert main(_args(plan_file, cluster3, tmp_path / "refuse.jsonl", "--long", "refuse", "--instruction", "Summarize.",
                      doc)) == 1
    assert "at most 256 fit" in capsys.readouterr().err

    huge, _ = _report(tmp_path, "huge.txt", smollm2.tokenizer(), 25 * 256)
    out = tmp_path / "huge.jsonl"
    assert main(_args(plan_file, cluster3, out, "--instruction", "What is this about?", huge)) == 0
    final = _rows(out)[-1]
    assert final["answer"].strip() and len(final["long"]["parts"]) > 25


@pytest.mark.parametrize("method", ["map-reduce"])
def test_a_fact_planted_in_one_part_is_found(cluster3, smollm2, plan_file, tmp_path, capsys, method):
    doc, _ = _report(tmp_path, "vault.txt", smollm2.tokenizer(), 4 * 256, fact="Note for the reader: the vault "
                     "code is 4729.")
    out = tmp_path / "vault.jsonl"
    assert main(_args(plan_file, cluster3, out, "--long", method, "--instruction", "What is the vault code?",
                      doc)) == 0
    final = _rows(out)[-1]
    assert "4729" in final["answer"], final
