"""How the engine fills each micro-batch: which decode tokens and prefill chunks go in.

A policy's ``form(engine)`` returns the entries of the next micro-batch (each request at most
once), admitting waiting requests as it schedules their first chunk. Prompt chunks never cross the plan's slice boundaries
(Algorithm 2's slicing for the prompt's length), so a lone long document is HPipe's pipelined
prefill whatever the policy.

- ``gllm`` (gLLM's Token Throttling, ``docs/decisions/scheduler.md``): decode tokens spread evenly
  over the micro-batches in flight, ``#D = ceil(running decode requests / depth)`` (eq. 4), where
  the depth counts the pipeline's decode lanes (:func:`hpipe.core.lanes.decode_lanes`), not its
  stages: a decode step reads every weight whatever its batch, so stages sharing one memory gain
  from more, smaller decode micro-batches only while they compute at once (daemons pinned to
  cores of their own, or as many of a machine's unpinned daemons as its cores hold their
  threads) and pay for every extra read beyond that. A ready decode token waits while every
  lane has a micro-batch of decode tokens only in flight, so decoding requests go as one group a
  lane, not as many small groups that each read every weight; prefill
  tokens ``#P = max(min(#WP / T, MaxP (KVfree - KVthresh) / (1 - KVthresh)), MinP)`` (eq. 3),
  where ``#WP`` is every prompt token not yet sent, and none at all while the tightest stage's free
  KV share is under ``KVthresh`` (unless nothing decodes and nothing is in flight: ``MinP`` then,
  for which the engine preempts, since no decode will free a block).
- ``sarathi`` (Sarathi-Serve): a fixed token budget per micro-batch, decode tokens first, prefill
  chunks filling the rest.
- ``fcfs``: one request at a time, its slices pipelined, then its decode steps.
- ``single``: one entry per micro-batch, admitted requests in turn: how hpipe ran before batching
  (with ``hpipe run --parallel 2``), kept to compare with.
"""

from __future__ import annotations

import math
from typing import Callable

from runtime.coordinator.engine import Engine, Planned, Request

#: prompt tokens left to prefill (a question about a cached document, a short chat turn) that ride
#: in a micro-batch without long chunks, shortest first (gllm): a daemon's worker runs the fewest
#: tokens first (runtime.daemon.worker), so such a prompt's first token does not wait for other
#: documents' prefill on every stage
SHORT_PROMPT = 64
#: micro-batches in a row that may leave long chunks out for short prompts (then one takes them)
SMALL_IN_A_ROW = 3
#: waiting requests whose cached prefix gllm looks up to sort them (the rest by their whole prompt)
LOOKUPS = 64


def prefill_chunks(engine: Engine, budget: int, planned: list[Planned], shortest_first: bool,
                   short_apart: bool = False, admit: Callable[[Request], bool] | None = None,
                   skip: Callable[[Request], bool] | None = None) -> bool:
    """Prefill chunks into ``planned``, up to ``budget`` tokens, from requests prefilling and then
    waiting ones (admitted as they get their first chunk), oldest first; or, ``shortest_first``,
    the fewest prompt tokens left first (a waiting one counted without its cached blocks, for the
    first ``LOOKUPS`` waiting), so a short request is never stuck behind a long document's prefill
    (head-of-line blocking); with ``short_apart`` too, a micro-batch with a short one
    (``SHORT_PROMPT``) takes no long chunk. A lone prompt with nothing else to do takes its plan
    slices whole, whatever the budget: HPipe's pipelined prefill. ``admit`` decides whether a
    waiting request may start (default: the engine's :meth:`Engine.admit`; a policy may reserve
    more); waiting requests that ``skip`` names are passed over (a policy's to bring back). Whether
    a long chunk was left out for a short prompt."""
    admit = admit or engine.admit
    busy = {id(p.request) for p in planned}
    running = sorted((r for r in engine.running if r.prefilling and r.ready and id(r) not in busy),
                     key=lambda r: r.arrival_s)
    candidates = running + [r for r in engine.waiting if skip is None or not skip(r)]
    left: dict[int, int] = {}
    if shortest_first:  # stable: the oldest first among equals
        if engine.cache is not None:
            left = {id(r): engine.cache.uncached(r) for r in engine.waiting[:LOOKUPS]}
        candidates.sort(key=lambda r: left.get(id(r), r.waiting_tokens))
    lone = len(candidates) == 1 and not planned
    admitting, short = True, False
    for r in candidates:
        if budget <= 0:
            return False
        if short and left.get(id(r), r.waiting_tokens) > SHORT_PROMPT:
            return True  # a short prompt's micro-batch stays small: daemons run small ones first
        if r in engine.waiting:
            if not admitting:
                continue
            if not admit(r):
                # refused for good (too long), or waiting for another request to fill its cached
                # prefix: the next may still go in
                admitting = r.finished or r.deferred
                continue
            if not r.prefilling:  # swapped out while decoding: its next token comes with the decode ones
                continue
        n = r.next_chunk() if lone else min(r.next_chunk(), budget)
        planned.append(Planned(r, n))
        budget -= n
        short = short or (short_apart and r.waiting_tokens <= SHORT_PROMPT)  # (admitted: what is not cached)
    return False


