"""The results file: whole lines only, a torn tail cut off, resuming keyed on what shapes an answer."""

import json

from hpipe.app.results import ResultsFile, answer_key


def test_a_torn_last_line_is_cut_off_and_the_next_line_is_whole(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"document": "a", "key": "k1", "answer": "x"}\n{"document": "b", "key": "k2", "ans')
    with ResultsFile(path) as out:
        assert out.answered() == {"k1"}
        out.append({"document": "c", "key": "k3", "answer": "z"})
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["document"] for r in rows] == ["a", "c"]


def test_errors_are_recorded_but_not_answers(tmp_path):
    with ResultsFile(tmp_path / "r.jsonl") as out:
        out.append({"document": "a", "key": "k1", "error": "stage 1 is not responding"})
        out.append({"document": "b", "key": "k2", "answer": "y"})
        assert out.answered() == {"k2"}


def test_the_key_follows_the_text_and_every_setting_not_the_path():
    base = answer_key([1, 2, 3], model="m", max_new_tokens=8)
    assert base == answer_key([1, 2, 3], max_new_tokens=8, model="m")
    assert base != answer_key([1, 2, 4], model="m", max_new_tokens=8)
    assert base != answer_key([1, 2, 3], model="n", max_new_tokens=8)
    assert base != answer_key([1, 2, 3], model="m", max_new_tokens=9)
