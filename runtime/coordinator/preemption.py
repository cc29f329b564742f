"""Making room in the KV pools: preempting requests, into the host tier or to recompute.

A mixin of :class:`runtime.coordinator.engine.Engine` (its ``room``, ``cache``, ``session``,
``running`` and ``waiting``; the engine's module note says when it preempts): a preempted
request's KV goes to the daemons' host tier while the engine's mirror of the tier has room for it
(:mod:`runtime.daemon.kv_tier`), else it gives its blocks back and recomputes later.
"""

from __future__ import annotations

from runtime.coordinator.request import Request

#: times a daemon may refuse a request for want of KV blocks before it fails
MAX_REFUSALS = 8


class Preempting:
    """The engine's KV room: its free share, making room for a micro-batch, preempting, refusals."""

    def kv_free(self) -> float:
        """The tightest stage's free share of its KV pool, as this engine has laid it out (1 without
        pools; :mod:`runtime.coordinator.kv_room`)."""
        return self.room.free_share(self.running)

    def _make_room(self, planned: list) -> list:
        """``planned`` with the blocks it needs: while short, idle cached blocks are evicted, then the
        newest request not in flight is preempted (its entry dropped if it had one)."""
        while planned and (short := self.room.short(self.running, [(p.request, p.length) for p in planned])) > 0:
            if self.cache is not None and self.cache.idle:
                self.session.evict(self.cache.evict(short))
                continue
            inside = {id(p.request) for p in planned}
            idle = [r for r in self.running if r.in_flight == 0 and (r.laid_out or id(r) in inside)]
            if not idle:
                return []  # every block belongs to micro-batches in flight: wait for them
            victim = max(idle, key=lambda r: r.admitted)
            planned = [p for p in planned if p.request is not victim]
            if victim.laid_out:
                self._preempt(victim)
        return planned

    def park(self, r: Request, tier: int | None = None) -> bool:
        """Swap running ``r`` (nothing of it in flight) out to the host tier to wait there, if the
        tier (of ``tier`` blocks at most) has room for it (True); else nothing changes (a Seesaw
        prefill phase's parking)."""
        room = min(self.tier, self.tier if tier is None else tier) - self.tier_used
        if not self.swap or r.in_flight or r.swapped or r.laid_out <= r.begins_at or self.room.of(r.laid_out) > room:
            return False
        self._preempt(r)
        return True

    def _preempt(self, r: Request, recompute: bool = False) -> None:
        """Free ``r``'s blocks: its KV goes to the host tier if that has room (it comes back when
        ``r`` runs again), else (or with ``recompute``) it recomputes its prompt and tokens then."""
        if r.swapped:  # admitted but not yet brought back: it waits again, its copy still in the tier
            self.running.remove(r)
            self.waiting.insert(0, r)
            return
        blocks = self.room.of(r.laid_out)
        if (self.swap and not recompute and r.laid_out > r.begins_at and not r.swapped
                and blocks <= self.tier - self.tier_used):
            self.session.swap_out([r.seq_id])
            self._let_go(r)  # its copy back is all its own blocks, none shared
            r.swapped, self.tier_used = blocks, self.tier_used + blocks
            self.swaps += 1
        else:
            if r.laid_out:
                self.session.close_sequences([r.seq_id])
            self._let_go(r)
            self._unswap(r)
            self.recomputed += r.laid_out - r.begins_at
            r.new_sequence()
            r.restart(r.prompt + r.tokens)
        r.preemptions += 1
        self.preemptions += 1
        self.running.remove(r)
        self.waiting.insert(0, r)

    def _refused(self, r: Request, code: str, message: str) -> None:
        """A daemon failed ``r``'s sequence: out of KV blocks (or, resuming, without the log to
        rebuild it, or its swapped copy lost), it waits and recomputes in a new sequence (once its
        entries still in flight are back); otherwise it ends with the error."""
        if code == "DATA_LOSS" and self.cache is not None and r.hit:  # a stage lacks a block it began with
            self.cache.drop(r.hit)
        if code not in ("RESOURCE_EXHAUSTED", "DATA_LOSS"):  # DATA_LOSS: a replay found no log
            self._finish(r, "error", f"{code}: {message}")
        elif r.in_flight == 0:
            r.refusals += 1
            if r.refusals > MAX_REFUSALS:
                self._finish(r, "error", f"{code}: {message}")
            else:
                self._preempt(r, recompute=True)

    def _unswap(self, r: Request) -> None:
        self.tier_used -= r.swapped
        r.swapped = 0
