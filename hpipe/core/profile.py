"""``profile.json``: typed, validated, versioned. Pure Python (no torch), shared with the planner.

A profile holds, for one model shape and dtype:

- per device, per unit kind (embed, attn, mlp, head), a measured grid of seconds for a slice of
  ``s`` tokens x batch ``B`` whose context starts at ``c`` (``seconds[b][i][j]`` for
  ``batches[b]``, ``tokens[i]``, ``contexts[j]``; only attention varies with ``c``, the others
  carry a single context column 0). Lookups interpolate linearly inside the grid and extrapolate
  from the last two points outside it; nothing assumes linearity in ``s``.
- per device, the memory it can give to weights + KV cache + working space;
- per directed pair of devices, link latency (s) and bandwidth (bytes/s).

Format version 2 (the model as its Hugging Face ``config.json``, :meth:`ModelConfig.to_dict`). ``Profile.from_dict(p.to_dict()) == p``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from typing import Any

import numpy as np

from hpipe.core.config import ModelConfig
from hpipe.core.errors import HpipeError
from hpipe.core.schemas import GridFile, ProfileFile, validated
from hpipe.core.units import ATTN, EMBED, HEAD, UNIT_KINDS

FORMAT_VERSION = 2
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class ProfileError(HpipeError):
    pass


def interp1(xs, ys, x):
    """Piecewise-linear through (xs, ys), extrapolated from the end segments; ``x`` may be an array.

    Below the smallest measured point the value is never less than proportional scaling of it
    (small slices do not get cheaper than linear), and times are never negative.
    """
    xs = np.asarray(xs, dtype=float)
    ys = np.asarray(ys, dtype=float)
    x = np.asarray(x, dtype=float)
    if len(xs) == 1:
        scale = np.where(x > xs[0], x / max(xs[0], 1e-12), 1.0) if xs[0] else np.ones_like(x)
        return ys[0] * scale
    i = np.clip(np.searchsorted(xs, x), 1, len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    y = np.where(x < xs[0], np.maximum(y, ys[0] * np.maximum(x, 1) / max(xs[0], 1)), y)
    return np.maximum(y, 0.0)


@dataclass(frozen=True)
class ComputeGrid:
    batches: tuple[int, ...]
    tokens: tuple[int, ...]
    contexts: tuple[int, ...]
    seconds: tuple[tuple[tuple[float, ...], ...], ...]  # [batch][tokens][context]

    def __post_init__(self) -> None:
        for name in ("batches", "tokens", "contexts"):
            v = getattr(self, name)
            if not v or list(v) != sorted(set(v)) or min(v) < 0:
                raise ProfileError(f"compute grid {name} must be non-empty, increasing, >= 0: {v}")
        if (len(self.seconds) != len(self.batches) or any(len(r) != len(self.tokens) for r in self.seconds)
                or any(len(c) != len(self.contexts) for r in self.seconds for c in r)):
            raise ProfileError("compute grid seconds do not match its axes")
        if any(t < 0 for r in self.seconds for c in r for t in c):
            raise ProfileError("negative time in compute grid")

    def plane(self, b: float) -> np.ndarray:
        """The [tokens, context] grid interpolated at batch ``b`` (cached per batch)."""
        return _plane(self, float(b))

    def times(self, s, c, b: float):
        """Seconds for slices of ``s`` tokens at contexts ``c`` (arrays of equal shape), batch ``b``."""
        plane = self.plane(b)
        s = np.asarray(s, dtype=float)
        c = np.asarray(c, dtype=float)
        per_context = np.stack([interp1(self.tokens, plane[:, j], s) for j in range(len(self.contexts))])
        if len(self.contexts) == 1:
            return per_context[0]
        xs = np.asarray(self.contexts, dtype=float)
        i = np.clip(np.searchsorted(xs, c), 1, len(xs) - 1)
        x0, x1 = xs[i - 1], xs[i]
        y0 = np.take_along_axis(per_context, (i - 1)[None, ...], 0)[0]
        y1 = np.take_along_axis(per_context, i[None, ...], 0)[0]
        return np.maximum(y0 + (y1 - y0) * (c - x0) / (x1 - x0), 0.0)

    def time(self, s: float, c: float, b: float) -> float:
        return float(self.times(np.array([s]), np.array([c]), b)[0])

    @classmethod
    def from_dict(cls, d: dict) -> "ComputeGrid":
        return cls.from_file(validated(GridFile, d, "compute grid", ProfileError))

    @classmethod
    def from_file(cls, g: GridFile) -> "ComputeGrid":
        return cls(tuple(g.batches), tuple(g.tokens), tuple(g.contexts),
                   tuple(tuple(tuple(float(x) for x in c) for c in r) for r in g.seconds))


@lru_cache(maxsize=4096)
def _plane(grid: ComputeGrid, b: float) -> np.ndarray:
    seconds = np.asarray(grid.seconds, dtype=float)  # [batch, tokens, context]
    flat = seconds.reshape(len(grid.batches), -1)
    return np.stack([interp1(grid.batches, flat[:, k], b) for k in range(flat.shape[1])]).reshape(
        len(grid.tokens), len(grid.contexts))


@dataclass(frozen=True)
class DaemonProfile:
    name: str
    address: str
    device: str
    memory_bytes: int  # what it can give to weights + KV cache + working space
    compute: dict[str, ComputeGrid] = field(hash=False)
    fingerprint: str = ""

    def __post_init__(self) -> None:
        missing = [k for k in UNIT_KINDS if k not in self.compute]
        if missing:
            raise ProfileError(f"daemon {self.name}: no compute grid for {missing}")
        if self.memory_bytes <= 0:
            raise ProfileError(f"daemon {self.name}: memory_bytes must be > 0")

    def scaled(self, factor: float) -> "DaemonProfile":
        """This device computing ``factor`` times slower (every grid point scaled; links untouched)."""
        if not (factor > 0 and math.isfinite(factor)):
            raise ProfileError(f"daemon {self.name}: speed factor must be finite and > 0, got {factor}")
        if factor == 1.0:
            return self
        grids = {k: ComputeGrid(g.batches, g.tokens, g.contexts,
                                tuple(tuple(tuple(t * factor for t in row) for row in plane) for plane in g.seconds))
                 for k, g in self.compute.items()}
        return replace(self, compute=grids)


@dataclass(frozen=True)
class LinkProfile:
    src: str
    dst: str
    latency_s: float
    bandwidth_Bps: float
    # CPU seconds a message costs the sending and the receiving daemon's host outside its device
    # worker (serialisation, RPC, the kernel's network stack): per message plus per byte. 0 where
    # unmeasured (profiles before these fields, what-if profiles).
    send_cpu_s: float = 0.0
    send_cpu_s_per_byte: float = 0.0
    recv_cpu_s: float = 0.0
    recv_cpu_s_per_byte: float = 0.0

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.bandwidth_Bps <= 0:
            raise ProfileError(f"link {self.src}->{self.dst}: latency must be >= 0 and bandwidth > 0")
        if min(self.send_cpu_s, self.send_cpu_s_per_byte, self.recv_cpu_s, self.recv_cpu_s_per_byte) < 0:
            raise ProfileError(f"link {self.src}->{self.dst}: host CPU costs must be >= 0")

    def time(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_Bps

    def send_cpu(self, nbytes):
        return self.send_cpu_s + nbytes * self.send_cpu_s_per_byte

    def recv_cpu(self, nbytes):
        return self.recv_cpu_s + nbytes * self.recv_cpu_s_per_byte


@dataclass(frozen=True)
class Profile:
    model: ModelConfig
    model_name: str
    dtype: str
    daemons: tuple[DaemonProfile, ...]
    links: tuple[LinkProfile, ...]
    source: str = "measured"  # or "simulated"
    version: int = FORMAT_VERSION
    meta: dict = field(default_factory=dict, hash=False, compare=False)
    weight_bits: float = 0.0  # bits per weight of the matrices as the daemons hold them (0: the dtype's)

    def __post_init__(self) -> None:
        if self.version != FORMAT_VERSION:
            raise ProfileError(f"profile format version {self.version} is not supported (expected {FORMAT_VERSION}): "
                               "measure it again with `hpipe profile`")
        if self.dtype not in DTYPE_BYTES:
            raise ProfileError(f"profile dtype {self.dtype!r} unknown")
        if not 0 <= self.weight_bits <= 32:
            raise ProfileError(f"weight_bits must lie in [0, 32], got {self.weight_bits}")
        names = [d.name for d in self.daemons]
        if len(set(names)) != len(names):
            raise ProfileError(f"duplicate daemon names in profile: {names}")
        pairs = {(l.src, l.dst) for l in self.links}
        missing = [(a, b) for a in names for b in names if a != b and (a, b) not in pairs]
        if missing:
            raise ProfileError(f"profile lacks links {missing[:4]}")

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def daemon(self, name: str) -> DaemonProfile:
        for d in self.daemons:
            if d.name == name:
                return d
        raise ProfileError(f"no daemon {name!r} in the profile")

    def scaled(self, factors: dict[str, float]) -> "Profile":
        """The profile with each named device's compute scaled by its factor (> 1: slower)."""
        unknown = sorted(set(factors) - {d.name for d in self.daemons})
        if unknown:
            raise ProfileError(f"no daemon {', '.join(unknown)} in the profile")
        return replace(self, daemons=tuple(d.scaled(factors.get(d.name, 1.0)) for d in self.daemons))

    def without(self, names) -> "Profile":
        """The profile with the named daemons (and their links) left out: what a pipeline that
        lost them can be re-planned on."""
        gone = set(names)
        unknown = sorted(gone - {d.name for d in self.daemons})
        if unknown:
            raise ProfileError(f"no daemon {', '.join(unknown)} in the profile")
        if gone >= {d.name for d in self.daemons}:
            raise ProfileError("no daemon would be left")
        return replace(self, daemons=tuple(d for d in self.daemons if d.name not in gone),
                       links=tuple(l for l in self.links if l.src not in gone and l.dst not in gone))

    def link(self, src: str, dst: str) -> LinkProfile:
        for l in self.links:
            if l.src == src and l.dst == dst:
                return l
        raise ProfileError(f"no link {src}->{dst} in the profile")

    # --- memory, from the model shape ---------------------------------------------------
    def matrix_bytes(self, weights: int) -> int:
        """Bytes ``weights`` matrix entries take as the daemons hold them (quantized: as stored)."""
        return int(weights * self.weight_bits / 8) if self.weight_bits else weights * self.itemsize

    def unit_weight_bytes(self, kind: str) -> int:
        m, it = self.model, self.itemsize
        if kind == EMBED:
            return self.matrix_bytes(m.vocab_size * m.hidden_size)
        if kind == HEAD:
            return self.matrix_bytes(m.vocab_size * m.hidden_size) + m.hidden_size * it
        # the norms' vectors: before each unit, after it too (Gemma), per head for q and k (Qwen3, Gemma)
        norms = m.hidden_size * (2 if m.sandwich_norms else 1)
        if kind == ATTN:
            qkv = m.hidden_size * m.head_dim * (m.num_heads + 2 * m.num_kv_heads)
            bias = m.head_dim * (m.num_heads + 2 * m.num_kv_heads) if m.qkv_bias else 0
            norms += 2 * m.head_dim if m.qk_norm else 0
            return self.matrix_bytes(qkv + m.num_heads * m.head_dim * m.hidden_size) + (bias + norms) * it
        return self.matrix_bytes(3 * m.hidden_size * m.intermediate_size) + norms * it

    def kv_bytes_per_token_per_layer(self) -> int:
        return 2 * self.model.num_kv_heads * self.model.head_dim * self.itemsize

    def activation_bytes_per_token(self) -> int:
        return self.model.hidden_size * self.itemsize

    # --- JSON -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version, "source": self.source, "model_name": self.model_name, "dtype": self.dtype,
            "model": self.model.to_dict(), "meta": self.meta,
            "daemons": [{"name": d.name, "address": d.address, "device": d.device, "memory_bytes": d.memory_bytes,
                         "fingerprint": d.fingerprint,
                         "compute": {k: asdict(g) for k, g in d.compute.items()}} for d in self.daemons],
            "links": [asdict(l) for l in self.links],
            **({"weight_bits": self.weight_bits} if self.weight_bits else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "profile") -> "Profile":
        """A profile from ``profile.json``'s contents (``where``: the file, for errors), its keys
        and types checked against :class:`hpipe.core.schemas.ProfileFile`."""
        _check_version(d, where)
        f = validated(ProfileFile, d, where, ProfileError)
        try:
            devices = tuple(DaemonProfile(x.name, x.address, x.device, x.memory_bytes,
                                          {k: ComputeGrid.from_file(g) for k, g in x.compute.items()}, x.fingerprint)
                            for x in f.daemons)
            links = tuple(LinkProfile(**l.model_dump()) for l in f.links)
            return cls(ModelConfig.from_dict(f.model), f.model_name, f.dtype, devices, links, f.source, f.version,
                       dict(f.meta), f.weight_bits)
        except HpipeError as e:
            raise ProfileError(f"{where}: {e}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str, where: str = "profile") -> "Profile":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProfileError(f"{where}: not valid JSON ({e})") from None
        return cls.from_dict(raw, where)


def _check_version(d, where: str) -> None:
    """An older or newer format says so before its keys are checked."""
    if isinstance(d, dict) and isinstance(d.get("version"), int) and d["version"] != FORMAT_VERSION:
        raise ProfileError(f"{where}: profile format version {d['version']} is not supported (expected "
                           f"{FORMAT_VERSION}): measure it again with `hpipe profile`")
