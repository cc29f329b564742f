"""Bringing a broken pipeline back: wait for its daemons, redeploy, and let the engine go on.

When a stage dies the session fails (:class:`runtime.coordinator.session.StageFailure`). The engine then asks
its :class:`Redeploy` for a new session: it waits up to ``grace_s`` for every daemon of the
pipeline to answer again (``hpipe cluster up``'s supervisor restarts a local daemon that crashed;
systemd one on another machine), then deploys the same stages. Daemons that kept their weights keep
them: a deployment that differs only around them re-points their successors and reloads nothing
(:meth:`runtime.daemon.stage_server.StageServer.load`). If a daemon stays away and a ``replan`` is given,
it is asked for stages on the daemons that answer (the application decides from the saved
profile: the lost daemon's stages moved to survivors, every other stage kept, or a fresh plan;
``hpipe.app.replan``), and those are deployed instead. A survivor that takes over a
stage loads only that stage's units, beside the ones it holds, and keeps its sequences.

The new session takes over the old one's sequences on the daemons that kept them, and the engine
resumes each running request where every stage can go on from: the restarted daemon's stages
rebuild their KV caches from the activations the stage before them logged (a replay, planned by
:mod:`runtime.coordinator.resume`), and no other stage computes those positions again. A request that cannot
be resumed (no log reaches far enough, or a fresh plan moved every cut) starts again from its token
ids: it prefills its prompt and the tokens it has generated, and goes on decoding. Either way its
answer is the one it would have had (:meth:`runtime.coordinator.engine.Engine._recover`).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import torch

from hpipe.core.errors import HpipeError
from hpipe.core.plan import Stage
from runtime.coordinator.session import Session, StageFailure
from runtime.wire.channels import DaemonClient

log = logging.getLogger(__name__)

#: seconds a broken pipeline waits for its daemons to answer again before it re-plans or gives up
GRACE_S = 60.0
#: recoveries at most in one engine's life (a pipeline that keeps breaking is given up on)
MAX_RECOVERIES = 5


class Redeploy:
    """A new session on the same deployment once its daemons are back (or on a re-planned one)."""

    def __init__(self, pipe, model: str, stages: Sequence[Stage], dtype: torch.dtype, kv_pool_bytes: int = 0,
                 grace_s: float = GRACE_S, replan: Callable[[list[str], list[Stage]], list[Stage]] | None = None,
                 max_times: int | None = MAX_RECOVERIES):
        self.pipe, self.model, self.stages, self.dtype, self.kv_pool_bytes = \
            pipe, model, list(stages), dtype, kv_pool_bytes
        self.grace_s, self.replan, self.max_times = grace_s, replan, max_times
        self.events: list[dict] = []  # what happened: when, why, what was done, how long it took

    def __call__(self, error: str, resume_from: Session | None = None) -> Session:
        """A session on a working pipeline, or :class:`StageFailure` (with ``error``'s story); it
        takes over session ``resume_from``'s sequences where daemons kept them."""
        if self.max_times is not None and len(self.events) >= self.max_times:
            raise StageFailure(f"{error} (the pipeline broke {len(self.events)} times already: giving up)")
        t0 = time.monotonic()
        action = self.restore(error)
        return self._done(error, action, t0, resume_from)

    def restore(self, error: str) -> str:
        """Load the stages again once their daemons answer (waiting up to the grace), or the
        re-planned ones; what was done (:class:`StageFailure` if neither can be)."""
        t0 = time.monotonic()
        log.warning("the pipeline broke (%s); waiting up to %.0f s for its daemons", error, self.grace_s)
        names = list(dict.fromkeys(s.daemon for s in self.stages))
        deadline = t0 + self.grace_s
        while True:
            down = self._down(names)
            if not down:
                try:
                    self.pipe.load(self.model, self.stages, self.dtype, self.kv_pool_bytes, adjacent=True)
                    return "redeployed"
                except StageFailure as e:  # died again while loading: wait on
                    if e.lasting:
                        raise
                    log.warning("redeploying failed: %s", e)
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if self.replan is None:
            raise StageFailure(f"{error}; {', '.join(down)} did not come back within {self.grace_s:.0f} s")
        alive = [d.name for d in self.pipe.cluster.daemons if d.name not in down]
        try:
            stages = self.replan(alive, self.stages)
        except HpipeError as e:
            raise StageFailure(f"{error}; {', '.join(down)} did not come back and the survivors cannot take "
                               f"over: {e}") from None
        action = _describe(self.stages, stages, down)
        log.warning("%s did not come back: %s", ", ".join(down), action)
        self.pipe.load(self.model, stages, self.dtype, self.kv_pool_bytes, adjacent=True)
        self.stages = list(stages)
        return action

    def _down(self, names: list[str]) -> list[str]:
        down = []
        for name in names:
            d = self.pipe.cluster.daemon(name)
            client = DaemonClient(d.address, self.pipe.security, name)
            try:
                if not client.health(timeout=1.0):
                    down.append(name)
            finally:
                client.close()
        return down

    def _done(self, error: str, action: str, t0: float, resume_from: Session | None) -> Session:
        session = self.pipe.session(resume_from=resume_from)
        took = time.monotonic() - t0
        self.events.append({"error": error, "action": action, "seconds": round(took, 3)})
        log.warning("pipeline %s after %.1f s; running requests resume", action, took)
        return session


def _describe(old: Sequence[Stage], new: Sequence[Stage], down: list[str]) -> str:
    """What a re-plan did: moved the lost daemons' stages, or planned the pipeline afresh."""
    if [s.units for s in old] == [s.units for s in new]:
        moved = [f"units {s.units} to {s.daemon}" for o, s in zip(old, new) if o.daemon != s.daemon]
        return f"moved {', '.join(moved)} (without {', '.join(down)})"
    return f"re-planned without {', '.join(down)}"
