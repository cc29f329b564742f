"""Micro-batch layouts on a daemon: laid out as they arrive, kept until every held stage computed.

A coordinator sends each micro-batch's layout to every daemon of its pipeline, in order, on its
session's data connection. Laying it out opens the sequences it names for the first time and
grows every named sequence's KV blocks on each held stage, so the worker never allocates. A
sequence that cannot be laid out (unknown, failed, out of order, or out of KV blocks) is refused
alone: it is recorded as failed, its entries are computed as dead rows (so the micro-batch keeps
its shape), and the failure travels with the micro-batch's data to the coordinator.

An entry that starts before the position its sequence reached rewinds it there (its later KV
blocks and replay log are dropped), but never into the cached prefix a sequence began with on a
stage (:mod:`runtime.daemon.prefix_store`): those blocks are shared, and a sequence never writes
them. A stage that has none of them (one a layout switch or a recovery moved here) is rebuilt
from position 0 like any other. A replay micro-batch (``MicroBatch.replay``) is laid out only
on the held stages it rebuilds; a daemon holding the stage just before them sends it from its
replay log (:mod:`runtime.coordinator.resume` plans replays).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

from hpipe.core.errors import HpipeError
from hpipe.model.kv.pool import BLOCK_SIZE, PoolExhausted
from runtime.daemon.outbox import Outbox
from runtime.daemon.prefix_store import PrefixStore
from runtime.daemon.replay_log import ReplayLog
from runtime.daemon.sequences import Sequence, SequenceTable
from runtime.wire.messages import pb

log = logging.getLogger(__name__)

#: how long an activation that arrived before its layout waits for it
LAYOUT_WAIT_S = 60.0
#: the most tokens one micro-batch may hold
MAX_TOKENS = 1 << 16


class LaidOutBatch:
    """A micro-batch as this daemon laid it out: its entries' sequences found or opened, their
    positions planned on the held stages, the entries that failed, the stages still to compute it."""

    def __init__(self, session: int, mb: pb.MicroBatch, held: list[int], key: bytes = b""):
        self.session, self.id, self.entries = session, mb.id, list(mb.entries)
        self.key = key  # the session's (runtime.daemon.owners): its activations carry it to the next daemon
        self.tokens = sum(e.length for e in self.entries)
        self.failures: dict[int, pb.Failure] = {}
        self.remaining = set(held)
        #: a replay's last stage, which passes nothing on (None: an ordinary micro-batch)
        self.last: int | None = mb.replay.last if mb.HasField("replay") else None

    def forwards(self, stage: int) -> bool:
        """Whether ``stage``'s output of this micro-batch goes on to the next stage."""
        return self.last is None or stage < self.last

    def fail(self, seq_id: int, code: str, message: str) -> None:
        self.failures.setdefault(seq_id, pb.Failure(sequence_id=seq_id, code=code, message=message))

    def fail_all(self, stage: int, code: str, message: str) -> None:
        for e in self.entries:
            self.fail(e.sequence_id, code, message)
        log.error("%s", message)


