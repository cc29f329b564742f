"""How the engine fills each micro-batch: which decode tokens and prefill chunks go in.

A policy's ``form(ready, engine)`` returns the entries of the next micro-batch (each request at
most once) from the requests that can have an entry now; ``observe(result, planned, engine)``
sees every micro-batch's outcome. A request's prompt is always cut where its slices say (the
plan's Algorithm-2 slicing for its length), so a lone long document is HPipe's pipelined prefill.
"""

from __future__ import annotations

from runtime.engine import Planned, Request

#: the default most tokens a micro-batch of :class:`Batched` holds (a prefill chunk longer than
#: this still goes, alone with the decode tokens)
DEFAULT_MAX_TOKENS = 512


def _chunk(r: Request) -> Planned:
    n = r.next_chunk()
    return Planned(r, n, r.laid_out + n == len(r.prompt))


class Batched:
    """Every ready decode token, then prefill chunks, oldest request first, up to ``max_tokens``."""

    name = "batched"

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS):
        self.max_tokens = max_tokens

    def form(self, ready: list[Request], engine) -> list[Planned]:
        planned = [Planned(r, 1, True) for r in ready if not r.prefilling]
        budget = self.max_tokens - len(planned)
        for r in sorted((r for r in ready if r.prefilling), key=lambda r: r.submitted_s):
            n = r.next_chunk()
            if n > budget and planned:
                break
            planned.append(_chunk(r))
            budget -= n
        return planned

    def observe(self, result, planned, engine) -> None:
        pass


class OnePerBatch:
    """One entry per micro-batch, requests in turn: each sequence's decode steps alone through the
    pipeline, as hpipe ran before it batched (kept to compare with)."""

    name = "single"

    def __init__(self):
        self._turn = 0

    def form(self, ready: list[Request], engine) -> list[Planned]:
        if not ready:
            return []
        ready = sorted(ready, key=lambda r: r.submitted_s)
        r = ready[self._turn % len(ready)]
        self._turn += 1
        return [_chunk(r)] if r.prefilling else [Planned(r, 1, True)]

    def observe(self, result, planned, engine) -> None:
        pass


POLICIES = {"batched": Batched, "single": OnePerBatch}
