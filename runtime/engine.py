"""Continuous batching on a pipeline: many requests, one stream of micro-batches.

Design note. The engine keeps up to ``depth`` micro-batches in flight (one per stage of the
pipeline, an interleaved chain counting all its stages), so every stage has work. Each micro-batch
is formed by the policy (:mod:`runtime.policies`) from the running requests: a decode token of
each request whose last token has been sampled, and prefill chunks of requests still reading
their prompt, in the plan's slices. A request's next decode token is scheduled only after its
previous one is sampled (token-safe); its prompt's chunks may be in flight together, which is
HPipe's pipelined slicing: a single long prompt with nothing else to do is sent slice after slice.
Results come back as the logits of the rows that need a token, and the whole micro-batch is
sampled in one pass on this CPU (:func:`hpipe.model.sampling.sample`), while the stages already
compute the next micro-batches.

A request fails alone: a sequence a daemon could not hold (out of KV blocks) comes back in the
result's failures, and only its request ends, with that error.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from hpipe.model.sampling import Sampler, SamplingParams, sample
from runtime.session import Session
from runtime.wire import pb

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Request:
    """One prompt to continue, and its state as the engine runs it."""

    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams = SamplingParams()
    eos: frozenset[int] = frozenset()
    slices: list[int] | None = None           # prefill chunks (default: the whole prompt at once)
    on_token: Callable[["Request", int], None] | None = None
    on_done: Callable[["Request"], None] | None = None
    tag: object = None                         # the caller's, e.g. a document's name
    # state
    id: int = field(default_factory=lambda: random.getrandbits(63))
    laid_out: int = 0                          # positions sent into the pipeline
    chunk: int = 0                             # the next prefill slice
    tokens: list[int] = field(default_factory=list)
    in_flight: int = 0                         # entries of it in flight
    stop_reason: str = ""                      # length | eos | stop | error | cancelled
    error: str = ""
    submitted_s: float = field(default_factory=time.monotonic)
    first_token_s: float | None = None
    done_s: float | None = None
    sampler: Sampler | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.slices = list(self.slices) if self.slices else [len(self.prompt)]
        if sum(self.slices) != len(self.prompt) or min(self.slices) < 1:
            raise ValueError(f"slices {self.slices} do not cover the prompt's {len(self.prompt)} tokens")
        self.sampler = Sampler(self.params, self.prompt)

    @property
    def max_len(self) -> int:
        return len(self.prompt) + self.max_new_tokens

    @property
    def prefilling(self) -> bool:
        return self.laid_out < len(self.prompt)

    @property
    def ready(self) -> bool:
        """Whether it can have its next entry scheduled now."""
        if self.stop_reason:
            return False
        return self.prefilling or (self.in_flight == 0 and bool(self.tokens))

    def next_chunk(self) -> int:
        return self.slices[self.chunk]

    @property
    def finished(self) -> bool:
        return bool(self.stop_reason)


@dataclass
class Planned:
    """One entry of a micro-batch being formed."""
    request: Request
    length: int
    logits: bool


class Engine:
    """Runs :class:`Request` s on a session, ``depth`` micro-batches in flight, formed by ``policy``."""

    def __init__(self, session: Session, policy, depth: int, max_running: int = 64):
        self.session, self.policy, self.depth, self.max_running = session, policy, max(1, depth), max_running
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._in_flight: dict[int, list[Planned]] = {}
        self._lock = threading.Condition()
        self.micro_batches = 0

    def add(self, request: Request) -> Request:
        with self._lock:
            self.waiting.append(request)
            self._lock.notify_all()
        return request

    def run(self, until_idle: bool = True, stop: threading.Event | None = None) -> None:
        """Schedule and collect until every request added is done (``until_idle``), or ``stop`` is set."""
        while not (stop and stop.is_set()):
            with self._lock:
                self._admit()
                if not self.running and not self._in_flight:
                    if until_idle:
                        return
                    self._lock.wait(0.1)
                    continue
            while len(self._in_flight) < self.depth and self._send_one():
                pass
            if self._in_flight:
                self._collect()

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            self.running.append(self.waiting.pop(0))

    def _send_one(self) -> bool:
        planned = self.policy.form([r for r in self.running if r.ready], self)
        if not planned:
            return False
        entries, tokens = [], []
        for p in planned:
            r = p.request
            start = r.laid_out
            if r.prefilling:
                tokens += r.prompt[start:start + p.length]
                r.chunk += 1
            else:
                tokens.append(r.tokens[-1])
            entries.append(pb.Entry(sequence_id=r.id, start=start, length=p.length,
                                    logits=pb.LAST_LOGITS if p.logits else pb.NO_LOGITS,
                                    max_len=r.max_len if start == 0 else 0))
            r.laid_out += p.length
            r.in_flight += 1
        mb = self.session.submit(entries, torch.tensor(tokens, dtype=torch.long))
        self._in_flight[mb] = planned
        self.micro_batches += 1
        return True

    def _collect(self) -> None:
        watch = [r.id for r in self.running]
        result = self.session.wait_any(list(self._in_flight), watch)
        planned = self._in_flight.pop(result.micro_batch)
        rows, samplers, owners = [], [], []
        row = 0
        for p in planned:
            r = p.request
            r.in_flight -= 1
            if p.logits:
                if r.id not in result.failed and not r.finished:
                    rows.append(row)
                    samplers.append(r.sampler)
                    owners.append(r)
                row += 1
            if r.id in result.failed:
                code, message = result.failed[r.id]
                self._finish(r, "error", f"{code}: {message}")
        if rows:
            picked = sample(samplers, result.logits[rows])
            now = time.monotonic()
            for r, token in zip(owners, picked):
                self._take(r, token, now)
        self.policy.observe(result, planned, self)

    def _take(self, r: Request, token: int, now: float) -> None:
        if r.first_token_s is None:
            r.first_token_s = now
        r.tokens.append(token)
        if r.on_token is not None:
            r.on_token(r, token)
        if token in r.eos:
            self._finish(r, "eos")
        elif len(r.tokens) >= r.max_new_tokens:
            self._finish(r, "length")

    def finish(self, r: Request, reason: str, error: str = "") -> None:
        """End ``r`` now (a stop string matched, the client went away, ...) and free its sequence."""
        with self._lock:
            self._finish(r, reason, error)

    def _finish(self, r: Request, reason: str, error: str = "") -> None:
        if r.finished:
            return
        r.stop_reason, r.error, r.done_s = reason, error, time.monotonic()
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        if r.laid_out:
            self.session.close_sequences([r.id])
        r.done.set()
        if r.on_done is not None:
            r.on_done(r)

    def fail_all(self, error: str) -> None:
        """The pipeline broke: every request not done ends with ``error``."""
        with self._lock:
            for r in list(self.running) + list(self.waiting):
                self._finish(r, "error", error)
            self._in_flight.clear()
