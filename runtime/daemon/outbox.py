"""A daemon's sender: computed outputs leave here, in the order the worker made them.

One thread takes each output off a queue: a held stage's output is kept in its sequences' replay
logs (:mod:`runtime.daemon.replay_log`) and goes on to the next stage's daemon over one persistent
connection; the last stage's output (the sampled rows' logits) goes back to the coordinator on its
session's own data connection. A replay (a stage just before restarted ones) sends logged rows
instead. A send that fails fails the micro-batch's sequences, so their coordinator learns of it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from runtime.daemon.device_io import Pending
from runtime.daemon.replay_log import ReplayLog
from runtime.daemon.sequences import SequenceTable
from runtime.daemon.session_stats import SessionStats
from runtime.wire.messages import pb
from runtime.wire.transport import Connection, LinkError, connect

log = logging.getLogger(__name__)

_STOP = object()


class Outbox:
    def __init__(self, sequences: SequenceTable, replay_log: ReplayLog, stats: SessionStats,
                 token: str | None = None, tls_client=None):
        self.sequences, self.replay_log, self.stats = sequences, replay_log, stats
        self._token, self._tls_client = token, tls_client
        self._sessions: dict[int, Connection] = {}  # session -> its coordinator's data connection
        self._links: dict[tuple[str, int], Connection] = {}  # successor's data address -> connection
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._closed = threading.Event()  # set first when the daemon shuts down: nothing more leaves
        self._thread = threading.Thread(target=self._loop, name="stage-sender", daemon=True)
        self._thread.start()

    # --- sessions -------------------------------------------------------------------------------
    def attach(self, session: int, conn: Connection) -> None:
        """Results of ``session`` go back on ``conn`` from now on."""
        with self._lock:
            self._sessions[session] = conn

    def detach(self, session: int, conn: Connection) -> None:
        with self._lock:
            if self._sessions.get(session) is conn:
                del self._sessions[session]

    # --- what the worker and the layouts queue ------------------------------------------------------
    def send(self, stage, act: pb.Activation, payload, layout) -> None:
        """Queue ``stage``'s output of ``layout`` (a tensor or a :class:`Pending` one): logged for
        replays, then passed on (unless ``layout`` is a replay ending at ``stage``)."""
        self._queue.put((stage, act, payload, layout))

    def replay(self, stage, layout) -> None:
        """Send the stage after held ``stage`` its input for the replay ``layout``, from the log."""
        act = pb.Activation(session=layout.session, micro_batch=layout.id, stage=stage.index + 1,
                            session_key=layout.key)
        self._queue.put((stage, act, None, layout))

    def close(self) -> None:
        """Send nothing more: what is queued or still being computed is dropped, not passed on (a
        daemon shutting down frees its sequences, and their rows are no stage's input)."""
        self._closed.set()
        self._queue.put(_STOP)
        with self._lock:
            conns = [*self._links.values(), *self._sessions.values()]
        for conn in conns:
            conn.close()

    # --- the sender thread ----------------------------------------------------------------------
    def _link(self, where: tuple[str, int]) -> Connection:
        conn = self._links.get(where)
        if conn is None or conn.closed:
            conn = self._links[where] = connect(*where, self._token, 0, self._tls_client)
        return conn

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP or self._closed.is_set():
                return
            self._send(*item)
            # hold nothing between items: the stage an item names may be dropped by a new deployment
            # (its weights would stay resident until the next send)
            del item

    def _send(self, stage, act: pb.Activation, payload, layout) -> None:
        t0 = time.perf_counter()
        if payload is None:
            tensor = self.replay_log.replay_input(self.sequences, stage, act, layout)
        else:
            tensor = payload.on_host() if isinstance(payload, Pending) else payload
            if stage.successor is not None:
                self.replay_log.record(self.sequences, stage.index, layout, tensor,
                                       {f.sequence_id for f in act.failed})
            if not layout.forwards(stage.index):
                return
        act.payload_bytes = tensor.numel() * tensor.element_size()
        try:
            if stage.successor is None:
                with self._lock:
                    conn = self._sessions.get(act.session)
                if conn is None:
                    return  # the coordinator is gone: nobody to answer
                sent = conn.send(pb.Frame(activation=act), tensor)
            else:
                sent = self._link(stage.successor).send(pb.Frame(activation=act), tensor)
        except LinkError as e:
            where = "the coordinator" if stage.successor is None else f"stage {stage.index + 1}"
            self.sequences.fail([e.sequence_id for e in layout.entries], act.session, "UNAVAILABLE",
                                f"stage {stage.index} could not send to {where}: {e}")
            return
        self.stats.add_send(act.session, stage.index, time.perf_counter() - t0, sent)
