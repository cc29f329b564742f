"""Re-planning around a daemon that is gone, from the saved profile."""

import random

from hpipe.app.replan import replanner
from planner.costs import Workload
from planner.serving import Mix
from planner.strategies import plan
from tests.planner.synthetic import make_profile


def test_a_throughput_plan_is_re_planned_on_the_survivors_for_its_own_mix():
    profile = make_profile(random.Random(2), n=3, layers=4)
    the_plan = plan(profile, Workload(256, 1, 512), strategy="throughput", mix=Mix(256, 64))
    stages = list(the_plan.chosen.stages)
    gone = stages[0].daemon
    alive = [d.name for d in profile.daemons if d.name != gone]
    survivors = replanner(the_plan, profile)(alive, stages)
    assert {s.daemon for s in survivors} <= set(alive)
    assert survivors[0].units.start == 0 and survivors[-1].units.end == profile.model.num_units
    assert all(a.units.end == b.units.start for a, b in zip(survivors, survivors[1:]))


def test_a_plan_made_for_an_answer_is_re_planned_for_it(monkeypatch):
    """``hpipe plan --output-len``'s plan chose its chain by prefill and answer: the fresh plan on
    the survivors is chosen the same way."""
    from hpipe.app import replan

    profile = make_profile(random.Random(2), n=3, layers=4)
    the_plan = plan(profile, Workload(256, 1, 512, output_len=96))
    asked = []

    def spy(survivors, work, **kw):
        asked.append(work)
        return plan(survivors, work, **kw)

    monkeypatch.setattr(replan, "make_plan", spy)
    stages = list(the_plan.chosen.stages)
    alive = [d.name for d in profile.daemons if d.name != stages[0].daemon]
    survivors = replanner(the_plan, profile)(alive, stages)
    assert asked and asked[0].output_len == 96
    assert {s.daemon for s in survivors} <= set(alive)
