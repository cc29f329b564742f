"""``plan.json``: typed, validated, versioned; the runtime can execute any strategy in it.

A plan holds the stages (daemon, unit range, predicted memory), micro-batches and slices of hpipe
and of each baseline, their predicted latencies for the planned length, and hpipe's slicing table for every
supported length (multiples of ``granularity`` up to ``max_len``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from hpipe.core.config import ModelConfig
from hpipe.core.errors import HpipeError
from hpipe.core.schemas import PlanFile, StageFile, validated
from hpipe.core.units import UnitRange, num_layers_of

FORMAT_VERSION = 2


class PlanError(HpipeError):
    pass


@dataclass(frozen=True)
class Stage:
    """A stage of a pipeline: a unit range held by one daemon.

    A daemon may hold several stages of one pipeline (an interleaved chain). The predictions are
    the planner's (0 for stages made without a plan, e.g. from ``--cuts``)."""

    daemon: str            # the daemon's name in the cluster file
    address: str           # where it serves, host:port
    units: UnitRange
    memory_bytes: int = 0  # predicted: weights + KV cache + working space
    memory_limit: int = 0  # what the daemon's device offers
    compute_s: float = 0.0  # predicted compute of this stage over the planned sequence

    def to_dict(self) -> dict[str, Any]:
        """The stage as ``plan.json`` writes it (the range as ``unit_start``, ``unit_end``)."""
        return {"daemon": self.daemon, "address": self.address, "unit_start": self.units.start,
                "unit_end": self.units.end, "memory_bytes": self.memory_bytes, "memory_limit": self.memory_limit,
                "compute_s": self.compute_s}

    @classmethod
    def from_file(cls, s: StageFile, num_layers: int) -> "Stage":
        return cls(s.daemon, s.address, UnitRange(s.unit_start, s.unit_end, num_layers), s.memory_bytes,
                   s.memory_limit, s.compute_s)


def stages_from_cuts(daemons: list[tuple[str, str]], cuts: list[int], num_units: int) -> list[Stage]:
    """``[0, c1), [c1, c2), ...`` on ``daemons`` ((name, address) each, in pipeline order)."""
    layers = num_layers_of(num_units)
    bounds = [0, *cuts, num_units]
    if len(daemons) != len(bounds) - 1:
        raise PlanError(f"{len(bounds) - 1} stages need {len(bounds) - 1} daemons, got {len(daemons)}")
    if any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise PlanError(f"cuts {cuts} must be strictly increasing within (0, {num_units})")
    return [Stage(name, address, UnitRange(a, b, layers)) for (name, address), a, b in zip(daemons, bounds, bounds[1:])]


@dataclass(frozen=True)
class StrategyPlan:
    name: str
    stages: tuple[Stage, ...]
    micro_batches: int
    slices: tuple[int, ...]     # token slices of the planned length
    predicted_s: float

    def __post_init__(self) -> None:
        bounds = [s.units.start for s in self.stages] + [self.stages[-1].units.end] if self.stages else []
        if not self.stages or bounds[0] != 0 or any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise PlanError(f"strategy {self.name}: stages must cover the units contiguously from 0")
        if self.micro_batches < 1 or not self.slices or min(self.slices) < 1:
            raise PlanError(f"strategy {self.name}: micro-batches and slices must be positive")

    @property
    def cuts(self) -> list[int]:
        return [s.units.start for s in self.stages[1:]]


