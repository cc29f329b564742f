"""Compute grids cached on disk, so that re-profiling unchanged devices is instant.

A grid is keyed by what determines it: how the daemon measures (:data:`profiler.grid.METHOD`), the
model's shape, the dtype, the grid's axes and sweeps, the device's fingerprint, and, for grids
measured beside co-located daemons, the fingerprints of that whole group.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import asdict
from pathlib import Path

from hpipe.core.paths import cache_root
from hpipe.core.profile import ComputeGrid


def grid_path(key_parts: list, fingerprint: str, group_prints: list[str] | None) -> Path:
    """Where the grid measured with ``key_parts`` on a device of ``fingerprint`` is cached."""
    key = hashlib.sha256(json.dumps(key_parts + [fingerprint, group_prints], sort_keys=True).encode()).hexdigest()[:20]
    return cache_root() / "profiles" / f"{key}.json"


def load_grids(path) -> dict[str, ComputeGrid]:
    return {k: ComputeGrid.from_dict(g) for k, g in json.loads(path.read_text()).items()}


def store_grids(path, grids: dict[str, ComputeGrid]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps({k: asdict(g) for k, g in grids.items()}))
    tmp.replace(path)  # atomic: daemons of one fingerprint measured together write the same key
