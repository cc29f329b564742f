"""What a daemon measured for each coordinator session, per held stage, until the session asks.

Per stage: compute, send and receive seconds, micro-batches, bytes sent, and when each
micro-batch arrived and was computed (``hpipe bench`` draws the pipeline as it ran from these).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

#: spans kept per session and stage; a long-running server's sessions keep only the latest
MAX_SPANS = 100_000


@dataclass
class StageStats:
    stage: int
    compute_s: float = 0.0
    send_s: float = 0.0
    recv_s: float = 0.0
    micro_batches: int = 0
    bytes_sent: int = 0
    timers: list = field(default_factory=list)  # (micro-batch, tokens, received, Timer), read when asked

    def spans(self) -> list[tuple]:
        """(micro-batch, tokens, received, begin, end) per micro-batch computed, wall-clock seconds."""
        return [(mb, n, received, *span) for mb, n, received, t in self.timers if (span := t.span()) is not None]


class SessionStats:
    def __init__(self):
        self._lock = threading.Lock()
        self._by_session: dict[int, dict[int, StageStats]] = {}

    def _get(self, session: int, stage: int) -> StageStats:
        per = self._by_session.setdefault(session, {})
        return per.setdefault(stage, StageStats(stage))

    def add_recv(self, session: int, stage: int, seconds: float) -> None:
        with self._lock:
            self._get(session, stage).recv_s += seconds

    def add_send(self, session: int, stage: int, seconds: float, nbytes: int) -> None:
        with self._lock:
            s = self._get(session, stage)
            s.send_s += seconds
            s.bytes_sent += nbytes

    def add_span(self, session: int, stage: int, mb: int, tokens: int, received: float, timer) -> None:
        with self._lock:
            s = self._get(session, stage)
            s.micro_batches += 1
            if len(s.timers) < MAX_SPANS:
                s.timers.append((mb, tokens, received, timer))

    def pop(self, session: int) -> list[StageStats]:
        """The session's statistics per stage (compute seconds totalled now), forgotten here."""
        with self._lock:
            per = self._by_session.pop(session, {})
        for s in per.values():
            s.compute_s = sum(t.seconds() for *_, t in s.timers)
        return [per[k] for k in sorted(per)]