@dataclass(frozen=True)
class Plan:
    model_name: str
    model: ModelConfig
    dtype: str
    batch: int
    seq_len: int
    max_len: int
    granularity: int
    strategy: str                              # the one to execute by default
    strategies: dict[str, StrategyPlan] = field(hash=False)
    slicing: dict[int, tuple[int, ...]] = field(hash=False)  # length -> slices (Algorithm 2), of strategy slicing_for
    ideal_s: float = 0.0
    version: int = FORMAT_VERSION
    meta: dict = field(default_factory=dict, hash=False, compare=False)
    slicing_for: str = "hpipe"  # the strategy whose split the slicing table was made for

    def __post_init__(self) -> None:
        if self.version != FORMAT_VERSION:
            raise PlanError(f"plan format version {self.version} is not supported (expected {FORMAT_VERSION}): "
                            "make it again with `hpipe plan`")
        if self.strategy not in self.strategies:
            raise PlanError(f"plan has no strategy {self.strategy!r}")
        if self.slicing and self.slicing_for not in self.strategies:
            raise PlanError(f"the plan's slicing table is for strategy {self.slicing_for!r}, which it does not have")
        units = self.model.num_units
        for sp in self.strategies.values():
            if sp.stages[-1].units.end != units:
                raise PlanError(f"strategy {sp.name}: stages end at unit {sp.stages[-1].units.end}, the model has {units}")

    @property
    def chosen(self) -> StrategyPlan:
        return self.strategies[self.strategy]

    def slices_for(self, length: int, strategy: str | None = None) -> list[int]:
        """Slice lengths for a document of ``length`` tokens under ``strategy`` (default: the plan's)."""
        name = strategy or self.strategy
        if length < 1:
            raise PlanError("an empty input has no slicing")
        if length > self.max_len:
            raise PlanError(f"input of {length} tokens exceeds the plan's max length {self.max_len}")
        if length == self.seq_len:
            return list(self.strategies[name].slices)  # exactly what was simulated
        if name == self.slicing_for:
            key = min(k for k in self.slicing if k >= length) if length > min(self.slicing) else min(self.slicing)
            return fit_slices(self.slicing[key], length)
        sp = self.strategies[name]
        if len(sp.slices) == 1:
            return [length]
        return uniform(length, min(len(sp.slices), length))

    def slicer(self, strategy: str | None = None):
        """A request's prefill slicing under ``strategy``: the plan's slices for its length, and a
        preempted request's longer prefix (prompt and generated tokens) as that plus one slice for
        the rest."""
        def slices(n: int) -> list[int]:
            if n <= self.max_len:
                return self.slices_for(n, strategy)
            return self.slices_for(self.max_len, strategy) + [n - self.max_len]
        return slices

    # --- JSON -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        def finite(x):
            return x if math.isfinite(x) else None

        return {
            "version": self.version, "model_name": self.model_name, "model": self.model.to_dict(), "dtype": self.dtype,
            "batch": self.batch, "seq_len": self.seq_len, "max_len": self.max_len, "granularity": self.granularity,
            "strategy": self.strategy, "ideal_s": self.ideal_s, "meta": self.meta,
            "strategies": {k: {**asdict(v), "stages": [s.to_dict() for s in v.stages],
                               "predicted_s": finite(v.predicted_s)} for k, v in self.strategies.items()},
            "slicing": {str(k): list(v) for k, v in sorted(self.slicing.items())},
            "slicing_for": self.slicing_for,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "plan") -> "Plan":
        """A plan from ``plan.json``'s contents (``where``: the file, for errors), its keys and
        types checked against :class:`hpipe.core.schemas.PlanFile`."""
        if isinstance(d, dict) and isinstance(d.get("version"), int) and d["version"] != FORMAT_VERSION:
            raise PlanError(f"{where}: plan format version {d['version']} is not supported (expected "
                            f"{FORMAT_VERSION}): make it again with `hpipe plan`")
        f = validated(PlanFile, d, where, PlanError)
        try:
            model = ModelConfig.from_dict(f.model)
            strategies = {k: StrategyPlan(v.name, tuple(Stage.from_file(s, model.num_layers) for s in v.stages),
                                          v.micro_batches, tuple(v.slices),
                                          math.inf if v.predicted_s is None else v.predicted_s)
                          for k, v in f.strategies.items()}
            slicing = f.slicing if f.slicing is not None else (f.schedule or {})
            return cls(f.model_name, model, f.dtype, f.batch, f.seq_len, f.max_len, f.granularity, f.strategy,
                       strategies, {int(k): tuple(v) for k, v in slicing.items()}, f.ideal_s, f.version, dict(f.meta),
                       f.slicing_for if f.slicing is not None or f.schedule_for is None else f.schedule_for)
        except HpipeError as e:
            raise PlanError(f"{where}: {e}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str, where: str = "plan") -> "Plan":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"{where}: not valid JSON ({e})") from None
        return cls.from_dict(raw, where)


def fit_slices(slices: tuple[int, ...], length: int) -> list[int]:
    """Trim a slicing planned for a length >= ``length`` down to exactly ``length`` tokens."""
    out, total = [], 0
    for s in slices:
        if total + s >= length:
            out.append(length - total)
            return out
        out.append(s)
        total += s
    out[-1] += length - total
    return out


def uniform(length: int, k: int) -> list[int]:
    base, rest = divmod(length, k)
    return [base + (1 if i < rest else 0) for i in range(k)]
