"""Decode lanes: how many decode micro-batches a pipeline's daemons compute at once.

``gllm`` and Seesaw's decode phase spread decode tokens over ``min(lanes, stages)`` micro-batches
(docs/decisions/scheduler.md): more than the daemons compute at once only pays for more weight reads.
"""

from __future__ import annotations

from hpipe.core.cluster import memory_system


def decode_lane(name: str, host_id: str, device: str, cpus: int = 0, host_cpus: int = 0) -> tuple[str, ...]:
    """Which capacity a daemon decodes with, as a key (``gllm`` spreads decode tokens over the
    lanes, :func:`decode_lanes`). It is the daemon's memory system (:func:`memory_system`: a decode
    step reads every weight, whatever its batch), except for a CPU daemon pinned to ``cpus`` of its
    machine's ``host_cpus`` cores, which computes at its own pace whatever the others do: a lane of
    its own."""
    memory = memory_system(host_id, device)
    if memory[1] == "cpu" and 0 < cpus < host_cpus:
        return (*memory, name)
    return memory


def decode_lanes(daemons: list[tuple[tuple[str, ...], int, int]]) -> int:
    """How many decode micro-batches a pipeline's daemons, each ``(decode_lane key, threads,
    host_cpus)``, compute at once: one per distinct key, except a machine's unpinned CPU daemons
    (one key), which compute as many at once as its cores hold their threads (``host_cpus //
    threads``, one each at most). On ``local-3`` (three daemons of one thread on two cores) one
    micro-batch kept one core computing at a time: 2 lanes made gllm's decode-heavy run 1.3x
    (docs/decisions/scheduler.md)."""
    groups: dict[tuple[str, ...], list[tuple[int, int]]] = {}
    for key, threads, host_cpus in daemons:
        groups.setdefault(key, []).append((threads, host_cpus))
    lanes = 0
    for key, members in groups.items():
        threads, host_cpus = max(t for t, _ in members), max(c for _, c in members)
        unpinned_cpu = len(key) == 2 and key[1] == "cpu"
        lanes += min(len(members), max(1, host_cpus // max(1, threads))) if unpinned_cpu and host_cpus else 1
    return lanes
