"""The sequences a daemon holds: each one's KV blocks per held stage, its progress, its lifetime.

A sequence opens with its first entry in a micro-batch's layout (which declares its max length)
and takes KV blocks as later layouts extend it (or gives them back when one rewinds it). A
recovering coordinator's new session adopts it (``Resume``). It is freed when its coordinator closes it or
disconnects, when it fails, or after ``idle_timeout_s`` without being named in a layout or a
status request; its blocks go back to the pool at once (:mod:`hpipe.model.kv.pool` says why that
is safe beside a micro-batch being computed).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from hpipe.core.errors import StatusError
from hpipe.model.kv.pool import SeqKV

log = logging.getLogger(__name__)

#: how long a sequence may go unmentioned before its KV blocks are freed: a coordinator that
#: vanished without closing its connection (one that closes it frees its sequences at once)
IDLE_TIMEOUT_S = 300.0


@dataclass
class Sequence:
    id: int
    session: int
    max_len: int
    kv: dict[int, SeqKV]          # held stage index -> its blocks there
    planned: dict[int, int]       # held stage index -> positions laid out so far
    computed: dict[int, int] = field(default_factory=dict)  # held stage index -> positions in its KV cache
    logs: dict | None = field(default_factory=dict)  # held stage index -> its replay log (runtime.daemon.replay_log)
    last_active: float = field(default_factory=time.monotonic)
    error: str = ""
    code: str = ""
    closed: bool = False

    @property
    def kv_bytes(self) -> int:
        return sum(k.nbytes for k in self.kv.values())

    def fail(self, code: str, message: str) -> None:
        if not self.error:
            self.code, self.error = code, message
            log.warning("sequence %d failed: %s", self.id, message)


class SequenceTable:
    """Open sequences by id; one lock for the table (the layouts that grow them run in order)."""

    def __init__(self, idle_timeout_s: float = IDLE_TIMEOUT_S):
        self.lock = threading.RLock()
        self.idle_timeout_s = idle_timeout_s
        self._open: dict[int, Sequence] = {}

    def __len__(self) -> int:
        return len(self._open)

    def ids(self, session: int | None = None) -> list[int]:
        with self.lock:
            return [i for i, s in self._open.items() if session is None or s.session == session]

    def all(self) -> list[Sequence]:
        with self.lock:
            return list(self._open.values())

    def add(self, seq: Sequence) -> None:
        with self.lock:
            if seq.id in self._open:
                raise StatusError("ALREADY_EXISTS", f"sequence {seq.id} is already open")
            self._open[seq.id] = seq

    def find(self, seq_id: int) -> Sequence | None:
        with self.lock:
            return self._open.get(seq_id)

    def touch(self, seq_ids) -> None:
        now = time.monotonic()
        with self.lock:
            for i in seq_ids:
                seq = self._open.get(i)
                if seq is not None:
                    seq.last_active = now

    def adopt(self, old: int, new: int) -> list[Sequence]:
        """Session ``new`` takes over ``old``'s sequences, their errors cleared (a recovering
        coordinator decides from where each goes on)."""
        now = time.monotonic()
        with self.lock:
            taken = [s for s in self._open.values() if s.session == old]
            for s in taken:
                s.session, s.error, s.code, s.last_active = new, "", "", now
        return taken

    def pop(self, seq_id: int, session: int | None = None) -> Sequence | None:
        """Take a sequence out of the table (its blocks are the caller's to free); with ``session``,
        only if it belongs to that session."""
        with self.lock:
            seq = self._open.get(seq_id)
            if seq is None or (session is not None and seq.session != session):
                return None
            del self._open[seq_id]
        if seq is not None:
            seq.closed = True
        return seq

    def fail(self, seq_ids, session: int, code: str, message: str) -> None:
        """Fail these sequences if they still belong to ``session`` (not adopted by a new one)."""
        for i in set(seq_ids):
            seq = self.find(i)
            if seq is not None and seq.session == session:
                seq.fail(code, message)

    def idle(self) -> list[int]:
        now = time.monotonic()
        with self.lock:
            return [s.id for s in self._open.values() if now - s.last_active > self.idle_timeout_s]
