"""A daemon's device worker: one thread that runs every micro-batch and every device call, so
model work never overlaps and an idle daemon uses no CPU.

Micro-batches are handed to ``compute``; functions queued with :meth:`Worker.call` (loads,
profiling, a session's take-over) run between them, on the same thread and under the same limits,
after everything queued before them and before anything queued after.

Small first. Among the micro-batches waiting, the one with the fewest tokens runs next, if no
micro-batch queued before it names one of its sequences (a sequence's positions are computed in
order). A question about a cached document, or a decode step, queued behind long prefill chunks
of other documents would wait for every one of them on every stage it passes; taken first, it
waits at most for the chunk being computed (``docs/decisions/prefix-cache.md``). Total work is the
same; a micro-batch passed over ``MAX_PASSED`` times runs next, so none waits for good.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

from hpipe.core.errors import StatusError
from runtime.daemon import hoststat

log = logging.getLogger(__name__)

_STOP = object()

#: how many later, smaller micro-batches may run before a waiting one
MAX_PASSED = 4


class _Call:
    """A function queued for the worker thread, with its outcome."""

    def __init__(self, fn):
        self.fn, self.result, self.error = fn, None, None
        self.event = threading.Event()

    def run(self) -> None:
        try:
            self.result = self.fn()
        except Exception as e:  # noqa: BLE001 - handed back to the caller's thread
            self.error = e
        finally:
            self.event.set()


class Worker:
    def __init__(self, compute: Callable[..., None], on_start: Callable[[], None] | None = None,
                 shape: Callable[[tuple], tuple[int, frozenset]] | None = None):
        """``shape``: a micro-batch's (tokens, sequence ids), for small first; None: in order."""
        self._compute, self._on_start, self._shape = compute, on_start, shape
        self._queue: deque = deque()  # [item, its shape, times passed over]
        self._ready = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name="stage-worker", daemon=True)
        self.thread.start()
        self.clock = hoststat.thread_clock(self.thread)  # its CPU-time clock, taken while it runs
        #: wall seconds it has spent running micro-batches and calls (written by its thread alone):
        #: differences over time tell how busy the device is
        self.busy_s = 0.0

    def put(self, item: tuple) -> None:
        """Queue a micro-batch: ``compute(*item)`` runs after every queued micro-batch that names
        one of its sequences, and after every call queued before it."""
        self._put([item, self._shape(item) if self._shape else None, 0])

    def call(self, fn: Callable[[], object], timeout_s: float | None = None):
        """Run ``fn`` on the worker thread, between micro-batches, and return its result (or raise
        its error); ``DEADLINE_EXCEEDED`` if it has not run within ``timeout_s``."""
        done = _Call(fn)
        self._put([done, None, 0])
        if not done.event.wait(timeout_s):
            raise StatusError("DEADLINE_EXCEEDED", "the device did not get to the request in time")
        if done.error is not None:
            raise done.error
        return done.result

    def stop(self) -> None:
        self._put([_STOP, None, 0])

    def _put(self, entry: list) -> None:
        with self._ready:
            self._queue.append(entry)
            self._ready.notify()

    def _next(self):
        """The next thing to run (blocks: an idle daemon uses no CPU)."""
        with self._ready:
            while not self._queue:
                self._ready.wait()
            q = self._queue
            pick, named = 0, set()
            if q[0][1] is not None and q[0][2] < MAX_PASSED:
                for i, (_, shape, _) in enumerate(q):
                    if shape is None:  # a call or the stop: nothing after it goes before it
                        break
                    tokens, seqs = shape
                    if tokens < q[pick][1][0] and not (seqs & named):
                        pick = i
                    named |= seqs
            for entry in list(q)[:pick]:
                entry[2] += 1
            item = q[pick][0]
            del q[pick]
            return item

    def _loop(self) -> None:
        if self._on_start:
            self._on_start()
        while True:
            item = self._next()
            if item is _STOP:
                return
            began = time.perf_counter()
            if isinstance(item, _Call):
                item.run()
            else:
                # in a function of its own so that its locals (the stage model, activations) do not
                # outlive the micro-batch: a redeployment must not find the old model still referenced
                try:
                    self._compute(*item)
                except Exception:  # noqa: BLE001 - a bug must not take the worker down with it
                    log.exception("the worker failed a micro-batch")
            self.busy_s += time.perf_counter() - began
            del item
