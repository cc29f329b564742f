"""Speculative decoding: guess the next tokens, verify them in one pass, keep what the model agrees to.

A decode step pays, for one token, a pass over every stage's weights and every link's latency.
Verifying ``k`` guessed tokens costs one pass too (``k + 1`` rows of one entry: the last token and
the guesses, each at its own position), and every guess the model agrees to is a token gained.

Guesses come from the text itself (:class:`PromptLookup`, "prompt lookup decoding"): answers about
a document quote it, so the tokens that followed the last few tokens' earlier occurrence (in the
prompt, or in the answer so far) are a good guess, needing no model.

Answers are those of decoding one token at a time:
- greedy: a row's logits are computed as a lone decode row's (the kernels' decode rows do not
  depend on the rows beside them: tests/model/test_speculative.py), so row ``i``'s arg-max is the
  token that one-at-a-time decoding picks there; guesses are kept while they equal it, and the
  first that does not is replaced by it;
- sampled: rejection sampling (Leviathan et al., 2023; the guess is certain, q = 1 on it): a guess
  ``d`` is kept with probability p(d), else the token is drawn from p with ``d`` taken out, so each
  token is drawn from the distribution one-at-a-time decoding draws it from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hpipe.model.generate.sampling import Sampler, probabilities, sample

#: the most tokens guessed at once
MAX_DRAFT = 8
#: n-gram lengths looked up, longest first
NGRAMS = (3, 2, 1)
#: after this many verifications in a row that kept no guess, guessing pauses for PAUSE tokens
MISSES = 3
PAUSE = 16
METHODS = ("off", "ngram")


@dataclass
class PromptLookup:
    """Guesses from the tokens so far (prompt and answer), and how many to make: one more than the
    last verification kept (at most :data:`MAX_DRAFT`), none for a while after :data:`MISSES`
    verifications that kept none."""

    max_draft: int = MAX_DRAFT
    length: int = 4  # how many to guess next
    misses: int = 0
    paused: int = 0  # tokens left before guessing again
    proposed: int = 0
    accepted: int = 0
    verifications: int = 0
    _index: dict = field(default_factory=dict, repr=False)  # n-gram -> the position after its last occurrence
    _seen: int = 0  # tokens indexed

    def _update_index(self, tokens: list[int]) -> None:
        for end in range(max(self._seen, 1), len(tokens)):  # n-grams ending before position `end`
            for n in NGRAMS:
                if end - n >= 0:
                    self._index.setdefault(n, {})[tuple(tokens[end - n:end])] = end
        self._seen = len(tokens)

    def propose(self, tokens: list[int], room: int) -> list[int]:
        """Up to ``room`` guesses of the tokens after ``tokens`` (prompt and answer so far)."""
        if self.paused > 0:
            self.paused -= 1
            return []
        want = min(self.length, room, self.max_draft)
        if want <= 0 or len(tokens) < 2:
            return []
        self._update_index(tokens[:-1])  # the last n-gram is the query: its earlier occurrences count
        for n in NGRAMS:
            if len(tokens) < n:
                continue
            at = self._index.get(n, {}).get(tuple(tokens[-n:]))
            if at is not None and at < len(tokens):
                return tokens[at:at + want]
        return []

    def record(self, proposed: int, kept: int) -> None:
        """A verification of ``proposed`` guesses kept ``kept``."""
        self.proposed += proposed
        self.accepted += kept
        self.verifications += 1
        self.length = max(1, min(self.max_draft, kept + 1))
        self.misses = 0 if kept else self.misses + 1
        if self.misses >= MISSES:
            self.paused, self.misses = PAUSE, 0

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    def stats(self) -> dict:
        return {"proposed": self.proposed, "accepted": self.accepted, "verifications": self.verifications,
                "acceptance": round(self.acceptance, 3) if self.acceptance is not None else None}


def refused(quantized: bool, devices: list[str]) -> str | None:
    """Why a model cannot decode speculatively with the answers unchanged, or None where it can:
    the decode rows of quantized (GGUF) weights on CPU stages do not depend on the rows beside
    them (tests/model/test_speculative.py); dense float weights multiply through MKL, whose sums
    for a row change with the rows beside it, and GPU stages are not verified."""
    if not quantized:
        return ("--speculate needs a model that computes from quantized (GGUF) weights: dense float weights give "
                "a guessed row other bits than a lone one, and the answers could change (drop --dequantize, or "
                "use a .gguf file)")
    gpus = [d for d in devices if not d.startswith("cpu")]
    if gpus:
        return f"--speculate runs on CPU stages only (this model has stages on {', '.join(sorted(set(gpus)))})"
    return None


def verify(sampler: Sampler, rows: torch.Tensor, drafts: list[int]) -> list[int]:
    """The tokens ``rows [len(drafts) + 1, vocab]`` (each the logits after the last token, then
    after each guess) give: the guesses kept, then the token after them (a correction, or one more
    where every guess was kept). The sampler's state (its penalties' counts, its generator)
    advances by exactly those tokens, as one-at-a-time decoding advances it."""
    out: list[int] = []
    for i in range(len(drafts) + 1):
        if sampler.params.greedy or i == len(drafts):
            token = sample([sampler], rows[i:i + 1])[0]
        else:
            token = _draw_against(sampler, rows[i], drafts[i])
        out.append(token)
        if i == len(drafts) or token != drafts[i]:
            break
    return out


def _draw_against(sampler: Sampler, row: torch.Tensor, draft: int) -> int:
    """Rejection sampling of a certain guess: ``draft`` with probability p(draft), else a draw
    from p without it (renormalised)."""
    p = probabilities(sampler, row)
    u = float(torch.rand((), generator=sampler.generator))
    if u < float(p[draft]):
        token = draft
    else:
        rest = p.clone()
        rest[draft] = 0
        total = float(rest.sum())
        token = int(torch.multinomial(rest / total, 1, generator=sampler.generator)) if total > 0 else draft
    sampler.output[token] += 1
    return token