class Layouts:
    """The layouts of every session on this daemon. ``stages`` gives the held stages (they change
    with each deployment); ``stopping`` is set when the daemon shuts down."""

    def __init__(self, stages: Callable[[], dict], sequences: SequenceTable, replay_log: ReplayLog,
                 outbox: Outbox, stopping: threading.Event, prefixes: PrefixStore,
                 swap_in: Callable[[Sequence], None] | None = None):
        self.stages, self.sequences, self.replay_log, self.prefixes = stages, sequences, replay_log, prefixes
        #: brings a sequence's KV back from the host tier before it is extended (runtime.daemon.kv_tier)
        self.swap_in = swap_in
        self.outbox, self.stopping = outbox, stopping
        self._by_key: dict[tuple[int, int], LaidOutBatch] = {}
        self._ended: deque[int] = deque(maxlen=256)  # sessions ended lately: their late data is skipped
        self._arrived = threading.Condition()

    def add(self, session: int, mb: pb.MicroBatch, key: bytes = b"") -> None:
        """Lay out ``mb`` (the session's next micro-batch, from its connection with ``key``) on every
        held stage it runs on."""
        held = stages = self.stages()
        source = None
        if mb.HasField("replay"):
            first, last = mb.replay.first, mb.replay.last
            stages = {i: s for i, s in held.items() if first <= i <= last}
            source = first - 1 if first - 1 in held else None
            if not stages and source is None:
                return  # nothing of it here
        layout = LaidOutBatch(session, mb, list(stages), key)
        if not held:
            layout.fail_all(-1, "FAILED_PRECONDITION", "no model is loaded on this daemon (deploy a plan first)")
        elif layout.tokens > MAX_TOKENS or any(e.length < 1 for e in layout.entries):
            layout.fail_all(-1, "INVALID_ARGUMENT", f"micro-batch {mb.id}: {layout.tokens} tokens; entries need "
                            f"1 token or more, {MAX_TOKENS} in all at most")
        else:
            seen = set()
            for e in layout.entries:
                if e.sequence_id in seen:
                    layout.fail(e.sequence_id, "INVALID_ARGUMENT", f"sequence {e.sequence_id} appears twice in "
                                f"micro-batch {mb.id}")
                    continue
                seen.add(e.sequence_id)
                if stages:
                    self._lay_out(layout, session, e, held, stages)
            if layout.last is not None:
                self._fail_replayed(layout)
        if stages:
            with self._arrived:
                self._by_key[session, mb.id] = layout
                self._arrived.notify_all()
        if source is not None:
            self.outbox.replay(held[source], layout)

    def _fail_replayed(self, layout: LaidOutBatch) -> None:
        """A replay has no result to carry its failures to the coordinator: each sequence it could
        not lay out fails here, so its next entry fails with ``DATA_LOSS`` and the coordinator
        computes it again in a new sequence, instead of that entry finding the stage short of it."""
        for seq_id, failure in layout.failures.items():
            seq = self.sequences.find(seq_id)
            if seq is not None and seq.session == layout.session:
                seq.fail("DATA_LOSS", f"replaying it: {failure.code}: {failure.message}")

    def _lay_out(self, layout: LaidOutBatch, session: int, e: pb.Entry, held: dict, stages: dict) -> None:
        """Open (on every ``held`` stage) or find ``e``'s sequence, and lay ``e`` out on ``stages``."""
        seq = self.sequences.find(e.sequence_id)
        if seq is None:
            seq = self._open(layout, session, e, held)
            if seq is None:
                return
        elif seq.session != session:
            layout.fail(e.sequence_id, "PERMISSION_DENIED", f"sequence {e.sequence_id} belongs to another session")
            return
        if seq.error:
            layout.fail(e.sequence_id, seq.code or "ABORTED", seq.error)
            return
        if self.swap_in is not None:
            try:
                self.swap_in(seq)
            except HpipeError as err:  # no room (it stays in the tier), or the worker did not get to it:
                # the coordinator recomputes it
                layout.fail(e.sequence_id, "RESOURCE_EXHAUSTED", f"sequence {e.sequence_id}: swapping it in: {err}")
                return
        for i in stages:
            if e.start > seq.planned[i]:
                layout.fail(e.sequence_id, "FAILED_PRECONDITION", f"sequence {e.sequence_id}: an entry starts at "
                            f"position {e.start}; the sequence continues at {seq.planned[i]}")
                return
            # this stage's cached prefix (a stage moved here has none: it is rebuilt from 0)
            shared = seq.kv[i].shared * seq.kv[i].pool.block_size if i in seq.kv else 0
            if e.start < shared:
                layout.fail(e.sequence_id, "FAILED_PRECONDITION", f"sequence {e.sequence_id}: an entry starts at "
                            f"position {e.start}, inside the {shared} cached positions it began with on stage {i}")
                return
            if e.start < seq.planned[i]:
                self._rewind(seq, i, e.start)
            end = e.start + e.length
            if end > seq.max_len:
                layout.fail(e.sequence_id, "OUT_OF_RANGE", f"positions up to {end} exceed sequence {e.sequence_id}'s "
                            f"declared max length {seq.max_len}")
                return
            if i in seq.kv:
                try:
                    seq.kv[i].grow(end)
                except PoolExhausted as err:
                    seq.fail("RESOURCE_EXHAUSTED", f"stage {i}: {err}")
                    layout.fail(e.sequence_id, seq.code, seq.error)
                    return
                if e.keep:
                    first = e.start // BLOCK_SIZE
                    if (first + len(e.keep)) * BLOCK_SIZE > end:
                        layout.fail(e.sequence_id, "INVALID_ARGUMENT", f"sequence {e.sequence_id}: {len(e.keep)} "
                                    f"blocks to keep from block {first} are not all filled by positions "
                                    f"{e.start}-{end}")
                        return
                    self.prefixes.keep(session, i, seq.kv[i], first, list(e.keep))
            seq.planned[i] = end
        seq.last_active = time.monotonic()

    def _open(self, layout: LaidOutBatch, session: int, e: pb.Entry, held: dict) -> Sequence | None:
        """A new sequence for ``e`` (its blocks on every ``held`` stage, its cached prefix adopted),
        or None with ``e`` failed in ``layout``."""
        cfg = next(iter(held.values())).model.cfg
        if e.max_len <= 0:
            layout.fail(e.sequence_id, "NOT_FOUND", f"unknown sequence {e.sequence_id} (never opened, closed, "
                        "or timed out)")
            return None
        if e.max_len > cfg.max_position_embeddings:
            layout.fail(e.sequence_id, "OUT_OF_RANGE", f"max_len {e.max_len} exceeds the model's context of "
                        f"{cfg.max_position_embeddings} tokens")
            return None
        cached = len(e.cached) * BLOCK_SIZE
        if e.cached and (e.start != cached or cached >= e.max_len):
            layout.fail(e.sequence_id, "INVALID_ARGUMENT", f"sequence {e.sequence_id} begins with "
                        f"{len(e.cached)} cached blocks ({cached} positions) but its entry starts at {e.start} "
                        f"of at most {e.max_len}")
            return None
        seq = Sequence(e.sequence_id, session, e.max_len,
                       {i: s.pool.sequence(e.max_len) for i, s in held.items() if s.pool is not None},
                       {i: cached for i in held}, {i: cached for i in held})
        if e.cached:
            missing = self.prefixes.begin(session, seq.kv, list(e.cached))
            if missing:  # the coordinator's index and this daemon disagree: it starts again without;
                seq.fail("DATA_LOSS", f"sequence {e.sequence_id}: {missing}")  # its later entries fail alike
        try:
            self.sequences.add(seq)
        except HpipeError as err:
            for kv in seq.kv.values():
                kv.release()
            layout.fail(e.sequence_id, "ALREADY_EXISTS", str(err))
            return None
        return seq

    def _rewind(self, seq: Sequence, stage: int, position: int) -> None:
        """Drop ``seq``'s positions from ``position`` on held ``stage`` (its KV blocks past them, its log)."""
        seq.planned[stage] = position
        seq.computed[stage] = min(seq.computed.get(stage, 0), position)
        if stage in seq.kv:
            seq.kv[stage].truncate(position)
        self.replay_log.truncate(seq, stage, position)

    def wait(self, session: int, mb_id: int, timeout_s: float = LAYOUT_WAIT_S) -> LaidOutBatch | None:
        deadline = time.monotonic() + timeout_s
        with self._arrived:
            while (session, mb_id) not in self._by_key:
                if session in self._ended:
                    return None
                left = deadline - time.monotonic()
                if left <= 0 or self.stopping.is_set():
                    return None
                self._arrived.wait(min(left, 1.0))
            return self._by_key[session, mb_id]

    def done(self, layout: LaidOutBatch, stage: int) -> None:
        """Stage ``stage`` computed the micro-batch: forget it once every held stage has."""
        layout.remaining.discard(stage)
        if not layout.remaining:
            with self._arrived:
                self._by_key.pop((layout.session, layout.id), None)

    def forget(self, session: int) -> None:
        """Drop a session's layouts; its data still on the way is skipped when it arrives."""
        with self._arrived:
            for key in [k for k in self._by_key if k[0] == session]:
                del self._by_key[key]
            self._ended.append(session)
            self._arrived.notify_all()

    def ended(self, session: int) -> bool:
        with self._arrived:
            return session in self._ended
