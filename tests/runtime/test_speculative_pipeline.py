"""Speculative decoding through three daemons: hpipe generate --cluster and hpipe run answer with
--speculate ngram exactly as without it, guesses are kept, and the stages rewind what was not."""

import json

import pytest

from hpipe.app.cli import main
from hpipe.model.generate import speculate


@pytest.fixture(autouse=True)
def every_guess(monkeypatch):
    """Guess whether it pays or not (timings decide that, and they vary): count what is kept."""
    monkeypatch.setattr(speculate, "WEIGH_COSTS", False)

DOCUMENT = ("The harbour office opens at seven. Boats pay a fee of four crowns a night. The clerk, Anna Berg, "
            "keeps the ledger of every boat that stays. ") * 3
ASK = "Repeat the last sentence of the text word for word."


def test_generate_through_the_cluster_answers_alike_with_guesses(cluster3, tmp_path, capsys):
    args = ["generate", "--model", "smollm2-135m", "--cluster", str(cluster3.path), "--chat", "--max-new-tokens",
            "32", "--prompt", DOCUMENT + ASK, "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(args + ["--speculate", "ngram"]) == 0
    fast = json.loads(capsys.readouterr().out)
    assert fast["token_ids"] == plain["token_ids"]
    assert fast["speculation"]["accepted"] > 0, fast["speculation"]
    assert main(["generate", "--model", "smollm2-135m", "--chat", "--max-new-tokens", "32", "--prompt", DOCUMENT + ASK,
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == plain["token_ids"]  # and as in one process


def test_run_answers_every_document_alike_with_guesses(cluster3, plan_file, tmp_path, capsys):
    docs = []
    for i in range(4):
        p = tmp_path / f"doc{i}.md"
        p.write_text(DOCUMENT.replace("Anna Berg", ["Anna Berg", "Olaf Lund", "Mira Holt", "Per Dahl"][i]))
        docs.append(str(p))
    base = ["run", "--plan", str(plan_file[0]), "--cluster", str(cluster3.path), "--chat", "--max-new-tokens", "24",
            "--instruction", ASK, "--json"]
    answers = {}
    for mode in ("off", "ngram"):
        out = tmp_path / f"{mode}.jsonl"
        assert main(base + ["--speculate", mode, "-o", str(out)] + docs) == 0
        summary = json.loads(capsys.readouterr().out)
        answers[mode] = {json.loads(line)["document"]: json.loads(line)["token_ids"]
                         for line in out.read_text().splitlines()}
        if mode == "ngram":
            assert summary["speculation"]["kept"] > 0, summary["speculation"]
    assert answers["ngram"] == answers["off"] and len(answers["off"]) == 4
