"""``hpipe run --serve-page PORT``: the cluster page of ``hpipe serve`` (:mod:`hpipe.app.page`) for a
job, so a long one can be watched: its daemons, the plan, busy fractions, KV, documents in flight,
tokens/s, recoveries and Seesaw's phase. No chat (the job owns the pipeline).

The page binds loopback only: the job's cluster is not anyone's to read. To watch from another
machine, forward the port (``ssh -L PORT:127.0.0.1:PORT host``).
"""

from __future__ import annotations

import logging
import sys
import threading
import time

from fastapi import FastAPI

from hpipe.app.page import add_page
from hpipe.app.serve_metrics import Collector, Metrics
from hpipe.core.errors import InputError
from hpipe.core.plan import Plan

log = logging.getLogger(__name__)

#: how long stopping waits for the page's server thread
STOP_S = 5.0


class JobWatch:
    """What the collector watches for a job: its plan, and its pipeline and engine once deployed."""

    chat = False

    def __init__(self, plan: Plan):
        self.plan = plan
        self.pipe = self.engine = None
        self.metrics = Metrics()
        self.state = "deploying"
        self.collector = Collector(self)

    def deployed(self, deployed, engine) -> None:
        """The job's pipeline is up (``run_job``'s ``on_engine``)."""
        self.pipe, self.engine, self.state = deployed.pipe, engine, "ok"

    def ready(self) -> tuple[bool, str]:
        return self.state == "ok", "" if self.state == "ok" else self.state

    def watch(self) -> None:  # a job recovers by itself (runtime.coordinator.recovery)
        pass


class PageServer:
    """The page of ``watch`` on ``127.0.0.1:port``, on a thread of its own (uvicorn)."""

    def __init__(self, watch: JobWatch, port: int):
        import uvicorn

        self.watch = watch
        app = FastAPI(title="hpipe run", docs_url=None, redoc_url=None, openapi_url=None)
        add_page(app, watch.collector.live.body, lambda path, status: None)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.address = f"http://127.0.0.1:{port}/"
        self._thread = threading.Thread(target=self.server.run, name="page", daemon=True)

    def start(self, within_s: float = 10.0) -> None:
        self.watch.collector.start()
        self._thread.start()
        deadline = time.monotonic() + within_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise OSError(f"the page could not listen on {self.address} (is the port taken?)")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.watch.collector.stop()
        self._thread.join(STOP_S)
        self.watch.collector.join(STOP_S)


def start_page(plan: Plan, port: int) -> PageServer:
    """``--serve-page``: the job's page, started, its address said."""
    page = PageServer(JobWatch(plan), port)
    try:
        page.start()
    except OSError as e:
        raise InputError(f"--serve-page {port}: {e}") from None
    print(f"hpipe: watch the job at {page.address}", file=sys.stderr)
    return page
