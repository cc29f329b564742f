"""The engine going on on a new session: after a recovery, or a Seesaw layout switch.

A mixin of :class:`runtime.coordinator.engine.Engine` (its ``session``, ``running``, ``waiting``,
``room``, ``cache`` and lock). Every running request resumes where every stage of the new
session can go on from (:mod:`runtime.coordinator.resume`: kept KV, replays, or a restart from its
token ids), and the old session's per-stage statistics are kept in ``ended`` with the daemons
that held its stages and how long it ran, so a run that switched layouts can say how busy each
daemon was in each (``hpipe bench --workload``).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from runtime.coordinator.resume import replays, resume_requests
from runtime.coordinator.session import Session, StageFailure

log = logging.getLogger(__name__)


class Rebinding:
    """Recovering, switching layouts, and binding to a new session."""

    def _recover(self, error: str) -> None:
        """Go on on the session ``recover`` gives (or raise its StageFailure)."""
        old = self.session
        self._go_on(old, self.recover(error, old))
        self.recoveries += 1

    def switch(self, deploy: Callable[[Session], Session]) -> dict:
        """Go on on another deployment of the pipeline (a Seesaw layout switch): with nothing in
        flight, ``deploy`` loads it and returns a session that took the current one's sequences
        over; every running request resumes on it as after a recovery (the stages that kept its
        KV keep it, replays rebuild it on the stages that moved); what was resumed, as
        :attr:`resumes` has it for a recovery."""
        if self._in_flight:
            raise RuntimeError("a layout switch needs the pipeline drained")
        old = self.session
        daemons = [st.daemon for st in old.pipe.stages]  # the layout switched from (deploy reloads the pipe)
        self._switching_s = time.monotonic()
        return self._go_on(old, deploy(old), record=False, daemons=daemons)

    def _go_on(self, old: Session, session: Session, record: bool = True, daemons: list[str] | None = None) -> dict:
        """Every running request resumes where every stage of ``session`` can go on from
        (:mod:`runtime.coordinator.resume`): stages that lack its cache are rebuilt by replays,
        sent before anything else; a request that cannot be resumed starts again from its token
        ids, prefilling its prompt and the tokens it has."""
        with self._lock:
            self.session = session  # its cache is emptied as it is bound below (rebind)
            for r in [r for r in self.running if r.swapped]:  # admitted, not yet back: its copy may be gone
                self.running.remove(r)
                self.waiting.insert(0, r)
            wanted, restarted, kept = resume_requests(self.running, session.resumed, len(session.pipe.stages))
            for r in reversed(restarted):
                self.running.remove(r)
                self.waiting.insert(0, r)  # the oldest first again
            parked, lost = set(), 0
            for r in self.waiting:  # a swapped copy may be lost with a daemon, or of moved stages
                if r.swapped and _whole(session.resumed.get(r.seq_id, {}), len(session.pipe.stages), r.laid_out):
                    parked.add(r.seq_id)  # every stage holds it in its host tier (kept, or sent there)
                elif r.swapped:
                    lost += 1
                    self._unswap(r)
                    r.new_sequence()
                    r.restart(r.prompt + r.tokens)
            stale = set(session.resumed) - set(wanted) - parked  # adopted, but no request goes on with them
            session.close_sequences(sorted(stale))
            self._end(old, daemons)
            batches = replays(wanted)
            broken = None
            try:
                by_seq = {r.seq_id: r for r in self.running}
                for batch in batches:
                    session.submit(*batch.micro_batch(lambda i: by_seq[i]))
                self.rebind(session)
            except StageFailure as e:  # broke again while resuming: recovered again below
                broken = str(e)
            resumed = {"resumed": len(self.running), "kept_positions": kept,
                       "replayed_positions": sum(b.tokens for b in batches), "restarted": len(restarted) + lost}
            if record:
                self.resumes.append(resumed)
            self._checked = time.monotonic()
            log.info("resumed %d requests (%d positions kept, %d rebuilt by replays), %d start again",
                     resumed["resumed"], kept, resumed["replayed_positions"], len(restarted))
        if broken is not None:
            if self.recover is None:
                raise StageFailure(broken)
            self._recover(broken)
        return resumed

    def rebind(self, session: Session) -> None:
        """Go on on ``session`` (a new one, after a recovery): nothing of the old one is in flight,
        the prefix cache is empty, and the pools, depth and lanes are the new pipeline's
        (:class:`StageFailure` if a daemon of it does not answer)."""
        pools = session.pipe.pools()
        with self._lock:
            self.session = session
            if self.cache is not None:
                self.cache.clear(self.running + self.waiting)
            self._in_flight.clear()
            self.room.resize(min((p.blocks for p in pools), default=0))
            self.tier = min((p.tier_blocks for p in pools), default=0)
            self.depth = max(1, len(session.pipe.stages))
            self.lanes = max(1, session.pipe.lanes)
            self._checked = time.monotonic()

    def close(self) -> list[dict]:
        """Close the session the engine is on (its run is over): :attr:`ended`, that one last."""
        self._end(self.session, None)
        return self.ended

    def _end(self, old: Session, daemons: list[str] | None) -> None:
        """Close ``old``, keeping what its stages did and how long it ran, up to the start of the
        switch that ends it (:attr:`ended`)."""
        until = self._switching_s or time.monotonic()
        self.ended.append({"daemons": daemons or [st.daemon for st in old.pipe.stages],
                           "seconds": until - self._bound_s, "stats": old.close()})
        self._bound_s, self._switching_s = time.monotonic(), None


def _whole(progress: dict[int, tuple[int, int]], stages: int, positions: int) -> bool:
    """Whether every stage of the new session holds a sequence's ``positions`` (a swapped one's:
    in its daemon's host tier)."""
    return positions > 0 and all(progress.get(i, (0, 0))[0] >= positions for i in range(stages))