def _decoding(engine: Engine) -> list[Request]:
    """Requests that can have a decode token now, the longest waiting first."""
    return sorted((r for r in engine.running if not r.prefilling and r.ready), key=lambda r: r.admitted)


def decode_waits(engine: Engine, ready: int, quota: int, depth: int) -> bool:
    """Whether ``ready`` decode tokens wait for those in flight: when they would share one
    micro-batch with them (``quota`` a micro-batch), or while every one of ``depth`` decode lanes
    has a micro-batch of decode tokens only in flight (tokens riding with prefill chunks wait for
    those wherever they are). Requests that finished their prompts at different times then merge
    into one group a lane instead of circulating as many small groups that each read every weight,
    step after step (``docs/decisions/scheduler.md``, point 1)."""
    coming = sum(1 for r in engine.running if r.in_flight and not r.prefilling)
    return coming > 0 and (ready + coming <= quota or engine.decode_batches >= depth)


class GLLM:
    name = "gllm"

    def __init__(self, max_prefill: int = 512, min_prefill: int = 32, iterations: int = 4,
                 kv_thresh: float = 0.05, spread: str = "lanes"):
        if spread not in ("lanes", "stages"):
            raise ValueError(f"spread decode tokens over 'lanes' or 'stages', not {spread!r}")
        self.max_prefill, self.min_prefill, self.iterations, self.kv_thresh, self.spread = \
            max_prefill, min_prefill, iterations, kv_thresh, spread
        self._apart = 0  # micro-batches in a row that left a long chunk out for a short prompt

    def form(self, engine: Engine) -> list[Planned]:
        decoding = sum(1 for r in engine.running if not r.prefilling)
        depth = min(engine.lanes, engine.depth) if self.spread == "lanes" else engine.depth
        quota = math.ceil(decoding / depth)
        ready = _decoding(engine)
        planned = [] if decode_waits(engine, len(ready), quota, depth) else [Planned(r, 1) for r in ready[:quota]]
        waiting = sum(r.waiting_tokens for r in engine.running if r.prefilling) + \
            sum(r.waiting_tokens for r in engine.waiting)
        free = engine.kv_free()
        # under KVthresh prefill waits for decode to free blocks; with no decode at all, waiting
        # would be for good: then a prefill chunk goes, and the engine makes room for it
        stalled = not planned and not any(r.in_flight for r in engine.running)
        # a request swapped out mid-answer waits with no prompt left to send: it is admitted here too
        if (waiting or engine.waiting) and (free >= self.kv_thresh or stalled):
            share = self.max_prefill * (free - self.kv_thresh) / (1 - self.kv_thresh)
            budget = max(min(waiting / self.iterations, share), self.min_prefill)
            # at most SMALL_IN_A_ROW micro-batches in a row are kept small for short prompts, so a
            # stream of them never keeps a long document from its chunks
            apart = prefill_chunks(engine, math.ceil(budget), planned, shortest_first=True,
                             short_apart=self._apart < SMALL_IN_A_ROW)
            self._apart = self._apart + 1 if apart else 0
        return planned

    def draft_budget(self, engine: Engine, planned: list[Planned]) -> int:
        """Speculative guesses a micro-batch may carry (runtime.coordinator.speculation): the
        prefill budget less the tokens it carries already, halved while prompts wait to be read."""
        budget = self.max_prefill - sum(p.length for p in planned)
        if engine.waiting or any(r.prefilling for r in engine.running):
            budget //= 2
        return max(0, budget)


class Sarathi:
    name = "sarathi"

    def __init__(self, budget: int = 512):
        self.budget = budget

    def form(self, engine: Engine) -> list[Planned]:
        planned = [Planned(r, 1) for r in _decoding(engine)[:self.budget]]
        prefill_chunks(engine, self.budget - len(planned), planned, shortest_first=False)
        return planned

    def draft_budget(self, engine: Engine, planned: list[Planned]) -> int:
        """Guesses fill what the token budget leaves (runtime.coordinator.speculation)."""
        return max(0, self.budget - sum(p.length for p in planned))



class FCFS:
    name = "fcfs"

    def form(self, engine: Engine) -> list[Planned]:
        if not engine.running and engine.waiting:
            engine.admit(engine.waiting[0])
        for r in engine.running:
            if r.ready:
                return [Planned(r, r.next_chunk() if r.prefilling else 1)]
        return []



class OnePerBatch:
    name = "single"

    def __init__(self):
        self._turn = 0

    def form(self, engine: Engine) -> list[Planned]:
        while engine.waiting and engine.admit(engine.waiting[0]):
            pass
        ready = sorted((r for r in engine.running if r.ready), key=lambda r: r.admitted)
        if not ready:
            return []
        r = ready[self._turn % len(ready)]
        self._turn += 1
        return [Planned(r, r.next_chunk() if r.prefilling else 1)]



POLICIES = {"gllm": GLLM, "sarathi": Sarathi, "fcfs": FCFS, "single": OnePerBatch}
