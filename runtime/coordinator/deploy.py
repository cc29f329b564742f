"""Deploying a plan: the one way every caller (run, serve, bench, benchmarks) puts a plan on a cluster.

``deploy(plan, cluster)`` loads one of the plan's strategies onto the cluster's daemons and
returns the :class:`Deployed` pipeline with its recovery (:class:`Redeploy`), which an engine
takes as its ``recover``: a stage that dies is waited for and deployed again, or planned around.
Ad-hoc pipelines without a plan (``--cuts``, tests) use :meth:`Pipeline.load` directly. With
``seesaw``, a plan made with ``hpipe plan --objective seesaw`` is deployed as its prefill layout,
and :attr:`Deployed.phases` is the policy that switches it to the decode layout and back
(:mod:`runtime.coordinator.seesaw`); the recovery always redeploys the layout in use.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from hpipe.core.cluster import ClusterSpec
from hpipe.core.errors import InputError
from hpipe.core.plan import Plan, Stage
from hpipe.core.units import UnitRange
from hpipe.model.compute.stage import DTYPES
from runtime.coordinator.engine import Engine
from runtime.coordinator.kv_moves import send_moved_kv, sent_stages
from runtime.coordinator.pipeline import Pipeline
from runtime.coordinator.recovery import GRACE_S, MAX_RECOVERIES, Redeploy
from runtime.coordinator.seesaw import SeesawPhases, fine_stages
from runtime.coordinator.session import Session, StageFailure
from runtime.wire.channels import Security

log = logging.getLogger(__name__)


@dataclass
class Deployed:
    """A plan's strategy loaded on a cluster: the pipeline, and how it comes back when a stage dies."""

    pipe: Pipeline
    recovery: Redeploy
    phases: SeesawPhases | None = None  # a seesaw deployment's policy (it switches the layouts)

    def session(self, result_timeout_s: float = 600.0) -> Session:
        """A new session; a daemon lost since the deployment is waited for and the plan deployed
        again first (the recovery's way), so starting work is a phase that recovers too."""
        try:
            return self.pipe.session(result_timeout_s)
        except StageFailure as e:
            if e.lasting:
                raise
            return self.recovery(str(e))

    def engine(self, policy, max_running: int, prefix_cache: float | None = None, speculate: str = "off") -> Engine:
        """An engine on a new session of this deployment, recovering through :attr:`recovery`
        (also while it starts: a daemon lost as it asks for the pools is waited for);
        ``prefix_cache`` and ``speculate`` as :class:`Engine` takes them."""
        session = self.session()
        while True:
            try:
                return Engine(session, policy, depth=len(self.pipe.stages), max_running=max_running,
                              recover=self.recovery, prefix_cache=prefix_cache, speculate=speculate)
            except StageFailure as e:
                session.close()
                if e.lasting:
                    raise
                session = self.recovery(str(e))

    def close(self) -> None:
        self.pipe.close()

    def __enter__(self) -> "Deployed":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def deploy(plan: Plan, cluster: ClusterSpec, *, strategy: str | None = None, kv_pool_bytes: int = 0,
           grace_s: float = GRACE_S, replan: Callable[[list[str], list[Stage]], list[Stage]] | None = None,
           security: Security | None = None, max_recoveries: int | None = MAX_RECOVERIES,
           dequantize: bool = False, seesaw: bool = False) -> Deployed:
    """Load ``strategy`` (default: the plan's) of ``plan`` onto ``cluster``; each daemon's KV pools
    ``kv_pool_bytes`` in all (0: the daemon sizes them). ``grace_s`` and ``replan`` say how the
    recovery waits for a lost daemon and what it does when one stays away, ``max_recoveries`` how
    often it may (None: always, for a server; :mod:`runtime.coordinator.recovery`). A daemon that
    is down or dies while the plan loads is waited for in the same way: deploying is a phase that
    recovers like the others. ``dequantize``: a GGUF model's daemons hold float32 weights, not the
    blocks the file stores (the reference the quantized path is tested against). ``seesaw``: the
    plan's two Seesaw layouts, switched between (:attr:`Deployed.phases`), the KV of moved stages
    sent or recomputed as the plan chose."""
    name = strategy or plan.strategy
    if name not in plan.strategies:
        raise InputError(f"the plan has no strategy {name!r} (it has {', '.join(plan.strategies)})")
    stages, dtype = plan.strategies[name].stages, DTYPES[plan.dtype]
    layouts = seesaw_layouts(plan, cluster) if seesaw else None
    if layouts:
        stages = layouts["prefill"]
    pipe = Pipeline(cluster, security, dequantize)
    recovery = Redeploy(pipe, plan.model_name, stages, dtype, kv_pool_bytes, grace_s=grace_s, replan=replan,
                        max_times=max_recoveries)
    phases = seesaw_phases(pipe, plan.model_name, layouts, dtype, kv_pool_bytes, recovery,
                           seesaw_kv(plan, layouts)) if layouts else None
    try:
        try:
            pipe.load(plan.model_name, stages, dtype, kv_pool_bytes, adjacent=bool(layouts))
            if phases is not None:
                learn_rooms(pipe, plan.model_name, layouts, dtype, kv_pool_bytes, phases)
        except StageFailure as e:
            if e.lasting:
                raise
            log.warning("deploying the plan failed: %s", e)
            recovery.restore(str(e))
    except BaseException:
        pipe.close()
        raise
    return Deployed(pipe, recovery, phases)


