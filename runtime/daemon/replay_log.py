"""What each stage sent downstream, kept in host memory so a restarted successor can be rebuilt.

Design note. For every open sequence and every held stage that has a successor, the daemon keeps
the stage's output rows, position by position, in one growing host buffer (doubling, capped at
the sequence's max length). When a daemon dies and comes back empty, the coordinator sends a
replay (:mod:`runtime.coordinator.resume`): the stage before the lost one sends these rows again, and the new
owner computes its KV cache from them, without any stage before it computing anything again.

The logs of all sequences together stay within ``budget`` bytes. A sequence whose log would pass
it loses its log on that stage (``logged`` becomes 0): after a failure it is prefilled again from
its token ids instead. A log stops growing where an entry failed (its rows are not the output),
is lost when a later one would leave a gap, and is truncated when the sequence is rewound. Appends and reads run on the sender thread, truncation on
a connection thread, queries on the worker: one lock guards the table.
"""

from __future__ import annotations

import threading

import torch

from hpipe.core.cluster import REPLAY_BUDGET as DEFAULT_BUDGET
from runtime.wire.messages import pb


class _Log:
    __slots__ = ("buf", "length", "lost")

    def __init__(self):
        self.buf: torch.Tensor | None = None
        self.length = 0
        self.lost = False

    @property
    def nbytes(self) -> int:
        return 0 if self.buf is None else self.buf.nbytes


class ReplayLog:
    """The byte budget of a daemon's logs, and the operations on them. Each sequence carries its
    own logs (``Sequence.logs``: stage -> log; None once it is closed), so they go with it."""

    def __init__(self, budget: int = DEFAULT_BUDGET):
        self.budget = budget
        self.nbytes = 0
        self._lock = threading.Lock()

    # --- a daemon's sender ----------------------------------------------------------------------
    def record(self, sequences, stage: int, layout, out: torch.Tensor, failed: set[int]) -> None:
        """Keep each live entry's rows of held ``stage``'s output of ``layout`` in its sequence's log
        (a failed entry's rows are not its output: they are left out, and its log stops there)."""
        off = 0
        for e in layout.entries:
            seq = sequences.find(e.sequence_id)
            if seq is not None and seq.session == layout.session and e.sequence_id not in failed:
                self.append(seq, stage, e.start, out[off:off + e.length])
            off += e.length

    def replay_input(self, sequences, stage, act: pb.Activation, layout) -> torch.Tensor:
        """The input of the replay ``layout`` for stage ``act.stage``, from held ``stage``'s logs.
        A sequence whose rows are not all logged gets zeros, computed as dead rows after this, and
        fails here with ``DATA_LOSS``: its next micro-batch fails too, and the coordinator
        prefills it again."""
        hidden, dtype = stage.model.cfg.hidden_size, stage.model.dtype
        parts = []
        for e in layout.entries:
            seq = sequences.find(e.sequence_id)
            mine = seq is not None and seq.session == layout.session
            rows = self.rows(seq, stage.index, e.start, e.start + e.length) if mine else None
            if rows is None:
                rows = torch.zeros(e.length, hidden, dtype=dtype)
                message = f"stage {stage.index} has no log of positions {e.start}-{e.start + e.length} to replay"
                act.failed.append(pb.Failure(sequence_id=e.sequence_id, code="DATA_LOSS", message=message))
                if mine:
                    seq.fail("DATA_LOSS", message)
            parts.append(rows)
        return torch.cat(parts) if parts else torch.zeros(0, hidden, dtype=dtype)

    # --- the logs ----------------------------------------------------------------------------
    def append(self, seq, stage: int, start: int, rows: torch.Tensor) -> None:
        """Log ``rows`` [n, hidden] as positions ``[start, start + n)`` of ``seq``'s output on ``stage``."""
        n = rows.shape[0]
        with self._lock:
            if seq.logs is None:  # closed meanwhile
                return
            log = seq.logs.setdefault(stage, _Log())
            if log.lost:
                return
            if start > log.length:  # a gap: the positions between were never logged here
                self._lose(log)
                return
            end = start + n
            if log.buf is None or log.buf.shape[0] < end:
                cap = min(max(end, 2 * (log.buf.shape[0] if log.buf is not None else 64)), max(seq.max_len, end))
                extra = cap * rows.shape[1] * rows.element_size() - log.nbytes
                if self.nbytes + extra > self.budget:
                    self._lose(log)
                    return
                grown = torch.empty(cap, rows.shape[1], dtype=rows.dtype)
                if log.buf is not None:
                    grown[:start].copy_(log.buf[:start])
                self.nbytes += extra
                log.buf = grown
            log.buf[start:end].copy_(rows)
            log.length = end

    def _lose(self, log: _Log) -> None:
        self.nbytes -= log.nbytes
        log.buf, log.length, log.lost = None, 0, True

    def truncate(self, seq, stage: int, length: int) -> None:
        with self._lock:
            log = seq.logs.get(stage) if seq.logs is not None else None
            if log is not None and log.length > length:
                log.length = length

    def rows(self, seq, stage: int, start: int, end: int) -> torch.Tensor | None:
        """A copy of the logged positions ``[start, end)``, or None if they are not all logged."""
        with self._lock:
            log = seq.logs.get(stage) if seq.logs is not None else None
            if log is None or log.buf is None or log.length < end:
                return None
            return log.buf[start:end].clone()

    def logged(self, seq, stage: int) -> int:
        with self._lock:
            log = seq.logs.get(stage) if seq.logs is not None else None
            return log.length if log is not None else 0

    def drop_stage(self, seq, stage: int) -> None:
        """Free ``seq``'s log of one stage (the stage moved to another daemon)."""
        with self._lock:
            log = seq.logs.pop(stage, None) if seq.logs is not None else None
            if log is not None:
                self.nbytes -= log.nbytes

    def drop(self, seq) -> None:
        """Free every log of ``seq`` (it closed); later appends find it closed."""
        with self._lock:
            for log in (seq.logs or {}).values():
                self.nbytes -= log.nbytes
            seq.logs = None
