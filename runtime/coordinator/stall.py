"""The engine's guard against waiting forever: requests present, nothing in flight, nothing sent.

Policies are functions of the engine's state, so once the engine holds requests, has no
micro-batch in flight and its policy forms none, no later moment changes that by itself: only a
request added or ended does. Such a state is a scheduling bug (one was found in stop 51: a
swapped request waiting for more room than the pools could ever give it), and without a guard it
is a hang. The guard turns it into an error: after ``STALL_S`` seconds of it, one request is
ended with an ``INTERNAL`` error naming what the engine held — the newest running request (it
loses the least work and gives its blocks back), else the first waiting one — and the others go
on. If the engine is still stuck, another follows ``STALL_S`` seconds later.
"""

from __future__ import annotations

import logging
import time

from runtime.coordinator.request import Request

log = logging.getLogger(__name__)

#: seconds the engine may hold requests with nothing in flight and nothing to send
STALL_S = 5.0


class StallGuard:
    """Watches an engine's idle passes (:meth:`idle`); says which request to end once stuck."""

    def __init__(self):
        self._seen: tuple | None = None
        self._since = 0.0

    def idle(self, engine) -> Request | None:
        """The engine sent nothing and has nothing in flight: the request to end now, if it has
        been stuck this way for ``STALL_S`` seconds."""
        if not engine.running and not engine.waiting:
            self._seen = None
            return None
        state = (engine.micro_batches, [r.id for r in engine.running], [r.id for r in engine.waiting])
        now = time.monotonic()
        if state != self._seen:
            self._seen, self._since = state, now
            return None
        if now - self._since < STALL_S:
            return None
        self._seen = None
        return max(engine.running, key=lambda r: r.admitted) if engine.running else engine.waiting[0]

    @staticmethod
    def error(engine) -> str:
        room = engine.room
        used = room.used(engine.running) if room.blocks else 0
        message = (f"INTERNAL: the scheduler stalled: nothing it would send for {STALL_S:g} s with "
                   f"{len(engine.running)} running and {len(engine.waiting)} waiting (KV pools {room.blocks} "
                   f"blocks, {used} in use; host tier {engine.tier_used} of {engine.tier}); this request was "
                   f"ended so the others go on (a bug: please report it)")
        log.error(message)
        return message
