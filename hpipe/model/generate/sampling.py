"""Token sampling on the CPU, for a whole micro-batch in one pass.

Each row has its own parameters: greedy (temperature 0) or temperature / top-k / top-p with a
seed, and OpenAI's frequency and presence penalties or Hugging Face's repetition penalty. The
penalties and masks are applied to all rows at once; only the draw itself is per row, each from
its request's own seeded generator, so a request samples the same tokens whatever it is batched
with. Stop strings are the request's business (they need the tokenizer): see
:mod:`hpipe.app.openai_api`.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch

from hpipe.core.errors import HpipeError, InputError

#: the lowest temperature sampled as given: a lower one (but not 0, greedy) is sampled at this, as
#: vLLM does, because float32 logits divided by it overflow (1e-300 is 0 in float32)
MIN_TEMPERATURE = 1e-2
#: what a generator's seed may be (torch.Generator.manual_seed's range)
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None
    frequency_penalty: float = 0.0  # subtracted once per time the token was generated (OpenAI)
    presence_penalty: float = 0.0   # subtracted once if the token was generated at all (OpenAI)
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and output (Hugging Face)

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise InputError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise InputError(f"seed must lie in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InputError(f"top-k must be >= 0, got {self.top_k}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InputError(f"{name.replace('_', ' ')} must lie in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0:
            raise InputError(f"repetition penalty must be > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)

    def needs_only_top(self, k: int) -> bool:
        """Whether a row's ``k`` largest logits draw what the whole row draws: greedy, or a top-k
        cut of at most ``k``, without penalties (which could lift a token from below the cut)."""
        return not self.penalised and (self.greedy or 0 < self.top_k <= k)


class Sampler:
    """One request's sampling state: its parameters, its generator, the tokens it has seen."""

    def __init__(self, params: SamplingParams = SamplingParams(), prompt: list[int] | None = None):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()
        self.prompt = set(prompt or ())
        self.output: Counter = Counter()

    def __call__(self, logits: torch.Tensor) -> int:
        """Pick the next token from the logits ``[vocab]`` of the last position (and remember it)."""
        return sample([self], logits.reshape(1, -1))[0]


def sample(samplers: list[Sampler], logits: torch.Tensor) -> list[int]:
    """The next token of each row of ``logits [rows, vocab]``, row ``i`` drawn by ``samplers[i]``.

    :class:`SampleError` names the rows that could not be drawn (their probabilities not a
    distribution); the other rows are drawn all the same, so one request's failure is its own."""
    logits = logits.detach().to("cpu", torch.float32)
    rows = len(samplers)
    if any(s.params.penalised for s in samplers):
        logits = logits.clone()
        for i, s in enumerate(samplers):
            if s.params.penalised:
                _penalise(logits[i], s)
    out = [0] * rows
    greedy = [i for i, s in enumerate(samplers) if s.params.greedy]
    if greedy:
        best = torch.argmax(logits[greedy], dim=-1).tolist()
        for i, t in zip(greedy, best):
            out[i] = t
    drawn = [i for i, s in enumerate(samplers) if not s.params.greedy]
    failed: dict[int, str] = {}
    if drawn:
        probs = _probabilities(logits[drawn], [samplers[i].params for i in drawn])
        for row, i in enumerate(drawn):
            try:
                out[i] = int(torch.multinomial(probs[row], 1, generator=samplers[i].generator))
            except RuntimeError as e:  # NaN, inf or all-zero probabilities
                failed[i] = str(e)
    for i, (s, t) in enumerate(zip(samplers, out)):
        if i not in failed:
            s.output[t] += 1
    if failed:
        raise SampleError(out, failed)
    return out


class SampleError(HpipeError):
    """Some rows could not be sampled: ``failed`` (row -> why); ``tokens`` holds the other rows' draws."""

    def __init__(self, tokens: list[int], failed: dict[int, str]):
        super().__init__(f"rows {sorted(failed)} could not be sampled: {next(iter(failed.values()))}")
        self.tokens, self.failed = tokens, failed


def _penalise(row: torch.Tensor, s: Sampler) -> None:
    p = s.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(s.prompt | set(s.output)), dtype=torch.long)
        if seen.numel():
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and s.output:
        tokens = torch.tensor(list(s.output), dtype=torch.long)
        counts = torch.tensor(list(s.output.values()), dtype=torch.float32)
        row[tokens] -= counts * p.frequency_penalty + p.presence_penalty


def probabilities(sampler: Sampler, row: torch.Tensor) -> torch.Tensor:
    """The distribution ``sampler`` draws its next token from, given the logits ``row [vocab]``
    (its penalties, temperature, top-k and top-p applied), without drawing."""
    row = row.detach().to("cpu", torch.float32).clone()
    if sampler.params.penalised:
        _penalise(row, sampler)
    return _probabilities(row[None], [sampler.params])[0]


def _probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax of each row at its temperature, cut to its top-k and top-p."""
    logits = logits / torch.tensor([p.temperature for p in params])[:, None]
    vocab = logits.shape[1]
    if any(p.top_k for p in params):
        k = torch.tensor([min(p.top_k, vocab) if p.top_k else vocab for p in params])
        kth = torch.topk(logits, int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params])[:, None]
        ordered, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(ordered, dim=-1)
        drop = probs.cumsum(-1) - probs >= top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    return torch.softmax(logits, dim=-1)


def logprobs(row: torch.Tensor, token: int, top: int) -> tuple[int, float, list[tuple[int, float]]]:
    """The model's log-probability of ``token`` and its ``top`` likeliest tokens (before any sampling
    parameter reshaped the distribution)."""
    lp = torch.log_softmax(row.float(), dim=-1)
    best = torch.topk(lp, top) if top else None
    alternatives = list(zip(best.indices.tolist(), best.values.tolist())) if best is not None else []
    return token, float(lp[token]), alternatives
