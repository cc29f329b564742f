"""The sequences a daemon holds: each one's KV cache per stage, its progress, and its lifetime.

A sequence's KV cache lives from ``open`` until ``close``, a failure, or ``idle_timeout_s``
without traffic (a vanished coordinator), whichever comes first. The table is guarded by one
lock; the worker and sender threads read a sequence's fields without it (they only ever append or
flag, and a closed sequence is skipped).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from hpipe.core.errors import StatusError
from hpipe.model import StageCache

log = logging.getLogger(__name__)

#: the longest a sequence may sit idle before its KV cache is freed (an Open asking for more is refused)
MAX_IDLE_TIMEOUT_S = 3600.0
DEFAULT_IDLE_TIMEOUT_S = 60.0
CLOSED = object()  # sentinel that ends a results stream


@dataclass
class Stats:
    compute_s: float = 0.0
    send_s: float = 0.0
    recv_decode_s: float = 0.0
    slices: int = 0
    bytes_sent: int = 0
    #: (start, length, received, begin, end) per computed slice, wall-clock seconds
    spans: list = field(default_factory=list)
    stage: int = 0  # the stage these are of


@dataclass
class SliceOutput:
    start: int
    length: int
    logits: object = None  # torch.Tensor, device_io.Pending, or None
    error: str = ""


@dataclass
class SequenceStage:
    """A sequence's state on one stage: its KV cache, progress and timings."""
    cache: StageCache
    submitted: int = 0  # positions accepted so far (the queue may still hold some)
    stats: Stats = field(default_factory=Stats)
    timers: list = field(default_factory=list)  # (start, length, received, Timer) per slice, read when stats are
    decode: object = None  # DecodeStep (CUDA graph) once the sequence decodes on a GPU
    decode_steps: int = 0


@dataclass
class Sequence:
    id: int
    stages: dict  # stage index -> SequenceStage
    idle_timeout_s: float
    last_active: float
    error: str = ""
    closed: bool = False
    results: "queue.Queue" = field(default_factory=queue.Queue)
    anchor: object = None  # device_io.Anchor of a GPU sequence: places its timers on the wall clock

    @property
    def kv_bytes(self) -> int:
        return sum(s.cache.nbytes for s in self.stages.values())

    def fail(self, message: str) -> None:
        if not self.error:
            self.error = message
            log.error("sequence %d failed: %s", self.id, message)
            self.results.put(SliceOutput(0, 0, error=message))


def idle_timeout(requested: float) -> float:
    """The idle timeout an Open gets: the default for 0, refused past :data:`MAX_IDLE_TIMEOUT_S`."""
    if requested != requested or requested < 0 or requested > MAX_IDLE_TIMEOUT_S:  # NaN, negative, inf
        raise StatusError("INVALID_ARGUMENT", f"idle_timeout_s must lie in [0, {MAX_IDLE_TIMEOUT_S:.0f}] "
                          f"(0: the default, {DEFAULT_IDLE_TIMEOUT_S:.0f} s), got {requested}")
    return requested or DEFAULT_IDLE_TIMEOUT_S


class SequenceTable:
    def __init__(self):
        self.lock = threading.RLock()
        self._open: dict[int, Sequence] = {}

    def __len__(self) -> int:
        return len(self._open)

    def ids(self) -> list[int]:
        with self.lock:
            return list(self._open)

    def add(self, seq: Sequence) -> None:
        with self.lock:
            if seq.id in self._open:
                raise StatusError("ALREADY_EXISTS", f"sequence {seq.id} is already open")
            self._open[seq.id] = seq

    def get(self, seq_id: int) -> Sequence:
        with self.lock:
            seq = self._open.get(seq_id)
        if seq is None or seq.closed:
            raise StatusError("NOT_FOUND", f"unknown sequence {seq_id} (never opened, closed, or timed out)")
        return seq

    def find(self, seq_id: int) -> Sequence | None:
        with self.lock:
            return self._open.get(seq_id)

    def kv_bytes(self) -> int:
        with self.lock:
            return sum(s.kv_bytes for s in self._open.values())

    def pop(self, seq_id: int) -> Sequence | None:
        with self.lock:
            seq = self._open.pop(seq_id, None)
        if seq is not None:
            seq.closed = True
            seq.results.put(CLOSED)
        return seq

    def idle(self) -> list[int]:
        now = time.monotonic()
        with self.lock:
            return [s.id for s in self._open.values() if now - s.last_active > s.idle_timeout_s]
