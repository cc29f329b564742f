"""The model as a chain of units: ``embed, attn_0, mlp_0, ..., attn_{L-1}, mlp_{L-1}, head``.

Between any two units only the residual stream ``[batch, tokens, hidden]`` flows, so a stage may
start or end between the attention and the MLP of one block. Ranges are half-open ``[start, end)``
everywhere in hpipe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from hpipe.core.errors import InputError

EMBED, ATTN, MLP, HEAD = "embed", "attn", "mlp", "head"
UNIT_KINDS = (EMBED, ATTN, MLP, HEAD)


def num_units(num_layers: int) -> int:
    """Units of a model of ``num_layers`` blocks: embed, (attn, mlp) per block, head."""
    return 2 * num_layers + 2


def num_layers_of(units: int) -> int:
    """The blocks of a model of ``units`` units (the inverse of :func:`num_units`)."""
    if units < 2 or units % 2:
        raise InputError(f"{units} units are no model's: a model has 2 x blocks + 2")
    return (units - 2) // 2


def unit_kind(unit: int, num_layers: int) -> tuple[str, int | None]:
    """The kind of ``unit`` and its layer index (None for embed and head)."""
    last = num_units(num_layers) - 1
    if unit == 0:
        return EMBED, None
    if unit == last:
        return HEAD, None
    if 0 < unit < last:
        layer, rest = divmod(unit - 1, 2)
        return (ATTN if rest == 0 else MLP), layer
    raise InputError(f"unit {unit} is outside the model's units [0, {last + 1})")


def block_units(layer: int) -> tuple[int, int]:
    """Block ``layer``'s units: its attention, then its MLP (the inverse of :func:`unit_kind`)."""
    return 1 + 2 * layer, 2 + 2 * layer


def unit_kinds(num_layers: int) -> list[str]:
    """The kind of every unit of the model, in order."""
    return [unit_kind(u, num_layers)[0] for u in range(num_units(num_layers))]


def kind_counts(start: int, end: int, num_layers: int) -> tuple[int, int, int, int]:
    """(embed, attn, mlp, head) units in ``[start, end)``."""
    kinds = unit_kinds(num_layers)[start:end]
    return tuple(kinds.count(k) for k in UNIT_KINDS)


def unit_name(unit: int, num_layers: int) -> str:
    kind, layer = unit_kind(unit, num_layers)
    return kind if layer is None else f"{kind}_{layer}"


@dataclass(frozen=True)
class UnitRange:
    """Half-open range ``[start, end)`` of units of a model with ``num_layers`` blocks."""

    start: int
    end: int
    num_layers: int

    def __post_init__(self) -> None:
        total = num_units(self.num_layers)
        if not (0 <= self.start < self.end <= total):
            raise InputError(
                f"unit range [{self.start}, {self.end}) is outside the model's units [0, {total}) "
                "or empty"
            )

    @classmethod
    def full(cls, num_layers: int) -> "UnitRange":
        return cls(0, num_units(num_layers), num_layers)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end))

    def __len__(self) -> int:
        return self.end - self.start

    @property
    def has_embed(self) -> bool:
        return self.start == 0

    @property
    def has_head(self) -> bool:
        return self.end == num_units(self.num_layers)

    def attention_layers(self) -> list[int]:
        return [layer for u in self for kind, layer in [unit_kind(u, self.num_layers)] if kind == ATTN]

    def __str__(self) -> str:
        return f"[{self.start}, {self.end})"


def even_cuts(units: int, stages: int) -> list[int]:
    """Cut points that split ``units`` units into ``stages`` near-equal contiguous ranges."""
    if not 1 <= stages <= units:
        raise InputError(f"cannot split {units} units into {stages} stages")
    return [round(i * units / stages) for i in range(1, stages)]


def ranges_from_cuts(cuts: list[int], num_layers: int) -> list[UnitRange]:
    """``[0, c1), [c1, c2), ..., [ck, total)``; cuts must be strictly increasing inside the model."""
    total = num_units(num_layers)
    bounds = [0, *cuts, total]
    for a, b in zip(bounds, bounds[1:]):
        if not a < b:
            raise InputError(f"cuts {cuts} must be strictly increasing within (0, {total})")
    return [UnitRange(a, b, num_layers) for a, b in zip(bounds, bounds[1:])]
