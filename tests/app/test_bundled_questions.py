"""The bundled questions about the sample report (benchmarks/speculative_job.py's workload)."""

from pathlib import Path

import hpipe
from hpipe.app.jobs import read_questions
from hpipe.model.weights.sources import resolve_model

DATA = Path(hpipe.__file__).parent / "data"


def test_the_bundled_questions_are_sixteen_and_fit_a_plan_of_2048_with_the_report():
    questions = read_questions(str(DATA / "questions" / "sample_report.txt"))
    assert len(questions) == 16 and len(set(questions)) == 16
    tok = resolve_model("smollm2-135m").tokenizer()
    report = len(tok((DATA / "sample_report.md").read_text())["input_ids"])
    # the chat template's tokens, a question and 64 answer tokens must fit beside the report
    assert all(report + 40 + len(tok(q)["input_ids"]) + 64 <= 2048 for q in questions)
