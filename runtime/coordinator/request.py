"""A request to the engine: a prompt to continue, how, and its state as the engine runs it.

Its prefix is what gets prefilled: the prompt, and after a preemption or a recovery that starts it
again, the tokens it has generated too; ``laid_out`` says how much of the prefix has been sent into
the pipeline, and ``slices`` how its prefill is cut (the plan's slicing, :mod:`runtime.coordinator.engine`).
A sequence that begins with cached blocks (:mod:`runtime.coordinator.prefix_cache`) starts at
``begins_at``, and only the rest is sliced.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from hpipe.model.generate.sampling import Sampler, SamplingParams


@dataclass(eq=False)
class Request:
    """One prompt to continue, and its state as the engine runs it."""

    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams = SamplingParams()
    eos: frozenset[int] = frozenset()
    slicer: Callable[[int], list[int]] | None = None  # a prefix's length -> its prefill slices (the plan's)
    on_token: Callable[["Request", int], None] | None = None
    on_done: Callable[["Request"], None] | None = None
    tag: object = None                         # the caller's, e.g. a document's name
    logprobs: int | None = None                # keep each token's log-probability and this many alternatives
    arrival_s: float = field(default_factory=time.monotonic)
    admitted_s: float | None = None            # when it started running (the last time, after a preemption)
    # state
    id: int = field(default_factory=lambda: secrets.randbits(63))  # the request's, for its whole life
    seq_id: int = field(default_factory=lambda: secrets.randbits(63))  # its sequence on the daemons now
    prefix: list[int] = field(default_factory=list)   # what is prefilled: the prompt, and after a
    slices: list[int] = field(default_factory=list)   # preemption the tokens generated too
    laid_out: int = 0                          # positions sent into the pipeline
    swapped: int = 0                           # blocks its KV takes in the daemons' host tier (0: none there)
    begins_at: int = 0                         # where its sequence's first entry starts (cached before)
    tokens: list[int] = field(default_factory=list)
    in_flight: int = 0                         # entries of it in flight
    admitted: int = 0                          # order in which the engine admitted it (newest: highest)
    preemptions: int = 0
    resumed_at: list[int] = field(default_factory=list)  # per recovery: the position it went on from
    refusals: int = 0
    # the prefix cache: the blocks its sequence began with, the blocks it claimed to fill (from
    # block ``begins_at // block size`` on) and how many of those are filled; ``cached_tokens``:
    # the positions it did not prefill, for its usage report
    hit: list[int] = field(default_factory=list)
    claimed: list[int] = field(default_factory=list)
    filled: int = 0
    deferred: bool = False                     # waiting for another request to fill its next block
    block_names: tuple | None = None           # (its prefix, the names of its full blocks but the last token's)
    cached_tokens: int = 0
    stop_reason: str = ""                      # length | eos | stop | error | cancelled
    error: str = ""
    first_token_s: float | None = None
    done_s: float | None = None
    sampler: Sampler | None = None
    speculate: str | None = None               # "ngram" or "off"; None: the engine's default
    drafter: object = None                     # its guesser while it speculates (PromptLookup)
    token_logprobs: list = field(default_factory=list)  # (token, logprob, [(token, logprob)] * logprobs)
    done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        if not self.prompt or self.max_new_tokens < 1:
            raise ValueError("a request needs a prompt and at least one new token")
        self.sampler = Sampler(self.params, self.prompt)
        self.restart(list(self.prompt))

    def restart(self, prefix: list[int], begins_at: int = 0) -> None:
        """Prefill ``prefix`` again (after a preemption or a recovery), from ``begins_at`` (the
        positions of the cached blocks its sequence begins with; 0: all of it)."""
        if not 0 <= begins_at < len(prefix):
            raise ValueError(f"a sequence of {len(prefix)} tokens cannot begin at position {begins_at}")
        self.prefix, self.laid_out, self.begins_at = prefix, begins_at, begins_at
        n = len(prefix) - begins_at
        self.slices = self.slicer(n) if self.slicer else [n]
        if sum(self.slices) != n or min(self.slices) < 1:
            raise ValueError(f"slices {self.slices} do not cover the {n} tokens to prefill")
        self._ends = [begins_at + sum(self.slices[:i + 1]) for i in range(len(self.slices))]

    def new_sequence(self) -> None:
        """Go on in a new sequence on the daemons (its old one was closed or lost)."""
        self.seq_id = secrets.randbits(63)

    @property
    def max_len(self) -> int:
        return len(self.prompt) + self.max_new_tokens

    @property
    def prefilling(self) -> bool:
        return self.laid_out < len(self.prefix)

    @property
    def waiting_tokens(self) -> int:
        """Prefill tokens not yet sent."""
        return max(0, len(self.prefix) - self.laid_out)

    @property
    def ready(self) -> bool:
        """Whether it can have its next entry scheduled now."""
        if self.stop_reason:
            return False
        return self.prefilling or (self.in_flight == 0 and bool(self.tokens))

    def next_chunk(self) -> int:
        """Tokens from where its prefill stands to the end of its current slice."""
        end = next(e for e in self._ends if e > self.laid_out)
        return end - self.laid_out

    @property
    def finished(self) -> bool:
        return bool(self.stop_reason)
