"""What ``hpipe serve`` knows of its daemons and reports: Prometheus metrics and daemon health,
gathered by one background thread so that no HTTP request waits on a daemon.

Every ``every_s`` the collector asks each daemon of the pipeline for its ``Status`` (a stopped or
unreachable daemon costs this thread its timeout, never the event loop), keeps whether each
answered and still holds the model, and copies the KV pools and the engine's queue into the
gauges. ``/health`` and ``/metrics`` read what it last saw.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hpipe.app.live import Live
from runtime.wire.messages import pb

log = logging.getLogger(__name__)

#: how often the collector asks every daemon how it is (seconds)
HEALTH_EVERY_S = 1.0
#: how long one daemon may take to answer before it counts as not responding
STATUS_TIMEOUT_S = 2.0


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("hpipe_http_requests", "HTTP requests by path and status", ["path", "status"],
                                registry=r)
        self.prompt_tokens = Counter("hpipe_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("hpipe_prompt_tokens_cached", "prompt tokens of finished requests read from "
                                     "the prefix cache, not prefilled", registry=r)
        self.generated = Counter("hpipe_generated_tokens", "tokens generated", registry=r)
        self.finished = Counter("hpipe_requests_finished", "requests ended, by reason", ["reason"], registry=r)
        buckets = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
        self.ttft = Histogram("hpipe_time_to_first_token_seconds", "time to first token", buckets=buckets, registry=r)
        self.tpot = Histogram("hpipe_time_per_output_token_seconds", "time per output token after the first",
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4), registry=r)
        self.kv_used = Gauge("hpipe_kv_blocks_used", "KV blocks in use per stage", ["stage"], registry=r)
        self.kv_total = Gauge("hpipe_kv_blocks", "KV blocks per stage", ["stage"], registry=r)
        # the prefix cache as each stage reports it (its counts since the daemon started)
        self.cache_blocks = Gauge("hpipe_prefix_cache_blocks", "KV blocks kept by the prefix cache per stage",
                                  ["stage"], registry=r)
        self.cache_hits = Gauge("hpipe_prefix_cache_hits", "sequences that began with cached blocks per stage",
                                ["stage"], registry=r)
        self.cache_tokens = Gauge("hpipe_prefix_cache_cached_tokens", "positions read from cached blocks per stage",
                                  ["stage"], registry=r)
        self.cache_evictions = Gauge("hpipe_prefix_cache_evictions", "cached blocks evicted per stage", ["stage"],
                                     registry=r)
        self.queue = Gauge("hpipe_queue_length", "requests waiting to start", registry=r)
        self.running = Gauge("hpipe_requests_running", "requests running", registry=r)
        self.preemptions = Gauge("hpipe_preemptions", "requests preempted for KV memory so far", registry=r)
        self.guesses = Gauge("hpipe_speculative_guesses", "tokens guessed by speculative decoding so far", registry=r)
        self.guesses_kept = Gauge("hpipe_speculative_guesses_kept", "guessed tokens the model agreed to so far",
                                  registry=r)
        self.daemons_up = Gauge("hpipe_daemons_up", "daemons of the pipeline that answer and hold the model",
                                registry=r)


@dataclass(frozen=True)
class Health:
    """What the collector last saw: whether every daemon answered and holds the model."""

    ok: bool = True
    why: str = ""
    lost_model: bool = False  # a daemon answers but holds no model (restarted): only a redeploy helps
    #: the engine's session when the round began (None: before the deployment, or set by hand); a
    #: recovery or a layout switch since then binds a new one, after reaching every daemon, so
    #: what this round saw no longer says how the pipeline is (see :meth:`Health.of`)
    session: object = None

    def of(self, engine) -> "Health":
        """This health, or a healthy one if it was seen before ``engine``'s pipeline was rebuilt."""
        if self.session is not None and engine is not None and engine.session is not self.session:
            return Health()
        return self


class Collector:
    """The background thread that watches the daemons of ``backend``'s pipeline.

    ``backend``: ``hpipe serve``'s :class:`hpipe.app.serve_backend.Backend`, or anything with its
    ``plan``, ``pipe``, ``engine``, ``metrics``, ``state``, ``chat``, ``ready()`` and ``watch()``
    (``hpipe run --serve-page``'s :class:`hpipe.app.page_job.JobWatch`)."""

    def __init__(self, backend, every_s: float = HEALTH_EVERY_S):
        self.backend, self.every_s = backend, every_s
        self.live = Live(backend.plan, every_s)  # what the page shows (hpipe.app.live)
        self.health = Health()
        self.lock = threading.Lock()  # held for a whole round: who takes it sees no round half done
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="serve-collector", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float) -> None:
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                with self.lock:
                    self.collect()
            except Exception:  # noqa: BLE001 - the collector must outlive any one bad round
                log.exception("collecting the daemons' status failed")

    def collect(self) -> None:
        b, m = self.backend, self.backend.metrics
        engine = b.engine
        if engine is not None:
            m.queue.set(len(engine.waiting))
            m.running.set(len(engine.running))
            m.preemptions.set(engine.preemptions)
            m.guesses.set(engine.drafted)
            m.guesses_kept.set(engine.kept)
        session = engine.session if engine is not None else None
        pipe = b.pipe
        if pipe is None:  # not deployed yet: the state says why
            self._round(engine, "")
            return
        ok, why, lost, up = True, "", False, 0
        for d, client in zip(list(pipe.daemons), list(pipe.clients)):
            try:
                st = client.call("Status", pb.StatusRequest(), timeout=STATUS_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - any failure: that daemon is down for us
                ok, why = False, why or f"daemon {d.name} ({d.address}) is not responding"
                self.live.daemon(d.name, d.address, why="not responding")
                continue
            if not st.loaded or st.model != b.plan.model_name:
                ok, lost = False, True
                why = why or f"daemon {d.name} ({d.address}) does not hold the model (restarted?)"
                self.live.daemon(d.name, d.address, st, why="does not hold the model")
                continue
            self.live.daemon(d.name, d.address, st)
            up += 1
            for p in st.pools:
                stage = str(p.stage)
                m.kv_used.labels(stage).set(p.used_blocks)
                m.kv_total.labels(stage).set(p.blocks)
                m.cache_blocks.labels(stage).set(p.cached_blocks)
                m.cache_hits.labels(stage).set(p.prefix_hits)
                m.cache_tokens.labels(stage).set(p.cached_tokens)
                m.cache_evictions.labels(stage).set(p.evictions)
        m.daemons_up.set(up)
        self.health = Health(ok, why, lost, session)
        self._round(engine, why)
        b.watch()

    def _round(self, engine, why: str) -> None:
        m = self.backend.metrics
        value = m.registry.get_sample_value
        totals = {"generated": engine.tokens_out if engine is not None else 0,  # as they come, not as requests end
                  "prompt": value("hpipe_prompt_tokens_total") or 0,
                  "cached": value("hpipe_prompt_tokens_cached_total") or 0,
                  "recoveries": engine.recoveries if engine is not None else 0,
                  "preemptions": engine.preemptions if engine is not None else 0,
                  "guesses": engine.drafted if engine is not None else 0,
                  "guesses_kept": engine.kept if engine is not None else 0}
        self.live.round(state=self.backend.state, health=why,
                        waiting=len(engine.waiting) if engine is not None else 0,
                        running=len(engine.running) if engine is not None else 0,
                        tokens=engine.tokens_out if engine is not None else 0, totals=totals,
                        phase=getattr(engine.policy, "phase", None) if engine is not None else None,
                        chat=self.backend.chat)
