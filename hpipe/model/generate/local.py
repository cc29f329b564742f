"""Generation: encode the prompt, prefill it slice by slice, decode token by token.

The decode loop is written against one callable, ``forward(ids, start) -> last-position logits``,
so the single-process model (the reference) and the distributed pipeline share it exactly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch

from hpipe.core.errors import InputError
from hpipe.core.units import UnitRange, ranges_from_cuts
from hpipe.model.compute.stage import StageModel
from hpipe.model.generate.sampling import Sampler, SamplingParams
from hpipe.model.generate.speculate import METHODS, PromptLookup, verify
from hpipe.model.weights.sources import ModelSource

log = logging.getLogger(__name__)


class Runner(Protocol):
    """One open sequence of some model: local stages or a remote pipeline."""

    def prefill(self, ids: torch.Tensor, slices: Sequence[int]) -> torch.Tensor:
        """Feed ``ids [1, tokens]`` in ``slices``; return the logits of the last position ``[vocab]``."""

    def step(self, token: int) -> torch.Tensor:
        """Feed one token at the next position; return its logits ``[vocab]``."""

    # and, to decode speculatively: ``position`` (the positions fed), ``verify(tokens)`` (each
    # one's logits from one pass, as ``step`` would give them) and ``rewind(position)``


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    prefill_s: float
    decode_s: float
    stop_reason: str
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        new = len(self.token_ids)
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": new,
            "stop_reason": self.stop_reason,
            "prefill_s": round(self.prefill_s, 6),
            "decode_s": round(self.decode_s, 6),
            "decode_tokens_per_s": round(new / self.decode_s, 3) if self.decode_s > 0 and new else None,
            **self.extra,
        }


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """The token ids of a conversation in the model's chat template, ready for the assistant's turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise InputError("this model's tokenizer has no chat template")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # noqa: BLE001 - jinja raises its own errors for malformed conversations
        raise InputError(f"the conversation does not fit the model's chat template: {e}") from None
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    if chat:
        return encode_chat(tokenizer, [{"role": "user", "content": text}])
    return list(tokenizer(text)["input_ids"])


def check_slices(slices: Sequence[int] | None, prompt_tokens: int) -> list[int]:
    if not slices:
        return [prompt_tokens]
    if any(s <= 0 for s in slices):
        raise InputError(f"slice lengths must be positive, got {list(slices)}")
    if sum(slices) != prompt_tokens:
        raise InputError(f"slice lengths {list(slices)} add up to {sum(slices)}, the prompt has {prompt_tokens} tokens")
    return list(slices)


def plan_lengths(prompt_tokens: int, max_new_tokens: int, context: int) -> tuple[int, int]:
    """(max_new_tokens, cache length) for a prompt, refusing prompts that do not fit the context."""
    if prompt_tokens == 0:
        raise InputError("the prompt is empty")
    if prompt_tokens >= context:
        raise InputError(f"the prompt has {prompt_tokens} tokens; the model's context is {context} tokens")
    if max_new_tokens < 1:
        raise InputError(f"max-new-tokens must be >= 1, got {max_new_tokens}")
    if prompt_tokens + max_new_tokens > context:
        log.warning("max-new-tokens cut from %d to %d to fit the %d-token context",
                    max_new_tokens, context - prompt_tokens, context)
        max_new_tokens = context - prompt_tokens
    return max_new_tokens, prompt_tokens + max_new_tokens


def decode_loop(
    runner: Runner,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    sampler: Sampler,
    eos_ids: Sequence[int],
    slices: Sequence[int],
    on_token: Callable[[int], None] | None = None,
    drafter: PromptLookup | None = None,
) -> tuple[list[int], float, float, str]:
    """Prefill ``prompt_ids`` in ``slices``, then sample up to ``max_new_tokens``; with ``drafter``,
    speculatively (:mod:`hpipe.model.generate.speculate`: the runner verifies guesses in one pass
    and forgets those not kept; the same tokens as without, greedy).

    Returns (new token ids, prefill seconds, decode seconds, stop reason).
    """
    t0 = time.perf_counter()
    logits = runner.prefill(torch.tensor([prompt_ids], dtype=torch.long), slices)
    prefill_s = time.perf_counter() - t0
    out: list[int] = []
    reason = "length"
    t1 = time.perf_counter()
    pending = [sampler(logits)]
    while True:
        for token in pending:
            out.append(token)
            if on_token:
                on_token(token)
            if token in eos_ids:
                return out, prefill_s, time.perf_counter() - t1, "eos"
            if len(out) >= max_new_tokens:
                return out, prefill_s, time.perf_counter() - t1, reason
        drafts = drafter.propose(prompt_ids + out, max_new_tokens - len(out) - 1) if drafter is not None else []
        t = time.perf_counter()
        if not drafts:
            pending = [sampler(runner.step(out[-1]))]
            if drafter is not None:
                drafter.timed(0, time.perf_counter() - t)
            continue
        start = runner.position
        pending = verify(sampler, runner.verify([out[-1], *drafts]), drafts)
        drafter.timed(len(drafts), time.perf_counter() - t)
        drafter.record(len(drafts), len(pending) - 1)
        runner.rewind(start + len(pending))  # the last token and the guesses kept; not the rest


