"""A Seesaw switch's KV: sent from the daemons that give stages up to the ones that take them.

Design note (docs/decisions/seesaw.md). A layout switch moves fine stages between daemons
(:mod:`runtime.coordinator.seesaw`). For each moved stage the KV of the running requests either
travels (the old owner sends it to the new one before the switch's ``Load``:
:mod:`runtime.daemon.kv_transfer`) or is recomputed after it by replays
(:mod:`runtime.coordinator.resume`). The planner prices both for each run of moved units and
records its choice in the plan (``hpipe plan --objective seesaw``); :func:`sent_stages` reads it
back for the fine stages. A send that fails leaves those stages to the replays: nothing is lost
but the time.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import grpc

from hpipe.core.plan import Stage
from runtime.wire.messages import pb

log = logging.getLogger(__name__)

#: the ways a switch's KV may go: as the plan says, always sent, always recomputed
KV_MODES = ("plan", "send", "recompute")
#: how long one daemon's KV may take to reach the others
SEND_TIMEOUT_S = 900.0


def sent_stages(mode: str, fine: Sequence[Stage], runs: list[dict] | None) -> set[int]:
    """The fine stages whose KV a switch sends: every one (``send``), none (``recompute``), or
    (``plan``) those inside a run of moved units the planner chose to send (``runs``, the plan's
    ``seesaw.switch.runs``; none without them: a plan made before the choice was recorded)."""
    if mode not in KV_MODES:
        raise ValueError(f"a switch's KV is one of {', '.join(KV_MODES)}, not {mode!r}")
    if mode != "plan":
        return set(range(len(fine))) if mode == "send" else set()
    chosen = [r["units"] for r in runs or [] if r.get("kv") == "send"]
    return {i for i, s in enumerate(fine) if any(a <= s.units.start < b for a, b in chosen)}


def send_moved_kv(pipe, session, target: Sequence[Stage], which: set[int],
                  sequence_ids: list[int] | None = None) -> dict:
    """Before ``pipe`` (loaded with the fine stages ``session`` runs on) switches to ``target``:
    each daemon that gives up a stage of ``which`` sends the session's KV on it (of
    ``sequence_ids``, or of all its sequences) to the daemon that takes it, all pairs of daemons
    at once. What was sent (bytes, stages, sequences, seconds)."""
    pairs: dict[tuple[int, str], list[int]] = {}
    for i, (now, then) in enumerate(zip(pipe.stages, target)):
        if now.daemon != then.daemon and i in which and sequence_ids != []:
            pairs.setdefault((pipe.stage_daemon[i], then.address), []).append(i)

    def send(item) -> tuple[int, int, int]:
        (d, address), stages = item
        client = pipe.clients[d]
        request = pb.SendKvRequest(session=session.id, key=session.key, stages=stages, target_address=address,
                                   sequence_ids=sequence_ids or [])
        try:
            reply = client.call("SendKv", request, timeout=SEND_TIMEOUT_S)
        except grpc.RpcError as e:
            log.warning("%s could not send the KV of stages %s to %s (%s: %s); replays rebuild it", client.name,
                        stages, address, e.code().name, e.details())
            return 0, 0, 0
        return reply.bytes, len(stages), reply.sequences

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, len(pairs))) as pool:
        done = list(pool.map(send, pairs.items()))
    return {"sent_bytes": sum(d[0] for d in done), "sent_stages": sum(d[1] for d in done),
            "sent_sequences": max((d[2] for d in done), default=0), "send_s": round(time.monotonic() - t0, 4)}
