"""A daemon's device worker: one thread that runs every micro-batch and every device call in
order, so model work never overlaps and an idle daemon uses no CPU.

Micro-batches are handed to ``compute``; functions queued with :meth:`Worker.call` (loads,
profiling, a session's take-over) run between them, on the same thread and under the same limits.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

from hpipe.core.errors import StatusError

log = logging.getLogger(__name__)

_STOP = object()


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
    def __init__(self, compute: Callable[..., None], on_start: Callable[[], None] | None = None):
        self._compute, self._on_start = compute, on_start
        self._queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="stage-worker", daemon=True)
        self.thread.start()

    def put(self, item: tuple) -> None:
        """Queue a micro-batch: ``compute(*item)`` runs after everything queued before it."""
        self._queue.put(item)

    def call(self, fn: Callable[[], object], timeout_s: float | None = None):
        """Run ``fn`` on the worker thread, between micro-batches, and return its result (or raise
        its error); ``DEADLINE_EXCEEDED`` if it has not run within ``timeout_s``."""
        done = _Call(fn)
        self._queue.put(done)
        if not done.event.wait(timeout_s):
            raise StatusError("DEADLINE_EXCEEDED", "the device did not get to the request in time")
        if done.error is not None:
            raise done.error
        return done.result

    def stop(self) -> None:
        self._queue.put(_STOP)

    def _loop(self) -> None:
        if self._on_start:
            self._on_start()
        while True:
            item = self._queue.get()  # blocks: an idle daemon uses no CPU
            if item is _STOP:
                return
            if isinstance(item, _Call):
                item.run()
            else:
                # in a function of its own so that its locals (the stage model, activations) do not
                # outlive the micro-batch: a redeployment must not find the old model still referenced
                try:
                    self._compute(*item)
                except Exception:  # noqa: BLE001 - a bug must not take the worker down with it
                    log.exception("the worker failed a micro-batch")
            del item
