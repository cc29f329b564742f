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
from typing import Callable

from hpipe.app.serve_metrics import Collector, Metrics
from hpipe.core.cluster import ClusterSpec
from hpipe.core.errors import HpipeError, InputError
from hpipe.core.plan import Plan
from hpipe.core.retry import until_done
from hpipe.model.generate.local import encode_chat
from hpipe.model.generate.sampling import SamplingParams
from hpipe.model.generate.speculate import refused
from runtime.coordinator.deploy import Deployed, deploy
from runtime.coordinator.engine import Engine, Request
from runtime.coordinator.pipeline import Pipeline
from runtime.coordinator.policies import POLICIES
from runtime.coordinator.recovery import GRACE_S
from runtime.coordinator.session import StageFailure

log = logging.getLogger(__name__)

#: the answer budget of a request that names none (``hpipe serve --default-max-tokens``)
DEFAULT_MAX_TOKENS = 1024
#: seconds between attempts to deploy or recover after one failed (a daemon that answers and refuses,
#: a bad model path, fails at once; the recovery's own wait for daemons is its grace)
STOP_JOIN_S = 10.0  # how long stopping waits for each thread to finish its step
RETRY_S = 1.0


class NotReady(HpipeError):
    pass


class Busy(HpipeError):
    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class TooLong(HpipeError):
    pass


