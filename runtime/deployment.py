"""What a daemon holds: the stages of a deployment, loaded, and the memory checks before anything is.

A deployment is the whole pipeline's stages plus the indices of the ones this daemon holds (one,
or several for an interleaved chain); each held stage's successor is the next stage of the
pipeline. Weights are checked against the daemon's memory budget and the device's free memory
before they are read, so an over-large stage is refused with ``RESOURCE_EXHAUSTED``, not an
out-of-memory crash.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from hpipe.core.config import ModelConfig
from hpipe.core.errors import StatusError
from hpipe.core.plan import Stage
from hpipe.core.shapes import is_random, random_config
from hpipe.core.units import UnitRange
from hpipe.model import StageModel
from hpipe.model.layers import build_unit
from hpipe.model.sources import resolve_model
from runtime import memory

log = logging.getLogger(__name__)

#: sends one slice to the successor:
#: (sequence_id, stage index, start, length, payload bytes, all_logits, want_logits) -> None
SendFn = Callable[[int, int, int, int, bytes, bool, bool], None]


@dataclass(frozen=True)
class Deployment:
    model: str
    dtype: torch.dtype
    stages: tuple[Stage, ...]  # the whole pipeline, in order
    held: tuple[int, ...]      # indices of the stages this daemon holds


@dataclass
class LoadedStage:
    """A held stage: its units' model and its sender to the successor (None: it holds the head)."""
    index: int
    stage: Stage
    model: StageModel
    successor: Stage | None
    send: SendFn | None

    @property
    def units(self) -> UnitRange:
        return self.model.units


def check_memory(device: torch.device, budget: int | None, in_use: int, new_bytes: int, what: str) -> None:
    """Refuse ``new_bytes`` more (``RESOURCE_EXHAUSTED``) past the budget or 90% of the free memory."""
    if budget is not None and in_use + new_bytes > budget:
        raise StatusError("RESOURCE_EXHAUSTED", f"{what} need {mib(new_bytes)}; {mib(in_use)} of the {mib(budget)} "
                          "memory budget are in use")
    available = memory.available(device)
    if new_bytes > 0.9 * available:
        raise StatusError("RESOURCE_EXHAUSTED", f"{what} need {mib(new_bytes)}; the device has {mib(available)} free")


def validate(dep: Deployment, cfg: ModelConfig) -> list[UnitRange]:
    """The unit ranges of the held stages, refusing a deployment that is not a pipeline of this model."""
    if not dep.held:
        raise StatusError("INVALID_ARGUMENT", "a deployment needs at least one stage to hold")
    ends = [0] + [s.unit_end for s in dep.stages]
    if ends[-1] != cfg.num_units or any(s.unit_start != end for s, end in zip(dep.stages, ends)):
        raise StatusError("INVALID_ARGUMENT", f"stages {', '.join(s.units for s in dep.stages)} do not cover the "
                          f"model's units [0, {cfg.num_units}) in order")
    if len(set(dep.held)) != len(dep.held) or not all(0 <= i < len(dep.stages) for i in dep.held):
        raise StatusError("INVALID_ARGUMENT", f"held stages {list(dep.held)} are not distinct stage indices")
    return [UnitRange(dep.stages[i].unit_start, dep.stages[i].unit_end, cfg.num_layers) for i in dep.held]


def model_config(model: str) -> ModelConfig:
    return random_config(model) if is_random(model) else resolve_model(model).config


def load(dep: Deployment, device: torch.device, connect: Callable[[str], SendFn] | None,
         check: Callable[[int, str], None]) -> dict[int, LoadedStage]:
    """Build every held stage (``check(bytes, what)`` first refuses what does not fit)."""
    cfg = model_config(dep.model)
    ranges = validate(dep, cfg)
    weights = sum(p.numel() for u in ranges for p in unit_params(cfg, u)) * dep.dtype.itemsize
    check(weights, f"the weights of units {', '.join(map(str, ranges))}")
    source = None if is_random(dep.model) else resolve_model(dep.model)
    loaded = {}
    for i, units in zip(dep.held, ranges):
        if source is None:  # random:NAME: this daemon creates its own units' weights
            model = StageModel.random(cfg, units, dtype=dep.dtype, device=device)
        else:
            model = StageModel.from_checkpoint(source.weights(), cfg, units, dtype=dep.dtype, device=device)
        successor = dep.stages[i + 1] if i + 1 < len(dep.stages) else None
        send = connect(successor.address) if successor is not None and connect else None
        loaded[i] = LoadedStage(i, dep.stages[i], model, successor, send)
    return loaded


def unit_params(cfg: ModelConfig, units: UnitRange) -> list:
    """Parameter shapes of ``units`` without allocating them (meta tensors)."""
    with torch.device("meta"):
        seen = []
        for u in units:
            seen.extend(build_unit(cfg, u).parameters())
        if cfg.tie_word_embeddings and units.has_embed and units.has_head:
            seen.pop()  # the LM head shares the embedding's tensor
    return seen


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
