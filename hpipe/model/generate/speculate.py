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


#: what a verification of k guesses is taken to cost, in steps of one token, until measured:
#: 1 + PRIOR_COST x k (guessing then starts at once, and its own timings correct it)
PRIOR_COST = 0.15
#: the weight of a new timing in a cost's running average
EMA = 0.3
#: whether guessers weigh guesses against their timings (tests that count kept guesses turn it off:
#: timings make the count vary from run to run, never the answers)
WEIGH_COSTS = True


@dataclass
class PromptLookup:
    """Guesses from the tokens so far (prompt and answer), and how many to make: up to one more
    than the last verification kept (at most :data:`MAX_DRAFT`), as many as pay by the timings of
    this sequence's own steps and verifications (:meth:`timed`): k guesses kept at a rate a give
    1 + a + ... + a^k tokens a pass, against what a pass of k + 1 rows costs over one of one row
    (on a CPU stage rows cost compute, so a small model's verification of 5 rows took 3.3 steps:
    there guessing does not pay and stops; over slow links and for models whose steps are bound by
    reading their weights it does). None for a while after :data:`MISSES` verifications that kept
    none, or when no number of guesses pays."""

    max_draft: int = MAX_DRAFT
    length: int = 4  # how many to guess next
    misses: int = 0
    paused: int = 0  # tokens left before guessing again
    proposed: int = 0
    accepted: int = 0
    verifications: int = 0
    _index: dict = field(default_factory=dict, repr=False)  # n-gram -> the position after its last occurrence
    _seen: int = 0  # tokens indexed
    _cost: dict = field(default_factory=dict, repr=False)  # guesses -> seconds a pass (running average)
    weigh: bool = field(default_factory=lambda: WEIGH_COSTS)  # guess only as many as pay (else: length)
    _probe: bool = False  # the next proposal is one guess, after a pause for not paying

    def timed(self, guesses: int, seconds: float) -> None:
        """A pass with ``guesses`` guesses (0: a plain step) took ``seconds``."""
        old = self._cost.get(guesses)
        self._cost[guesses] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def _relative_cost(self, k: int) -> float:
        """A pass of k guesses over a plain step: measured, else interpolated, else the prior."""
        step = self._cost.get(0)
        if step is None or step <= 0:
            return 1 + PRIOR_COST * k
        known = sorted(g for g in self._cost if g > 0)
        if k in self._cost:
            return self._cost[k] / step
        below = [g for g in known if g < k]
        above = [g for g in known if g > k]
        if below and above:
            a, b = below[-1], above[0]
            return (self._cost[a] + (self._cost[b] - self._cost[a]) * (k - a) / (b - a)) / step
        if below:  # past the largest measured: its cost per guess, onwards
            a = below[-1]
            return (self._cost[a] + (self._cost[a] - step) / a * (k - a)) / step
        return 1 + PRIOR_COST * k

    def worth(self, limit: int) -> int:
        """How many guesses (up to ``limit``) give the most tokens a second; 0 if none beat a step."""
        rate = (self.accepted + 1.2) / (self.proposed + 2)  # kept so far, from a prior of 0.6 over 2 guesses
        best, best_gain = 0, 1.0
        for k in range(1, limit + 1):
            tokens = sum(rate ** i for i in range(k + 1))
            gain = tokens / max(self._relative_cost(k), 1e-9)
            if gain > best_gain:
                best, best_gain = k, gain
        return best

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
        if self._probe:  # after a pause for not paying: one guess, timed and counted
            self._probe = False
            return self._lookup(tokens, min(1, room))
        if self.weigh and self._cost.get(0) is None and self.verifications:  # a plain step, to time one
            return []
        limit = min(self.length, room, self.max_draft)
        want = self.worth(limit) if self.weigh else limit
        if want <= 0:
            if self._cost.get(0) is not None and self.verifications:  # it does not pay: look again later,
                self.paused, self._probe = PAUSE, True  # with one guess to learn from
            return []
        return self._lookup(tokens, want)

    def _lookup(self, tokens: list[int], want: int) -> list[int]:
        """Up to ``want`` tokens that followed the latest earlier occurrence of the last 3, 2 or 1."""
        if len(tokens) < 2 or want <= 0:
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
