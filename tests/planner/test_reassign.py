"""Moving a lost daemon's stages to the survivors, every other stage kept (planner.reassign)."""

import itertools
import random
from dataclasses import replace

from planner.costs import CostModel, Workload
from planner.reassign import busiest_load, reassign
from planner.strategies import plan as make_plan
from tests.planner.synthetic import make_profile

WORK = Workload(seq_len=512, max_len=1024)


def test_only_the_lost_stages_move_and_they_go_where_the_busiest_device_stays_least_busy():
    tried = 0
    for seed in range(4):
        profile = make_profile(random.Random(seed), n=4, layers=8)
        stages = make_plan(profile, WORK, strategy="hpipe").chosen.stages
        used = list(dict.fromkeys(s.daemon for s in stages))
        if len(used) < 3:
            continue
        tried += 1
        gone = used[1]
        survivors = profile.without([gone])
        cost = CostModel(survivors)
        moved = reassign(cost, WORK, stages, {gone})
        assert moved is not None
        assert [(s.units.start, s.units.end) for s in moved] == [(s.units.start, s.units.end) for s in stages]
        assert all(m == s for m, s in zip(moved, stages) if s.daemon != gone)  # kept as they were
        assert all(m.daemon != gone for m in moved)
        # no other placement of the lost stages keeps the busiest device less busy
        lost = [j for j, s in enumerate(stages) if s.daemon == gone]
        best = min(busiest_load(cost, WORK, _placed(stages, lost, names))
                   for names in itertools.product([d.name for d in survivors.daemons], repeat=len(lost)))
        assert busiest_load(cost, WORK, moved) == best
    assert tried >= 2


def test_stages_that_do_not_fit_on_the_survivors_are_not_moved():
    profile = make_profile(random.Random(3), n=3, layers=8)
    stages = make_plan(profile, WORK, strategy="hpipe").chosen.stages
    gone = stages[0].daemon
    cost = CostModel(profile.without([gone]))
    assert reassign(cost, WORK, stages, {gone}) is not None
    # every survivor has just the memory its own stages take: the lost ones fit nowhere
    need = {d.name: sum(cost.stage_memory(s.units.start, s.units.end, WORK) for s in stages if s.daemon == d.name)
            for d in cost.daemons}
    cost.daemons = [replace(d, memory_bytes=need[d.name]) for d in cost.daemons]
    assert reassign(cost, WORK, stages, {gone}) is None


def _placed(stages, lost, names):
    out = list(stages)
    for j, name in zip(lost, names):
        out[j] = replace(stages[j], daemon=name)
    return out
