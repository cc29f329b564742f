"""Continuous batching on a pipeline: many requests, one stream of micro-batches.

Design note. The engine keeps up to ``depth`` micro-batches in flight (one per stage of the
pipeline, an interleaved chain counting all its stages), so every stage has work. Each micro-batch
is formed by a policy (:mod:`runtime.coordinator.policies`) from the requests: a decode token of requests whose
last token has been sampled, and prefill chunks of requests still reading their prompt, cut at
the plan's slices. A request's next decode token is scheduled only after its previous one is
sampled (token-safe); its prompt's chunks may be in flight together, which is HPipe's pipelined
slicing: a single long prompt with nothing else to do is sent slice after slice. Results come
back as the logits of the rows that need a token, and the whole micro-batch is sampled in one
pass on this CPU (:func:`hpipe.model.generate.sampling.sample`) while the stages compute the next ones.

KV memory. The engine mirrors every stage's KV pool (:mod:`runtime.coordinator.kv_room`), so it
knows the free blocks of the tightest stage without asking. Before a micro-batch goes out, the
blocks it needs are found or made: requests not in flight are preempted, newest first
(:mod:`runtime.coordinator.preemption`). A preempted request's KV moves to the daemons' host
tier while the tier has room for it (:mod:`runtime.daemon.kv_tier`, mirrored here like the
pools; counted in ``swaps``) and comes back when it runs again; otherwise (or with ``swap`` off)
it gives its blocks back and later recomputes its prompt and the tokens it has generated (with
its sampler's state kept, so its tokens are the same; counted in ``recomputed`` positions). Both
count in ``preemptions``. A daemon that still refuses a sequence for want of blocks (another
session filled its pool) has that request recomputed, never failed.

The prefix cache (:mod:`runtime.coordinator.prefix_cache`) decides a request's hit as it is
admitted; idle cached blocks are evicted for room before any request is preempted. An engine that
holds requests yet sends nothing ends them one at a time with an error (:mod:`runtime.coordinator.stall`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from hpipe.model.generate.sampling import SampleError, logprobs, sample
from runtime.coordinator.kv_room import KVRoom
from runtime.coordinator.preemption import Preempting
from runtime.coordinator.rebind import Rebinding
from runtime.coordinator.request import Request
from runtime.coordinator.session import Session, StageFailure
from runtime.coordinator.speculation import Speculating
from runtime.coordinator.stall import StallGuard
from runtime.wire.logits import TOP_LOGITS
from runtime.wire.messages import pb

log = logging.getLogger(__name__)

#: seconds between the engine's keep-alives of its running requests (a daemon frees a sequence
#: unnamed for 300 s)
KEEPALIVE_S = 30.0


@dataclass
class Planned:
    """One entry of a micro-batch being formed: ``length`` tokens of ``request``; ``sampled`` is
    set when it is sent: whether it ends the request's prefill or is a decode token."""
    request: Request
    length: int
    sampled: bool = False
    keep: list[int] | None = None  # the cached blocks it fills, once sent
    seq_id: int = 0                # its request's sequence when sent
    drafts: list[int] = field(default_factory=list)  # guesses after its last token (runtime.coordinator.speculation)
    start: int = 0                 # its first position, once sent


@dataclass
class Sent:
    """A micro-batch in flight: its entries, and when it left."""
    planned: list[Planned]
    sent_s: float
    prefill: int
    decode: int


