"""Seesaw's phase loop: prefill on one layout, decode on another, switching between them rarely.

Design note (docs/decisions/seesaw.md; papers/seesaw.md §4-5). The planner
(:mod:`planner.seesaw`) picks a prefill layout and a decode layout of the same daemons. Both run
here as one pipeline of *fine stages*, the units between any two cuts of either layout
(:func:`fine_stages`): a layout is those stages on its daemons, a daemon holding several in a
row. A switch is a redeployment of the same stages on other daemons: every daemon keeps the
stages it holds in both layouts with their sequences' KV, drops the others and loads the ones it
gains (:meth:`runtime.daemon.stage_server.StageServer.load`, a reshard), and the engine resumes
every running request on the new layout as after a recovery. A moved stage's KV is either sent
by its old owner before the Load (``send_kv``: :mod:`runtime.coordinator.kv_moves`), or rebuilt
from the activations the stage before it logged (replays), Seesaw's "recompute" transition; a
request whose KV can be neither starts again from its token ids.

:class:`SeesawPhases` is the engine's policy. In the prefill phase it admits waiting requests
while the KV pools hold every admitted request at its full length (so no prefill is preempted
and every one finishes), and sends only prefill chunks; when nothing more can be prefilled and
requests wait to decode, it switches to the decode layout. In the decode phase it sends only
decode tokens (spread over the micro-batches in flight, as gllm does) until the requests
decoding fall to ``low_water`` of the batch it began with, or finish, while others wait; then
it switches back. So a switch happens once per pool-full of requests, never per request, and
every request's greedy tokens are those of a single layout (the same weights, positions and
KV). Time to first token is what it costs: a request waits for the phase that prefills it.

With ``park`` (Seesaw's tiered buffer, §4.2), a full pool does not end the prefill phase: prompts
it has read go to the daemons' host tier (a swap-out) while the tier has room, and it goes on; a
switch sends a parked sequence's KV from tier to tier, and the decode phase brings parked
requests back as others finish, so a switch happens once per pools-and-tier-full.
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Callable, Sequence

from hpipe.core.plan import Stage
from hpipe.core.units import UnitRange
from runtime.coordinator.engine import Engine, Planned, Request
from runtime.coordinator.policies import decode_waits, prefill_chunks
from runtime.coordinator.session import Session

log = logging.getLogger(__name__)

PHASES = ("prefill", "decode")


def fine_stages(layouts: dict[str, Sequence[Stage]]) -> dict[str, list[Stage]]:
    """Each layout as one pipeline of the same stages: the unit ranges between any two cuts of any
    layout, each on the daemon that holds it in that layout."""
    first = next(iter(layouts.values()))
    total, layers = first[-1].units.end, first[0].units.num_layers
    for name, stages in layouts.items():
        if stages[0].units.start != 0 or stages[-1].units.end != total or any(
                a.units.end != b.units.start for a, b in zip(stages, stages[1:])):
            raise ValueError(f"the {name} layout does not cover units [0, {total}) in order")
    cuts = sorted({s.units.start for stages in layouts.values() for s in stages} | {total})
    out = {}
    for name, stages in layouts.items():
        fine = []
        for a, b in zip(cuts, cuts[1:]):
            owner = next(s for s in stages if s.units.start <= a < s.units.end)
            fine.append(replace(owner, units=UnitRange(a, b, layers), memory_bytes=0, compute_s=0.0))
        out[name] = fine
    return out


class SeesawPhases:
    """The engine's policy for Seesaw, starting in ``phase`` (whose layout the caller has loaded);
    ``deploy(phase, session)`` loads ``phase``'s layout and returns a session that took
    ``session``'s sequences over."""

    name = "seesaw"

    def __init__(self, deploy: Callable[[str, Session], Session], phase: str = "prefill", budget: int = 512,
                 low_water: float = 0.25, send_kv: Callable[[str, Session, list[int] | None], dict] | None = None,
                 early: bool = True, park: bool = False):
        if phase not in PHASES:
            raise ValueError(f"a phase is prefill or decode, not {phase!r}")
        self.deploy, self.phase, self.budget, self.low_water = deploy, phase, budget, low_water
        #: ``send_kv(phase, session, sequence ids or None for all)``: the KV of the stages a switch
        #: to ``phase`` moves, sent to their new owners (what was sent:
        #: :func:`runtime.coordinator.kv_moves.send_moved_kv`); None: replays rebuild it all
        self.send_kv = send_kv
        #: send a prompt's KV to its decode owners as soon as it is read, while the prefill phase
        #: computes the others (its KV does not change until the decode phase); the switch sends the rest
        self.early = early and send_kv is not None
        #: park prefilled requests in the daemons' host tier when the pools are full, so the prefill
        #: phase goes on past what the pools hold and the decode phase brings them back as others
        #: finish (Seesaw's tiered buffer, §4.2); only where a switch sends the KV of every stage it
        #: moves (a parked sequence's goes from one host tier to the other) and the engine swaps
        self.park = park and send_kv is not None
        self._early_ids: set[int] = set()  # sequences sent ahead this prefill phase
        self._early_sends: list[Future] = []
        self._sender: ThreadPoolExecutor | None = None  # the early sends' thread, for a prefill phase
        self.batch = 0           # requests decoding when the decode phase began
        self.parked = 0          # requests parked in the host tier by the prefill phases
        self._room: dict[str, tuple[int, int]] = {}  # phase -> its layout's tightest pool and tier, in blocks
        self.switches: list[dict] = []  # each switch: to which phase, when, how long it took

    # --- forming micro-batches ------------------------------------------------------------------
    def form(self, engine: Engine) -> list[Planned]:
        if self.phase == "prefill":
            planned: list[Planned] = []
            prefill_chunks(engine, self.budget, planned, shortest_first=False,
                           admit=lambda r: self._admit(engine, r, planned),
                           skip=lambda r: bool(r.swapped))  # parked: the decode phase brings it back
            if self.early:  # after parking: a parked request's KV goes from the host tier at the switch
                self._send_ahead(engine)
            return planned
        # mid-answer and waiting: parked, or the switch kept none of its KV (every stage moved: it
        # computes its prompt and tokens again here, and decodes on)
        blocks = self._blocks(engine)
        for r in [r for r in engine.waiting if r.tokens]:
            if not _reserve(engine, r, blocks):
                break
        answering = _answering(engine)
        if self._drained(engine, answering):
            return []  # let what is in flight come back, then switch
        depth = max(1, min(engine.lanes, engine.depth))
        quota = math.ceil(len(answering) / depth)
        ready = sorted((r for r in answering if r.ready), key=lambda r: r.admitted)
        # decode tokens wait to go as one group a lane, as gllm's do; a request resumed by a switch
        # computes its last token again as a one-token chunk, which never waits
        if decode_waits(engine, sum(1 for r in ready if not r.prefilling), quota, depth):
            ready = [r for r in ready if r.prefilling]
        return [Planned(r, r.next_chunk() if r.prefilling else 1) for r in ready[:quota]]

    def _drained(self, engine: Engine, answering: list[Request]) -> bool:
        """Decode has run low (or out), requests wait to be prefilled, and none waits to decode (a
        parked one, or one a switch started again, comes back first)."""
        return bool(engine.waiting) and len(answering) <= self.low_water * self.batch and \
            not any(r.tokens for r in engine.waiting)

    def _admit(self, engine: Engine, r: Request, planned: list[Planned]) -> bool:
        """The prefill phase's admission: ``r`` if the pools hold it beside the requests running
        (:func:`_reserve`); if not, and parking, prompts read since the last call go to the host
        tier one at a time (the newest first) until they do; never one with an entry ``planned``
        in this micro-batch (a request a switch resumed, computing its last token again)."""
        blocks = self._blocks(engine)
        if _reserve(engine, r, blocks):
            return True
        if not self.park:
            return False
        tier = min(self._room[phase][1] for phase in self._room)
        busy = {id(p.request) for p in planned}
        for victim in sorted((x for x in engine.running if x.tokens and x.seq_id not in self._early_ids
                              and id(x) not in busy), key=lambda x: -x.admitted):
            if engine.park(victim, tier):  # else the tier has no room for it: it decodes in the next phase
                self.parked += 1
                if _reserve(engine, r, blocks):
                    return True
        return False

    def learn(self, phase: str, blocks: int, tier: int) -> None:
        """``phase``'s layout has pools of ``blocks`` blocks at the tightest stage and a host tier of
        ``tier`` (known before the run, the first prefill phase admits and parks only what the
        decode layout holds too: :func:`runtime.coordinator.deploy.learn_rooms`)."""
        self._room[phase] = (blocks, tier)

    def _blocks(self, engine: Engine) -> int:
        """The pool blocks a request admitted now may count on: the tightest pool of both layouts
        that this policy has run on (a daemon's pools are sized for the stages it holds, so the
        layouts' differ), as it must fit the one after the next switch too (0: no pools)."""
        self._room[self.phase] = (engine.room.blocks, engine.tier)
        return min(b for b, _ in self._room.values())

    def _send_ahead(self, engine: Engine) -> None:
        """Start sending the KV of prompts read since the last call to their decode owners, on the
        sender's thread (the engine goes on forming micro-batches)."""
        ids = [r.seq_id for r in engine.running
               if r.tokens and not r.prefilling and not r.in_flight and r.seq_id not in self._early_ids]
        if ids:
            self._early_ids.update(ids)
            if self._sender is None:
                self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="seesaw-kv")
            self._early_sends.append(self._sender.submit(self.send_kv, "decode", engine.session, ids))

    def _send_rest(self, to: str, old: Session, running: list[Request]) -> dict:
        """Before a switch to ``to``: wait for what was sent ahead, then send the KV of every other
        running request; what was sent (``sent_ahead_bytes``: of it, before the switch)."""
        ahead = [f.result() for f in self._early_sends]
        if self._sender is not None:
            self._sender.shutdown()
        rest = [r.seq_id for r in running if r.seq_id not in self._early_ids] if ahead else None
        sent = self.send_kv(to, old, rest)
        self._early_ids, self._early_sends, self._sender = set(), [], None
        if ahead:
            sent["sent_ahead_bytes"] = sum(a["sent_bytes"] for a in ahead)
            sent["sent_bytes"] += sent["sent_ahead_bytes"]
            sent["sent_sequences"] += sum(a["sent_sequences"] for a in ahead)
            sent["sent_stages"] = max([sent["sent_stages"]] + [a["sent_stages"] for a in ahead])
        return sent

    # --- switching --------------------------------------------------------------------------------
    def switch(self, engine: Engine) -> bool:
        """With nothing in flight: switch phases if this one has nothing left to do (True if it did)."""
        answering = _answering(engine)
        if self.phase == "prefill":
            if not answering or len(answering) < len(engine.running):  # a prompt is not all read yet
                return False
            to = "decode"
        else:
            if not self._drained(engine, answering):
                return False
            to = "prefill"
        t0 = time.monotonic()
        sent: dict = {}
        parked = sum(1 for r in engine.waiting if r.swapped)

        def deploy(old: Session) -> Session:
            if self.send_kv is not None:  # the running requests' KV, and the parked ones' from the tier
                sent.update(self._send_rest(to, old, engine.running + [r for r in engine.waiting if r.swapped]))
            return self.deploy(to, old)
        resumed = engine.switch(deploy)
        self.phase = to
        if to == "decode":  # with those the switch restarted mid-answer (the decode phase takes them back)
            self.batch = len(_answering(engine)) + sum(1 for r in engine.waiting if r.tokens)
        took = time.monotonic() - t0
        self.switches.append({"to": to, "at_s": t0, "seconds": took, "requests": len(engine.running),
                              "parked": parked, **resumed, **sent})
        log.info("seesaw: switched to the %s layout in %.2f s (%d requests running)", to, took, len(engine.running))
        return True


def _answering(engine: Engine) -> list[Request]:
    """Running requests past their prompt (they have a token: decode work, whatever a switch's
    resume left them to compute again)."""
    return [r for r in engine.running if r.tokens]


def _reserve(engine: Engine, r: Request, blocks: int) -> bool:
    """Admit ``r`` as the prefill phase does: only if pools of ``blocks`` blocks hold it and every
    request already running at their full lengths (no prefill is preempted)."""
    room = engine.room
    if blocks and engine.running:  # alone, it is the engine's to admit (or to fail, if too long)
        shared = (engine.cache.ready - engine.cache.idle) if engine.cache is not None else 0  # cached blocks in use
        reserved = sum(room.of(x.max_len) for x in engine.running) + room.of(r.max_len)
        if reserved > blocks - shared:
            return False
    return engine.admit(r)
