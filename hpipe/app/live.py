"""What the cluster page shows (``hpipe serve``'s ``/``, ``hpipe run --serve-page``), kept by the
metrics collector's thread and read by the page's one endpoint.

The plan part (stages, units per daemon, predicted compute, links, Seesaw's layouts) is made once.
Every collector round adds what the daemons' ``Status`` said (device, threads, memory held and
free, KV pools), each daemon's busy fraction since the round before (the worker's busy seconds
over the daemon's clock), the requests waiting and running and the answer tokens per second; the
last ``HISTORY_S`` seconds are kept as series, and health changes, recoveries and Seesaw's phase
switches as events. The JSON is encoded once per round, so a page asking for it costs the server
one dictionary lookup and the bytes, never a call to a daemon.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque

from hpipe.core.plan import Plan
from hpipe.core.units import unit_name

#: seconds of history the page's charts show
HISTORY_S = 600
#: events kept (the oldest go first)
EVENTS = 200


def plan_view(plan: Plan) -> dict:
    """The plan as the page draws it: the chosen strategy's stages, the links, Seesaw's layouts."""
    chosen = plan.chosen
    total = sum(st.compute_s for st in chosen.stages) or 1.0
    stages = [{"daemon": st.daemon, "address": st.address, "units": [st.units.start, st.units.end],
               "layers": _layers(st.units.start, st.units.end, plan.model.num_layers),
               "memory_bytes": st.memory_bytes, "memory_limit": st.memory_limit,
               "predicted_share": st.compute_s / total} for st in chosen.stages]
    seesaw = plan.meta.get("seesaw") or {}
    return {"model": plan.model_name, "strategy": chosen.name, "units": plan.model.num_units,
            "micro_batches": chosen.micro_batches, "max_len": plan.max_len, "predicted_s": chosen.predicted_s,
            "stages": stages, "links": list(plan.meta.get("links", [])),
            "seesaw": {k: seesaw[k] for k in ("prefill", "decode", "choice") if k in seesaw} or None}


def _layers(start: int, end: int, num_layers: int) -> str:
    """A unit range by its first and last units' names ("embed … mlp_3")."""
    first, last = unit_name(start, num_layers), unit_name(end - 1, num_layers)
    return first if first == last else f"{first} … {last}"


class Live:
    """The page's state; :meth:`daemon` and :meth:`round` are called by one collector thread,
    :meth:`body` by any."""

    def __init__(self, plan: Plan, every_s: float):
        self.plan = plan_view(plan)
        self._lock = threading.Lock()
        self._series: deque = deque(maxlen=max(2, int(HISTORY_S / every_s)))
        self._events: deque = deque(maxlen=EVENTS)
        self._daemons: dict[str, dict] = {}
        self._busy_seen: dict[str, tuple[float, float]] = {}  # name -> (daemon clock, busy seconds)
        self._tokens_seen = (time.monotonic(), 0)
        self._health, self._state, self._phase = "", "", None
        self._body = b"{}"

    def event(self, kind: str, text: str) -> None:
        with self._lock:
            self._events.append({"t": time.time(), "kind": kind, "text": text})

    def daemon(self, name: str, address: str, reply=None, why: str = "") -> None:
        """What the daemon ``name`` said this round (``reply``: its ``StatusReply``), or why it said nothing."""
        if reply is None:
            self._daemons[name] = {"name": name, "address": address, "up": False, "why": why, "busy": None}
            self._busy_seen.pop(name, None)
            return
        busy = None
        seen = self._busy_seen.get(name)
        if seen is not None and reply.clock_s > seen[0]:
            busy = min(1.0, max(0.0, (reply.busy_s - seen[1]) / (reply.clock_s - seen[0])))
        self._busy_seen[name] = (reply.clock_s, reply.busy_s)
        self._daemons[name] = {
            "name": name, "address": address, "up": reply.loaded, "why": why, "busy": busy,
            "device": reply.device, "device_name": reply.device_name, "threads": reply.threads,
            "weight_bytes": reply.weight_bytes, "kv_bytes": reply.kv_bytes, "resident_bytes": reply.resident_bytes,
            "free_bytes": reply.free_bytes, "memory_budget": reply.memory_budget,
            "pools": [{"stage": p.stage, "used": p.used_blocks, "blocks": p.blocks, "cached": p.cached_blocks}
                      for p in reply.pools]}

    def round(self, *, state: str, health: str, waiting: int, running: int, tokens: int, totals: dict,
              phase: str | None = None, chat: bool = True) -> None:
        """End a round (``tokens``: the engine's count so far; ``phase``: Seesaw's, where it runs; ``chat``:
        whether the server answers chats): one point of every series, events where the state, the
        health or the phase changed, the JSON."""
        now = time.monotonic()
        then, before = self._tokens_seen
        self._tokens_seen = (now, tokens)
        rate = max(0, tokens - before) / (now - then) if now > then else 0.0
        if state != self._state:
            if self._state or state != "ok":
                self.event("state", state)
            self._state = state
        if phase != self._phase:
            if phase is not None:
                self.event("phase", f"Seesaw: the {phase} phase" + (" begins" if self._phase else ""))
            self._phase = phase
        if health != self._health:
            self.event("health" if health else "recovered", health or "every daemon answers and holds the model")
            self._health = health
        daemons = [self._daemons[st["daemon"]] for st in self.plan["stages"] if st["daemon"] in self._daemons]
        daemons = list({d["name"]: d for d in daemons}.values())
        point = {"t": time.time(), "tokens_per_s": rate, "waiting": waiting, "running": running,
                 "busy": {d["name"]: d["busy"] for d in daemons},
                 "kv_used": sum(p["used"] for d in daemons for p in d.get("pools", []))}
        with self._lock:
            self._series.append(point)
            body = {"time": point["t"], "state": state, "health": health or "ok", "plan": self.plan, "chat": chat,
                    "phase": phase,
                    "daemons": daemons, "waiting": waiting, "running": running, "totals": totals,
                    "series": list(self._series), "events": list(self._events)}
            self._body = json.dumps(body, separators=(",", ":")).encode()

    def body(self) -> bytes:
        return self._body
