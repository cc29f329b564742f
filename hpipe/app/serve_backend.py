"""What ``hpipe serve`` runs behind its HTTP API: the deployed pipeline, one engine on a thread of
its own, admission (a bounded queue, length limits), the tokenizer, and the metrics.

The engine is the one ``hpipe run`` uses (:mod:`runtime.coordinator.engine`), so the server batches many
users' requests into the same micro-batches and a long document's prompt is prefilled in the
plan's slices; its first token streams as soon as that prefill ends.
"""

from __future__ import annotations

import logging
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hpipe.core.cluster import ClusterSpec
from hpipe.core.errors import HpipeError, InputError
from hpipe.core.plan import Plan
from hpipe.model.generate import encode_chat
from hpipe.model.sampling import SamplingParams
from runtime.coordinator.deploy import Deployed, deploy
from runtime.coordinator.engine import Engine, Request
from runtime.coordinator.pipeline import Pipeline
from runtime.coordinator.policies import POLICIES
from runtime.wire.messages import pb

log = logging.getLogger(__name__)

#: how often /health asks every daemon whether it is up (seconds)
HEALTH_EVERY_S = 1.0


class NotReady(HpipeError):
    pass


class Busy(HpipeError):
    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class TooLong(HpipeError):
    pass


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("hpipe_http_requests", "HTTP requests by path and status", ["path", "status"],
                                registry=r)
        self.prompt_tokens = Counter("hpipe_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generated = Counter("hpipe_generated_tokens", "tokens generated", registry=r)
        self.finished = Counter("hpipe_requests_finished", "requests ended, by reason", ["reason"], registry=r)
        buckets = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
        self.ttft = Histogram("hpipe_time_to_first_token_seconds", "time to first token", buckets=buckets, registry=r)
        self.tpot = Histogram("hpipe_time_per_output_token_seconds", "time per output token after the first",
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4), registry=r)
        self.kv_used = Gauge("hpipe_kv_blocks_used", "KV blocks in use per stage", ["stage"], registry=r)
        self.kv_total = Gauge("hpipe_kv_blocks", "KV blocks per stage", ["stage"], registry=r)
        self.queue = Gauge("hpipe_queue_length", "requests waiting to start", registry=r)
        self.running = Gauge("hpipe_requests_running", "requests running", registry=r)
        self.preemptions = Gauge("hpipe_preemptions", "requests preempted for KV memory so far", registry=r)

    def refresh(self, backend: "Backend") -> None:
        engine = backend.engine
        if engine is not None:
            self.queue.set(len(engine.waiting))
            self.running.set(len(engine.running))
            self.preemptions.set(engine.preemptions)
        try:
            for p in backend.pipe.pools():
                self.kv_used.labels(str(p.stage)).set(p.used_blocks)
                self.kv_total.labels(str(p.stage)).set(p.blocks)
        except Exception:  # noqa: BLE001 - a daemon down: /health says so; metrics keep the last values
            pass


class Backend:
    def __init__(self, plan: Plan, cluster: ClusterSpec, source, *, policy: str = "gllm", max_queue: int = 256,
                 api_key: str | None = None, model_name: str | None = None):
        if policy not in POLICIES:
            raise InputError(f"unknown policy {policy!r} (choose from {', '.join(POLICIES)})")
        self.plan, self.cluster, self.source, self.policy = plan, cluster, source, policy
        self.deployed: Deployed | None = None
        self.pipe: Pipeline | None = None  # once started
        self.tokenizer = source.tokenizer()
        self.eos = frozenset(source.eos_token_ids())
        self.context = plan.model.max_position_embeddings
        self.max_queue, self.api_key = max_queue, api_key
        self.model_name = model_name or plan.model_name
        self.started = int(time.time())
        self.metrics = Metrics()
        self.engine: Engine | None = None
        self._stop = threading.Event()
        self._state = "loading"
        self._health = (0.0, True, "")
        self._lock = threading.Lock()

    # --- life cycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Deploy the plan and start the engine's thread (returns once serving)."""
        # a stage that dies is waited for (the supervisor restarts it) and redeployed; requests
        # in flight resume where the stages can go on from, and their streams go on (runtime.coordinator.recovery)
        self.deployed = deploy(self.plan, self.cluster)
        self.pipe = self.deployed.pipe
        self.engine = Engine(self.deployed.session(), POLICIES[self.policy](), depth=len(self.pipe.stages),
                             max_running=self.max_queue, recover=self.deployed.recovery)
        threading.Thread(target=self._run, name="engine", daemon=True).start()
        self._state = "ok"

    def _run(self) -> None:
        try:
            self.engine.run(until_idle=False, stop=self._stop)
        except HpipeError as e:
            log.error("the pipeline failed: %s", e)
            self._state = f"pipeline failed: {e}"
            self.engine.fail_all(str(e))

    def stop(self) -> None:
        self._stop.set()
        if self.engine is not None:
            self.engine.session.close()
        if self.deployed is not None:
            self.deployed.close()

    def ready(self) -> tuple[bool, str]:
        if self._state != "ok":
            return False, self._state
        at, ok, why = self._health
        if time.monotonic() - at > HEALTH_EVERY_S:
            ok, why = True, ""
            for d, client in zip(self.pipe.daemons, self.pipe.clients):
                try:
                    client.call("Status", pb.StatusRequest(), timeout=2.0)
                except Exception:  # noqa: BLE001 - any failure: that daemon is down for us
                    ok, why = False, f"daemon {d.name} ({d.address}) is not responding"
                    break
            self._health = (time.monotonic(), ok, why)
        return ok, why

    # --- requests -------------------------------------------------------------------------
    def chat_prompt(self, messages: list[dict]) -> list[int]:
        return encode_chat(self.tokenizer, messages)

    def text_prompt(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def submit(self, prompt: list[int], max_tokens: int | None, body, top_logprobs: int | None, *, on_token,
               on_done) -> Request:
        ready, why = self.ready()
        if not ready:
            raise NotReady(f"not ready: {why}")
        if not prompt:
            raise TooLong("the prompt is empty")
        if len(prompt) > self.plan.max_len:
            raise TooLong(f"the prompt has {len(prompt)} tokens; this server's plan takes at most "
                          f"{self.plan.max_len}")
        room = self.context - len(prompt)
        if room < 1 or (max_tokens or 1) > room:
            raise TooLong(f"{len(prompt)} prompt tokens and {max_tokens} new ones exceed the model's context of "
                          f"{self.context} tokens")
        engine = self.engine
        with self._lock:
            if len(engine.waiting) >= self.max_queue:
                raise Busy(f"{len(engine.waiting)} requests are waiting already; try again shortly", retry_after=1)
            params = SamplingParams(temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                                    frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty)

            def done(r: Request) -> None:
                self.metrics.finished.labels(r.stop_reason).inc()
                self.metrics.prompt_tokens.inc(len(r.prompt))
                self.metrics.generated.inc(len(r.tokens))
                if r.first_token_s is not None:
                    self.metrics.ttft.observe(r.first_token_s - r.arrival_s)
                    if len(r.tokens) > 1:
                        self.metrics.tpot.observe((r.done_s - r.first_token_s) / (len(r.tokens) - 1))
                on_done(r)

            request = Request(prompt, max_tokens or room, params=params,
                              eos=frozenset() if body.ignore_eos else self.eos,
                              slicer=self.plan.slicer(), on_token=on_token, on_done=done,
                              logprobs=top_logprobs)
            return engine.add(request)

    def finish(self, r: Request, reason: str) -> None:
        if not r.finished and self.engine is not None:
            self.engine.finish(r, reason)