class LocalRunner:
    def __init__(self, stages: list[StageModel], max_len: int, batch: int = 1):
        self.stages = stages
        self.caches = [s.new_cache(batch, max_len) for s in stages]
        self.position = 0

    def _forward(self, ids: torch.Tensor, logits: bool, prefill: bool) -> torch.Tensor | None:
        x = ids
        for stage, cache in zip(self.stages, self.caches):
            x = stage(x, self.position, cache, logits=logits, prefill=prefill)
        self.position += ids.shape[1]
        return x[0, -1] if logits else None

    def prefill(self, ids: torch.Tensor, slices: Sequence[int]) -> torch.Tensor:
        start, logits = 0, None
        for k, n in enumerate(slices):
            logits = self._forward(ids[:, start:start + n], logits=k == len(slices) - 1, prefill=True)
            start += n
        return logits

    def step(self, token: int) -> torch.Tensor:
        return self._forward(torch.tensor([[token]]), logits=True, prefill=False)

    def verify(self, tokens: list[int]) -> torch.Tensor:
        """Feed ``tokens`` at the next positions as decode tokens in one pass: each one's logits
        ``[len(tokens), vocab]``, each row what :meth:`step` would have given there."""
        x = torch.tensor([tokens])
        for stage, cache in zip(self.stages, self.caches):
            x = stage(x, self.position, cache, all_logits=True, prefill=False)
        self.position += len(tokens)
        return x[0]

    def rewind(self, position: int) -> None:
        """Forget the positions from ``position`` on (guesses that were not kept)."""
        for cache in self.caches:
            cache.rewind(position)
        self.position = position


class LocalModel:
    """Every unit of the model in this process, optionally as several stages (for testing cuts).
    A GGUF model computes from its stored blocks unless ``dequantize`` (float32 weights)."""

    def __init__(self, source: ModelSource, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 cuts: Sequence[int] = (), dequantize: bool = False):
        self.source, self.cfg = source, source.config
        store = source.weights(dequantize=dequantize)
        ranges = ranges_from_cuts(list(cuts), self.cfg.num_layers) if cuts else [UnitRange.full(self.cfg.num_layers)]
        self.stages = [StageModel.from_checkpoint(store, self.cfg, r, dtype=dtype, device=device) for r in ranges]

    def open(self, max_len: int, batch: int = 1) -> LocalRunner:
        return LocalRunner(self.stages, max_len, batch)


def generate(
    open_runner: Callable[[int], Runner],
    tokenizer,
    prompt: str,
    *,
    context: int,
    eos_ids: Sequence[int],
    chat: bool = False,
    max_new_tokens: int = 128,
    sampling: SamplingParams = SamplingParams(),
    slices: Sequence[int] | None = None,
    speculate: str = "off",
) -> GenerationResult:
    """Generate from ``prompt`` on whatever ``open_runner(max_len)`` opens (local or remote)."""
    prompt_ids = encode_prompt(tokenizer, prompt, chat)
    return generate_ids(open_runner, tokenizer, prompt_ids, context=context, eos_ids=eos_ids,
                        max_new_tokens=max_new_tokens, sampling=sampling, slices=slices, speculate=speculate)


def generate_ids(
    open_runner: Callable[[int], Runner],
    tokenizer,
    prompt_ids: list[int],
    *,
    context: int,
    eos_ids: Sequence[int],
    max_new_tokens: int = 128,
    sampling: SamplingParams = SamplingParams(),
    slices: Sequence[int] | None = None,
    speculate: str = "off",
) -> GenerationResult:
    """``speculate``: ``ngram`` guesses tokens from the text so far and verifies them in one pass
    (:mod:`hpipe.model.generate.speculate`; the runner must offer ``verify`` and ``rewind``)."""
    if speculate not in METHODS:
        raise InputError(f"--speculate is one of {', '.join(METHODS)}, not {speculate!r}")
    slices = check_slices(slices, len(prompt_ids))
    max_new_tokens, max_len = plan_lengths(len(prompt_ids), max_new_tokens, context)
    runner = open_runner(max_len)
    drafter = PromptLookup() if speculate == "ngram" else None
    if drafter is not None and not hasattr(runner, "verify"):
        raise InputError("this runner cannot verify guesses")
    new, prefill_s, decode_s, reason = decode_loop(
        runner, prompt_ids, max_new_tokens=max_new_tokens, sampler=Sampler(sampling),
        eos_ids=eos_ids, slices=slices, drafter=drafter,
    )
    text = tokenizer.decode(new, skip_special_tokens=True)
    extra = {"speculation": drafter.stats()} if drafter is not None else {}
    return GenerationResult(text, new, len(prompt_ids), prefill_s, decode_s, reason, extra)
