"""Deploying a plan: the one way every caller (run, serve, bench, benchmarks) puts a plan on a cluster.

``deploy(plan, cluster)`` loads one of the plan's strategies onto the cluster's daemons and
returns the :class:`Deployed` pipeline with its recovery (:class:`Redeploy`), which an engine
takes as its ``recover``: a stage that dies is waited for and deployed again, or planned around.
Ad-hoc pipelines without a plan (``--cuts``, tests) use :meth:`Pipeline.load` directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from hpipe.core.cluster import ClusterSpec
from hpipe.core.errors import InputError
from hpipe.core.plan import Plan, Stage
from hpipe.model.stage import DTYPES
from runtime.coordinator.pipeline import Pipeline
from runtime.coordinator.recovery import GRACE_S, Redeploy
from runtime.coordinator.session import Session
from runtime.wire.channels import Security


@dataclass
class Deployed:
    """A plan's strategy loaded on a cluster: the pipeline, and how it comes back when a stage dies."""

    plan: Plan
    strategy: str
    pipe: Pipeline
    recovery: Redeploy

    def session(self, result_timeout_s: float = 600.0) -> Session:
        return self.pipe.session(result_timeout_s)

    def close(self) -> None:
        self.pipe.close()

    def __enter__(self) -> "Deployed":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def deploy(plan: Plan, cluster: ClusterSpec, *, strategy: str | None = None, kv_pool_bytes: int = 0,
           grace_s: float = GRACE_S, replan: Callable[[list[str], list[Stage]], list[Stage]] | None = None,
           security: Security | None = None) -> Deployed:
    """Load ``strategy`` (default: the plan's) of ``plan`` onto ``cluster``; each daemon's KV pools
    ``kv_pool_bytes`` in all (0: the daemon sizes them). ``grace_s`` and ``replan`` say how the
    recovery waits for a lost daemon and what it does when one stays away (:mod:`runtime.coordinator.recovery`)."""
    name = strategy or plan.strategy
    if name not in plan.strategies:
        raise InputError(f"the plan has no strategy {name!r} (it has {', '.join(plan.strategies)})")
    stages, dtype = plan.strategies[name].stages, DTYPES[plan.dtype]
    pipe = Pipeline(cluster, security)
    try:
        pipe.load(plan.model_name, stages, dtype, kv_pool_bytes)
    except BaseException:
        pipe.close()
        raise
    recovery = Redeploy(pipe, plan.model_name, stages, dtype, kv_pool_bytes, grace_s=grace_s, replan=replan)
    return Deployed(plan, name, pipe, recovery)