def seesaw_phases(pipe: Pipeline, model: str, layouts: dict[str, list[Stage]], dtype, kv_pool_bytes: int = 0,
                  recovery: Redeploy | None = None, sent: set[int] = frozenset(), early: bool = True,
                  park: bool = True) -> SeesawPhases:
    """The policy that switches ``pipe`` between the fine-stage ``layouts`` (it starts in prefill,
    which the caller has loaded); ``recovery`` follows the layout in use. A switch sends the KV of
    the fine stages ``sent`` that it moves (:func:`seesaw_kv`; with ``early``, a prompt's as soon as
    it is read); replays rebuild the others'. With ``park``, where every stage a switch moves is
    sent, a prefill phase parks prompts it has read in the daemons' host tier when the pools are
    full and goes on (:class:`SeesawPhases`)."""
    def switch(phase: str, old: Session) -> Session:
        if recovery is not None:
            recovery.stages = list(layouts[phase])
        pipe.load(model, layouts[phase], dtype, kv_pool_bytes, adjacent=True)
        return pipe.session(resume_from=old)

    def send(phase: str, old: Session, sequence_ids: list[int] | None = None) -> dict:
        return send_moved_kv(pipe, old, layouts[phase], sent, sequence_ids)
    moved = {i for i, (a, b) in enumerate(zip(layouts["prefill"], layouts["decode"])) if a.daemon != b.daemon}
    return SeesawPhases(switch, send_kv=send if sent else None, early=early, park=park and moved <= set(sent))


def learn_rooms(pipe: Pipeline, model: str, layouts: dict[str, list[Stage]], dtype, kv_pool_bytes: int,
                phases: SeesawPhases) -> None:
    """Load the decode layout, then the prefill layout again, and tell ``phases`` what each one's
    pools and host tier hold (a daemon sizes its pools for the stages it holds, so the two
    layouts' differ; told, the first prefill phase admits and parks only what both hold)."""
    for phase in ("decode", "prefill"):
        pipe.load(model, layouts[phase], dtype, kv_pool_bytes, adjacent=True)
        pools = pipe.pools()
        phases.learn(phase, min((p.blocks for p in pools), default=0), min((p.tier_blocks for p in pools), default=0))


def seesaw_kv(plan: Plan, layouts: dict[str, list[Stage]], mode: str = "plan") -> set[int]:
    """The fine stages whose KV a switch sends (:func:`runtime.coordinator.kv_moves.sent_stages`):
    with ``plan``, where the planner priced sending below recomputing."""
    runs = plan.meta.get("seesaw", {}).get("switch", {}).get("runs")
    return sent_stages(mode, layouts["prefill"], runs)


def seesaw_plan_layouts(plan: Plan, cluster: ClusterSpec) -> dict[str, list[Stage]]:
    """The plan's Seesaw prefill and decode layouts, each as the planner chose it."""
    found = plan.meta.get("seesaw")
    if not found:
        raise InputError("the plan has no Seesaw layouts: make it with hpipe plan --objective seesaw")
    layers = next(iter(plan.strategies.values())).stages[0].units.num_layers
    return {phase: [Stage(s["daemon"], cluster.daemon(s["daemon"]).address, UnitRange(*s["units"], layers))
                    for s in found[phase]] for phase in ("prefill", "decode")}


def seesaw_layouts(plan: Plan, cluster: ClusterSpec) -> dict[str, list[Stage]]:
    """The plan's Seesaw layouts as one pipeline of fine stages each
    (:func:`runtime.coordinator.seesaw.fine_stages`)."""
    return fine_stages(seesaw_plan_layouts(plan, cluster))
