"""The parts of a bench report computed from a timeline, without a cluster."""

import pytest

from hpipe.app.bench import timeline_summary


def test_timeline_summary_splits_a_stage_into_start_compute_idle_end():
    # [micro_batch, start, length, received, begin, end]: a gap of 0.5 s waiting for the second slice
    spans = [[0, 0, 64, 0.1, 0.2, 1.2], [0, 64, 64, 1.5, 1.7, 2.7]]
    s = timeline_summary(spans)
    assert s == pytest.approx({"start_s": 0.2, "end_s": 2.7, "busy_s": 2.0, "idle_s": 0.5})
    # a predicted timeline is [begin, end] per slice
    assert timeline_summary([[0.0, 1.0], [1.0, 3.0]]) == pytest.approx(
        {"start_s": 0.0, "end_s": 3.0, "busy_s": 3.0, "idle_s": 0.0})
    assert timeline_summary([]) == {}
