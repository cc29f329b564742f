"""What a job does when a daemon does not come back: the lost stages moved, or a fresh plan.

Called by :class:`runtime.coordinator.recovery.Redeploy` with the daemons still answering, once the grace
period is over (``hpipe run --profile P.json``).
"""

from __future__ import annotations

from hpipe.core.plan import Plan, Stage
from hpipe.core.profile import Profile
from planner.costs import CostModel, Workload
from planner.reassign import busiest_load, reassign
from planner.serving import Mix
from planner.strategies import plan as make_plan

#: how much slower (the busiest device's load) moving a lost daemon's stages may be than a fresh
#: plan on the survivors and still be preferred: it reloads nothing else and resumes every sequence
MOVE_SLACK = 1.5


def replanner(plan: Plan, profile: Profile):
    """``replan(survivors, stages) -> stages`` (what runtime.coordinator.recovery calls when a daemon does not
    come back), from the saved profile: the lost daemon's stages moved to the survivors, every other
    stage kept (planner.reassign), unless that is more than MOVE_SLACK times slower than the plan's
    strategy re-planned on the survivors, or does not fit; then the fresh plan."""
    # a plan made for an answer (hpipe plan --output-len) is re-planned for it too
    work = Workload(plan.seq_len, plan.batch, plan.max_len, output_len=plan.meta.get("answer", {}).get("output_len", 0))
    serving = plan.meta.get("serving")
    mix = Mix(**serving["mix"]) if serving else None  # a throughput plan is re-planned for its mix

    def replan(alive: list[str], stages: list[Stage]) -> list[Stage]:
        gone = [d.name for d in profile.daemons if d.name not in alive]
        survivors = profile.without(gone)
        fresh = list(make_plan(survivors, work, strategy=plan.strategy, mix=mix).chosen.stages)
        cost = CostModel(survivors)
        moved = reassign(cost, work, stages, set(gone))
        if moved is not None and busiest_load(cost, work, moved) <= MOVE_SLACK * busiest_load(cost, work, fresh):
            return list(moved)
        return fresh
    return replan