class Engine(Preempting, Rebinding, Speculating):
    """Runs :class:`Request` s on a session, ``depth`` micro-batches in flight, formed by ``policy``."""

    def __init__(self, session: Session, policy, depth: int, max_running: int = 64,
                 recover: Callable[[str, Session], Session] | None = None, prefix_cache: float | None = None,
                 swap: bool = True, top_logits: bool = True, speculate: str = "off"):
        """``prefix_cache``: keep a prefix cache, with room for this share of the tightest stage's
        pool in blocks nobody holds (None: no cache); ``swap``: preempt into the host tier;
        ``top_logits``: a request that needs only its row's largest logits gets only those from the
        last stage (runtime/wire/logits.py), not the whole row."""
        self.session, self.policy, self.depth, self.max_running = session, policy, max(1, depth), max_running
        self.top_logits, self.speculate = top_logits, speculate
        #: when the pipeline breaks: (error, the broken session's id) -> a new session on a working
        #: pipeline that took over its sequences where it could, or StageFailure (runtime.coordinator.recovery)
        self.recover = recover
        self.recoveries = 0
        self.resumes: list[dict] = []  # per recovery: requests resumed, positions kept and replayed, restarted
        #: each session a recovery or a layout switch ended: its stages' daemons, seconds, statistics
        self.ended: list[dict] = []
        self._bound_s, self._switching_s = time.monotonic(), None  # when bound to the session, when a switch began
        self.lanes = max(1, session.pipe.lanes)  # independent decode lanes in the pipeline
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._in_flight: dict[int, Sent] = {}
        self._lock = threading.RLock()
        self._arrived = threading.Condition(self._lock)
        self._admissions = 0
        pools = session.pipe.pools()
        self.room = KVRoom(min((p.blocks for p in pools), default=0), pools[0].block_size if pools else 16,
                           prefix_cache, salt=f"{session.pipe.model}|{session.pipe.dtype}")
        self.cache = self.room.cache
        self.swap, self.tier = swap, min((p.tier_blocks for p in pools), default=0)  # the host tier's blocks
        self.tier_used = 0
        self.micro_batches = 0
        self.tokens_out = 0  # tokens given to requests so far (a count for watchers: the page's tokens/s)
        self.preemptions = self.swaps = self.recomputed = 0
        self._checked = time.monotonic()
        self._stall = StallGuard()
        self.log: list[dict] = []  # per micro-batch: when it left and came back, prefill and decode tokens

    # --- requests -----------------------------------------------------------------------------
    def add(self, request: Request) -> Request:
        with self._arrived:
            self.waiting.append(request)
            self._arrived.notify_all()
        return request

    def admit(self, r: Request) -> bool:
        """Move ``r`` from waiting to running (for a policy); False if it cannot run now."""
        if len(self.running) >= self.max_running:
            return False
        if self.room.blocks and self.room.of(r.max_len) > self.room.blocks:
            self._finish(r, "error", f"RESOURCE_EXHAUSTED: {r.max_len} positions need {self.room.of(r.max_len)} "
                                     f"KV blocks; the tightest stage's pool has {self.room.blocks}")
            return False
        if r.swapped and self.room.blocks and self.running:  # back from the host tier with room for it and a
            # block more (alone, it has the pools: the most it ever held)
            free = self.room.blocks - self.room.used(self.running) + (self.cache.idle if self.cache is not None else 0)
            if free < r.swapped + 1:
                return False
        if self.cache is not None and not r.swapped:  # a swapped request goes on in its own sequence
            admitted, evicted = self.cache.admit(r)
            self.session.evict(evicted)
            if not admitted:
                return False
        self.waiting.remove(r)
        self._admissions += 1
        r.admitted, r.admitted_s = self._admissions, time.monotonic()
        self.running.append(r)
        return True

    def finish(self, r: Request, reason: str, error: str = "") -> None:
        """End ``r`` now (a stop string matched, the client went away, ...) and free its sequence."""
        with self._lock:
            self._finish(r, reason, error)

    def fail_all(self, error: str) -> None:
        """The pipeline broke: every request not done ends with ``error``."""
        with self._lock:
            for r in list(self.running) + list(self.waiting):
                self._finish(r, "error", error)
            self._in_flight.clear()

    def _let_go(self, r: Request) -> None:
        if self.cache is not None:
            self.session.evict(self.cache.let_go(r))

    # --- the loop -----------------------------------------------------------------------------
    def run(self, until_idle: bool = True, stop: threading.Event | None = None) -> None:
        """Schedule and collect until every request added is done (``until_idle``), or ``stop`` is
        set. A broken pipeline is :class:`StageFailure`, unless ``recover`` brings it back."""
        while True:
            try:
                return self._run(until_idle, stop)
            except StageFailure as e:
                if self.recover is None:
                    raise
                self._recover(str(e))

    def _run(self, until_idle: bool, stop: threading.Event | None) -> None:
        while not (stop and stop.is_set()):
            with self._arrived:
                if not self.running and not self.waiting and not self._in_flight:
                    if until_idle:
                        return
                    self._arrived.wait(0.1)
                    continue
            if time.monotonic() - self._checked > KEEPALIVE_S:
                # results may flow for hours without the session polling the daemons: name every
                # running request to them now and then, so no stage's idle timeout frees one that waits
                self.session.check([r.seq_id for r in self.running])
                self._checked = time.monotonic()
            while len(self._in_flight) < self.depth and self._send_one():
                pass
            switch = getattr(self.policy, "switch", None)  # a policy with phases (runtime.coordinator.seesaw)
            if not self._in_flight and switch is not None and switch(self):
                continue
            if self._in_flight:
                self._collect()
            else:
                with self._arrived:  # nothing could be sent (waiting on arrivals, or memory)
                    stuck = self._stall.idle(self)
                    if stuck is not None:
                        self._finish(stuck, "error", self._stall.error(self))
                    self._arrived.wait(0.01)

    def _send_one(self) -> bool:
        with self._lock:
            formed = self.policy.form(self)
            self._draft(formed)
            planned = self._make_room(formed)
            if not planned:
                return False
            entries, tokens = [], []
            prefill = decode = 0
            for p in planned:
                r = p.request
                self._unswap(r)  # the daemons bring its KV back as they lay this entry out
                start = r.laid_out
                first = start == r.begins_at
                p.sampled = not r.prefilling or start + p.length == len(r.prefix)
                p.seq_id = r.seq_id
                if r.prefilling:
                    tokens += r.prefix[start:start + p.length]
                    prefill += p.length
                    p.keep = self.cache.keep(r, start, start + p.length) if r.claimed else None
                else:
                    tokens += [r.tokens[-1], *p.drafts]
                    decode += p.length
                p.start = start
                logits = (self._draft_logits(r) if p.drafts else self._logits(r)) if p.sampled else pb.NO_LOGITS
                entries.append(pb.Entry(sequence_id=r.seq_id, start=start, length=p.length, logits=logits,
                                        max_len=r.max_len if first else 0, cached=r.hit if first else (),
                                        keep=p.keep or (),
                                        # guesses are decode rows: computed as one-at-a-time decoding computes them
                                        prefill_end=len(r.prompt) if r.prefilling else start if p.drafts else 0))
                r.laid_out += p.length
                r.in_flight += 1
        mb = self.session.submit(entries, torch.tensor(tokens, dtype=torch.long))
        self._in_flight[mb] = Sent(planned, time.monotonic(), prefill, decode)
        self.micro_batches += 1
        return True

    @property
    def decode_batches(self) -> int:
        """Micro-batches in flight of decode tokens only (a policy's to bound by the decode lanes;
        decode tokens riding with prefill chunks wait for those, wherever they are)."""
        return sum(1 for sent in self._in_flight.values() if sent.decode and not sent.prefill)

    def _logits(self, r: Request) -> int:
        """What ``r``'s sampled row needs from the last stage: its top logits where they draw what
        the whole row does (no log-probabilities asked for), else the whole row."""
        top = self.top_logits and r.logprobs is None and r.sampler.params.needs_only_top(TOP_LOGITS)
        return pb.LAST_TOP if top else pb.LAST_LOGITS

    def _collect(self) -> None:
        watch = [r.seq_id for r in self.running]
        result = self.session.wait_any(list(self._in_flight), watch)
        now = time.monotonic()
        with self._lock:
            sent = self._in_flight.pop(result.micro_batch)
            self.log.append({"sent_s": sent.sent_s, "back_s": now, "prefill": sent.prefill, "decode": sent.decode})
            rows, samplers, owners, verifications = [], [], [], []
            row = 0
            for p in sent.planned:
                r = p.request
                r.in_flight -= 1
                failed = result.failed.get(r.seq_id)
                if p.keep and failed is None and r.seq_id == p.seq_id and not r.finished:
                    self.cache.filled(p.keep)  # every stage computed them: later requests may begin with them
                    r.filled += len(p.keep)
                if p.sampled and p.drafts:  # every row of a speculative entry: verified below
                    if failed is None and not r.finished and r in self.running:
                        verifications.append((p, list(range(row, row + p.length))))
                    row += p.length
                elif p.sampled:
                    if failed is None and not r.finished and r in self.running:
                        rows.append(row)
                        samplers.append(r.sampler)
                        owners.append(r)
                        if r.drafter is not None and not r.prefilling:
                            r.drafter.timed(0, now - sent.sent_s)  # a plain step's round trip
                    row += 1
                if failed is not None and not r.finished and r in self.running:
                    self._refused(r, *failed)
            if rows:
                logits = result.logits[rows]
                # a row's largest logit is finite unless a NaN or an inf came through (a NaN or +inf is
                # the largest; a row of -inf has none finite): one reduction, not a check per element.
                # Not the sum: a row sent as its top logits (runtime/wire/logits.py) is -inf past them
                finite = torch.isfinite(logits.amax(dim=-1)).tolist()
                if not all(finite):  # NaN or inf hidden states upstream: say so, do not sample noise
                    for r, ok in zip(owners, finite):
                        if not ok:
                            self._finish(r, "error", "the model produced non-finite logits (NaN or inf) for this "
                                                     "sequence: a stage's weights or activations overflowed")
                    keep = [i for i, ok in enumerate(finite) if ok]
                    logits, samplers, owners = logits[keep], [samplers[i] for i in keep], [owners[i] for i in keep]
                for i, (r, token) in enumerate(zip(owners, self._sample(owners, samplers, logits))):
                    if token is None:
                        continue
                    if r.logprobs is not None:
                        r.token_logprobs.append(logprobs(logits[i], token, r.logprobs))
                    self._take(r, token, now)
            for p, at in verifications:
                p.request.drafter.timed(len(p.drafts), now - sent.sent_s)
                self._take_verified(p, result.logits[at], now)

    def _sample(self, owners: list[Request], samplers: list, logits: torch.Tensor) -> list[int | None]:
        """Each row's token, or None for a request whose row could not be sampled: that request
        ends with the error, and the others go on (a bad parameter is one request's problem)."""
        try:
            return sample(samplers, logits)
        except SampleError as e:
            tokens: list[int | None] = list(e.tokens)
            for i, why in e.failed.items():
                tokens[i] = None
                self._finish(owners[i], "error", f"sampling failed for this request: {why}")
            return tokens
        except Exception as e:  # noqa: BLE001 - a bug in sampling must not take the engine down
            log.exception("sampling a micro-batch failed")
            for r in owners:
                self._finish(r, "error", f"internal error while sampling: {e!r}")
            return [None] * len(owners)

    def _take(self, r: Request, token: int, now: float) -> None:
        if r.first_token_s is None:
            r.first_token_s = now
        r.tokens.append(token)
        self.tokens_out += 1
        if r.on_token is not None:
            try:
                r.on_token(r, token)
            except Exception as e:  # noqa: BLE001 - a caller's callback fails its own request only
                log.exception("request %d: on_token failed", r.id)
                self._finish(r, "error", f"internal error: {e!r}")
                return
        if token in r.eos:
            self._finish(r, "eos")
        elif len(r.tokens) >= r.max_new_tokens:
            self._finish(r, "length")

    def _finish(self, r: Request, reason: str, error: str = "") -> None:
        if r.finished:
            return
        self._unswap(r)
        r.stop_reason, r.error, r.done_s = reason, error, time.monotonic()
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        if r.laid_out:
            self.session.close_sequences([r.seq_id])
        self._let_go(r)
        r.done.set()
        if r.on_done is not None:
            try:
                r.on_done(r)
            except Exception:  # noqa: BLE001 - a caller's callback must not stop the engine
                log.exception("request %d: on_done failed", r.id)

