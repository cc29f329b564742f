"""Daemons that share one GPU get a share of its memory each, unless the cluster file sizes them.

A GPU daemon without a memory budget sizes its KV pools from the memory free when it loads (most
of it: :mod:`runtime.daemon.deployment`). Alone on its card that is what a user wants; beside
other daemons on the same card (CUDA MPS clusters such as ``clusters/mps-3.yaml``, or several
daemons on one GPU for a test) the first to load would take the card and the others fail. So a
cluster file's daemons on one machine and one CUDA device that set neither ``memory_budget`` nor
``memory_share`` get a ``memory_share``: their ``emulate.gpu_share`` where every one of them sets
it (scaled down where the percentages add up to more than 100), else equal parts.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace


def machine_of(daemon) -> str:
    """The machine a daemon of a cluster file runs on: its SSH host, or this one."""
    to = daemon.ssh.get("to") if daemon.ssh else None
    return to.split("@", 1)[1] if to else ""


def _percent(value) -> float | None:
    """A ``gpu_share`` as a number (None when absent or not one: the emulation's checks say so)."""
    try:
        return float(value) if value is not None and not isinstance(value, bool) else None
    except (TypeError, ValueError):
        return None


def with_memory_shares(daemons: list) -> tuple:
    """``daemons`` (``DaemonSpec``), those that share a GPU with others and set no memory size
    given a ``memory_share`` (see the module's note)."""
    groups = defaultdict(list)
    for i, d in enumerate(daemons):
        if d.device.startswith("cuda"):
            groups[machine_of(d), d.device].append(i)
    out = list(daemons)
    for members in groups.values():
        if len(members) < 2:
            continue
        shares = [_percent(daemons[i].emulate.get("gpu_share")) for i in members]
        if all(s is not None for s in shares):
            whole = max(100.0, sum(shares))
            parts = [s / whole for s in shares]
        else:
            parts = [1.0 / len(members)] * len(members)
        for i, part in zip(members, parts):
            if daemons[i].memory_budget is None and daemons[i].memory_share is None:
                out[i] = replace(daemons[i], memory_share=part)
    return tuple(out)
