"""Speculative decoding in the engine (:mod:`hpipe.model.generate.speculate` says how it works).

A decoding request's entry may carry, after its last token, guesses of the tokens to follow
(prompt lookup): one entry of ``1 + k`` decode rows, each at its own position, whose rows all come
back (their top logits where the request needs no more: ``ALL_TOP``). The request keeps the
guesses the model agrees to and the token after them, and its next entry starts right after the
kept positions: each stage drops what it computed past them when that entry arrives
(:meth:`runtime.daemon.layout.Layouts._rewind`, which also cuts the replay log), so recovery and
the KV pools only ever hold kept positions.

What guessing may cost: the guesses of one micro-batch are counted against the policy's token
budget (:meth:`draft_budget`; gLLM's: its prefill budget, less what the micro-batch carries, and
halved while prompts wait for prefill), and with many requests decoding (the pipeline kept full by
them: :data:`FULL_PER_LANE` a lane) only requests whose guesses are mostly kept guess at all. Each
request guesses as many tokens as its last verification kept, plus one, and pauses after a run
of verifications that kept none (:class:`PromptLookup`).
"""

from __future__ import annotations

import logging

import torch

from hpipe.model.generate.sampling import SampleError, logprobs
from hpipe.model.generate.speculate import PromptLookup, verify
from runtime.wire.messages import pb

log = logging.getLogger(__name__)

#: decoding requests per lane at which the pipeline counts as full: then only well-guessing
#: requests guess (their guesses kept at least MIN_ACCEPTANCE of the time)
FULL_PER_LANE = 4
MIN_ACCEPTANCE = 0.5
#: the guesses of one micro-batch where the policy names no budget
DEFAULT_BUDGET = 64


class Speculating:
    """The engine's part in speculative decoding (a mixin of :class:`runtime.coordinator.engine.Engine`)."""

    speculate = "off"  # the engine's default for requests that do not say: "off" or "ngram"
    drafted = kept = 0  # guesses sent, and kept, over the engine's life

    def _speculates(self, r) -> bool:
        wanted = r.speculate if r.speculate is not None else self.speculate
        return wanted == "ngram"

    def draft_budget(self, planned) -> int:
        """How many guesses this micro-batch may carry."""
        ask = getattr(self.policy, "draft_budget", None)
        return ask(self, planned) if ask is not None else DEFAULT_BUDGET

    def _draft(self, planned) -> None:
        """Add guesses to the decode entries of ``planned`` whose requests speculate."""
        candidates = [p for p in planned if p.length == 1 and not p.request.prefilling and self._speculates(p.request)]
        if not candidates:
            return
        budget = self.draft_budget(planned)
        decoding = sum(1 for r in self.running if not r.prefilling)
        full = decoding >= FULL_PER_LANE * self.lanes
        for p in candidates:
            r = p.request
            if r.drafter is None:
                r.drafter = PromptLookup()
            if budget <= 0:
                break
            if full and (r.drafter.acceptance or 0.0) < MIN_ACCEPTANCE:
                continue
            room = min(r.max_new_tokens - len(r.tokens) - 1, r.max_len - r.laid_out - 1, budget)
            drafts = r.drafter.propose(r.prompt + r.tokens, room) if room > 0 else []
            if drafts:
                p.drafts = drafts
                p.length += len(drafts)
                budget -= len(drafts)

    def _draft_logits(self, r) -> int:
        """What a speculative entry needs back: every row, as top logits where they draw what the
        whole row does."""
        return pb.ALL_TOP if self._logits(r) == pb.LAST_TOP else pb.ALL_LOGITS

    def _take_verified(self, p, rows: torch.Tensor, now: float) -> None:
        """Request ``p.request``'s verification rows ``[1 + k, vocab]``: the guesses kept, the token
        after them, the sequence rewound to the kept positions."""
        r = p.request
        if not bool(torch.isfinite(rows.amax(dim=-1)).all()):
            self._finish(r, "error", "the model produced non-finite logits (NaN or inf) for this sequence: a stage's "
                                     "weights or activations overflowed")
            return
        try:
            tokens = verify(r.sampler, rows, p.drafts)
        except SampleError as e:
            self._finish(r, "error", f"sampling failed for this request: {next(iter(e.failed.values()))}")
            return
        r.drafter.record(len(p.drafts), len(tokens) - 1)
        self.drafted += len(p.drafts)
        self.kept += len(tokens) - 1
        r.laid_out = p.start + len(tokens)  # the last token and the guesses kept; the next entry starts after
        for i, token in enumerate(tokens):
            if r.logprobs is not None:
                r.token_logprobs.append(logprobs(rows[i], token, r.logprobs))
            self._take(r, token, now)
            if r.finished:
                break