class Backend:
    """The deployed plan, its engine on a thread of its own, and what the HTTP side asks of them.

    A pipeline that breaks is recovered by the engine (its requests resume); one that stays
    broken past the grace fails the requests in flight, and this backend goes on recovering in the
    background (``/health`` says so) until the daemons are back, then serves again. A daemon that
    comes back empty while the server is idle (restarted by its supervisor) is redeployed at once.
    An error of the engine itself is fatal: ``/health`` reports it, and ``on_fatal`` ends the process
    so that a supervisor restarts it."""

    def __init__(self, plan: Plan, cluster: ClusterSpec, source, *, policy: str = "gllm", max_queue: int = 256,
                 max_running: int = 256, api_key: str | None = None, model_name: str | None = None,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS, grace_s: float = GRACE_S,
                 on_fatal: Callable[[], None] | None = None, dequantize: bool = False,
                 prefix_cache: float | None = 1.0, speculate: str = "off"):
        if policy not in POLICIES:
            raise InputError(f"unknown policy {policy!r} (choose from {', '.join(POLICIES)})")
        self.plan, self.cluster, self.source, self.policy = plan, cluster, source, policy
        self.deployed: Deployed | None = None
        self.pipe: Pipeline | None = None  # once deployed
        self.tokenizer = source.tokenizer()
        self.eos = frozenset(source.eos_token_ids())
        self.context = plan.model.max_position_embeddings
        self.max_queue, self.max_running, self.api_key = max_queue, max_running, api_key
        self.default_max_tokens, self.grace_s, self.on_fatal = default_max_tokens, grace_s, on_fatal
        self.dequantize = dequantize
        self.prefix_cache = prefix_cache  # the engine's (runtime.coordinator.prefix_cache); None: off
        self.speculate = speculate  # requests that do not say: "ngram" or "off" (runtime.coordinator.speculation)
        #: why requests cannot speculate here (None: they can; hpipe.model.generate.speculate.refused)
        self.speculation_refused = refused(source.gguf is not None and not dequantize,
                                           [d.device for d in cluster.daemons])
        if speculate != "off" and self.speculation_refused:
            raise InputError(self.speculation_refused)
        self.model_name = model_name or plan.model_name
        self.started = int(time.time())
        self.metrics = Metrics()
        self.collector = Collector(self)
        self.engine: Engine | None = None
        self.fatal = ""  # the engine's own error, if it died of one
        self._stop = threading.Event()
        self._wake = threading.Event()  # set with _stop, or when an idle pipeline needs redeploying
        self._state = "loading"
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # --- life cycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Deploy the plan (waiting up to the grace for daemons that are down) and start the
        engine's thread; if the plan cannot be deployed yet, the thread goes on trying."""
        try:
            self._deploy()
        except StageFailure as e:
            if not self._gave_up(e):
                log.error("deploying the plan failed: %s; trying again in the background", e)
                self._state = f"deploying: {e}"
        self.collector.start()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def _deploy(self) -> None:
        # a stage that dies is waited for (the supervisor restarts it) and redeployed; requests in
        # flight resume where the stages can go on from (runtime.coordinator.recovery)
        deployed = deploy(self.plan, self.cluster, grace_s=self.grace_s, max_recoveries=None,
                          dequantize=self.dequantize)
        try:
            engine = deployed.engine(POLICIES[self.policy](), max_running=self.max_running,
                                     prefix_cache=self.prefix_cache, speculate=self.speculate)
        except BaseException:
            deployed.close()
            raise
        self.deployed, self.pipe, self.engine = deployed, deployed.pipe, engine
        self._state = "ok"

    def _gave_up(self, e: StageFailure) -> bool:
        """Whether ``e`` lasts (a daemon answered and refused: a bad model path, too little memory):
        then no retry can mend it, and ``/health`` says so until the server is restarted."""
        if e.lasting and self.engine is None:
            self._state = f"not deployed: {e} (this does not mend by waiting: fix it, then restart hpipe serve)"
            log.error("deploying the plan failed for good: %s", e)
            self._stop.set()
        return e.lasting and self.engine is None

    def _run(self) -> None:
        try:
            if self.engine is None and not self._stop.is_set():  # a daemon down fails at once: tried again
                # every RETRY_S, not spun on
                try:
                    until_done(self._deploy, again=lambda e: isinstance(e, StageFailure) and not e.lasting,
                               stop=self._stop, wait_s=RETRY_S, failed=self._deploying)
                except StageFailure as e:  # a lasting one: /health says so until a restart
                    self._gave_up(e)
                    return
                if self.engine is None:
                    return
            while not self._stop.is_set():
                error = None
                try:
                    self.engine.run(until_idle=False, stop=self._wake)
                except HpipeError as e:
                    error = str(e)
                    log.error("the pipeline failed: %s; recovering in the background", e)
                    self.engine.fail_all(error)
                if self._stop.is_set():
                    return
                self._wake.clear()
                self._recover(error or self.collector.health.why)
        except Exception as e:  # noqa: BLE001 - the engine itself failed: say so, and end the process
            log.exception("the engine failed")
            self.fatal = f"the engine failed: {e!r}"
            self._state = self.fatal
            if self.engine is not None:
                self.engine.fail_all(self.fatal)
            if self.on_fatal is not None:
                self.on_fatal()

    def _deploying(self, e: BaseException) -> None:
        self._state = f"deploying: {e}"

    def _recover(self, error: str) -> None:
        """Until the pipeline works again (or the server stops): wait for the daemons, redeploy,
        and go on on a new session. ``/health`` says what is being waited for meanwhile."""
        self.engine.session.close()
        self._state = f"recovering: {error}"
        last = [error]

        def rebind() -> None:
            self.engine.rebind(self.deployed.recovery(last[0]))

        def failed(e: BaseException) -> None:
            last[0] = str(e)
            self._state = f"recovering: {e}"

        until_done(rebind, again=lambda e: isinstance(e, StageFailure), stop=self._stop, wait_s=RETRY_S, failed=failed)
        if not self._stop.is_set():
            self._state = "ok"
            log.warning("serving again")

    def watch(self) -> None:
        """Called by the collector: an idle pipeline whose daemon came back empty is redeployed now,
        not when the next request finds it broken."""
        engine = self.engine
        if (self._state == "ok" and self.collector.health.of(engine).lost_model and engine is not None
                and not engine.running and not engine.waiting):
            self._wake.set()

    def stop(self, reason: str = "the server is shutting down") -> None:
        """Stop the engine's and the collector's threads (each finishes the step or the poll it is
        in), then fail what is left and close the deployment. The threads are joined, not left to
        the interpreter's exit: one still inside a gRPC or torch call while the process tore down
        aborted it (``terminate called without an active exception``) in 2-3 SIGTERMs of 12."""
        self._stop.set()
        self._wake.set()
        self.collector.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=STOP_JOIN_S)
        self.collector.join(timeout=STOP_JOIN_S)
        if self.engine is not None:
            self.engine.fail_all(reason)
            self.engine.close()
        if self.deployed is not None:
            self.deployed.close()

    chat = True  # the page offers a chat (hpipe run's page does not)

    @property
    def state(self) -> str:
        """"loading", "ok", or what is being waited for ("deploying: ...", "recovering: ...")."""
        return self._state

    def ready(self) -> tuple[bool, str]:
        if self._state != "ok":
            return False, self._state
        health = self.collector.health.of(self.engine)  # a recovery since the round: the daemons answered it
        return health.ok, health.why

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
            raise InputError("the prompt is empty")
        if len(prompt) > self.plan.max_len:
            raise TooLong(f"the prompt has {len(prompt)} tokens; this server's plan takes at most "
                          f"{self.plan.max_len}")
        room = self.context - len(prompt)
        if room < 1 or (max_tokens or 1) > room:
            raise TooLong(f"{len(prompt)} prompt tokens and {max_tokens} new ones exceed the model's context of "
                          f"{self.context} tokens")
        if body.speculate == "ngram" and self.speculation_refused:
            raise InputError(f"this server cannot speculate: {self.speculation_refused}")
        engine = self.engine
        with self._lock:
            if len(engine.waiting) >= self.max_queue:
                raise Busy(f"{len(engine.waiting)} requests are waiting already; try again shortly", retry_after=1)
            params = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=max(0, body.top_k),
                                    seed=body.seed, frequency_penalty=body.frequency_penalty,
                                    presence_penalty=body.presence_penalty)

            def done(r: Request) -> None:
                self.metrics.finished.labels(r.stop_reason).inc()
                self.metrics.prompt_tokens.inc(len(r.prompt))
                self.metrics.cached_tokens.inc(r.cached_tokens)
                self.metrics.generated.inc(len(r.tokens))
                if r.first_token_s is not None:
                    self.metrics.ttft.observe(r.first_token_s - r.arrival_s)
                    if len(r.tokens) > 1:
                        self.metrics.tpot.observe((r.done_s - r.first_token_s) / (len(r.tokens) - 1))
                on_done(r)

            request = Request(prompt, max_tokens or min(self.default_max_tokens, room), params=params,
                              eos=frozenset() if body.ignore_eos else self.eos,
                              slicer=self.plan.slicer(), on_token=on_token, on_done=done,
                              logprobs=top_logprobs, speculate=body.speculate)
            return engine.add(request)

    def finish(self, r: Request, reason: str) -> None:
        if not r.finished and self.engine is not None:
            self.engine.finish(r, reason)
