"""Workloads: generated from a seed, read from JSONL, the bundled one."""

import pytest

from hpipe.core import workload
from hpipe.core.errors import InputError


def test_generated_workloads_repeat_from_their_seed():
    a = workload.generate(50, seed=3, rate=2.0)
    assert a == workload.generate(50, seed=3, rate=2.0) != workload.generate(50, seed=4, rate=2.0)
    assert all(64 <= w.prompt_tokens <= 2048 and 16 <= w.output_tokens <= 256 for w in a)
    gaps = [b.arrival_s - a_.arrival_s for a_, b in zip(a, a[1:])]
    assert min(gaps) >= 0 and 0.2 < sum(gaps) / len(gaps) < 1.0  # Poisson at 2/s: mean gap 0.5 s
    assert {w.arrival_s for w in workload.generate(5, rate=None)} == {0.0}
    with pytest.raises(InputError):
        workload.generate(0)


def test_files_round_trip_and_bad_lines_say_where(tmp_path):
    items = workload.generate(7, seed=1, rate=1.0)
    path = tmp_path / "w.jsonl"
    path.write_text(workload.dump(items[::-1]))
    assert workload.load(path) == items  # sorted by arrival
    path.write_text('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1}\n{"prompt_tokens": 0, '
                    '"output_tokens": 1}\n')
    with pytest.raises(InputError, match=r"w.jsonl:2: arrival must be >= 0, prompt and output lengths >= 1"):
        workload.load(path)


def test_the_bundled_mixed_workload():
    items = workload.load("mixed")
    assert len(items) == 24 and sum(w.prompt_tokens > 1000 for w in items) == 8
    assert items[-1].arrival_s > 60  # spread out, not all at once


def test_prompts_are_the_same_for_every_policy_and_round():
    item = workload.WorkItem(0.0, 40, 4)
    assert workload.prompt_ids(item, 3, 100) == workload.prompt_ids(item, 3, 100) != workload.prompt_ids(item, 4, 100)


def test_the_bundled_workloads_of_the_results_page_are_their_recipes():
    """docs/results.md's figures replay these files: each is what its recipe in
    :func:`workload.bundled` makes, so a figure can be made again from the repository."""
    w64 = workload.generate(64, 64, prompt=(1000, 2000), output=(128, 256))
    assert workload.load("w64") == w64 and workload.load("w24w") == w64[:24]
    assert workload.load("pressure") == workload.generate(256, 1, prompt=(32, 288), output=(16, 64))
    assert workload.load("w16dec") == workload.generate(16, 0, prompt=(300, 300), output=(400, 400))
