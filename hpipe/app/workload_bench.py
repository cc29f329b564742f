"""``hpipe bench --workload``: replay a workload on the live cluster under each policy, side by side.

Each round runs every policy once on the same deployment, their order reversed from one round to
the next, so a machine whose speed drifts slows them alike. A run feeds the requests at their
arrival times (token ids from the workload's seed; every output as long as the workload says:
end-of-sequence ignored) and reports output and total tokens/s, time to first token and time per
output token (p50 and p99), preemptions (swaps into the daemons' host tier, and positions
recomputed), and each stage's busy fraction (compute seconds over the run's span). A policy named
``NAME+recompute`` is that policy with preempted requests recomputed instead of swapped (the
side-by-side for the host tier); ``NAME+whole``, with every sampled row's logits sent whole from
the last stage (the side-by-side for sending a greedy row's top logits only). ``seesaw``
switches between a Seesaw plan's layouts, the KV of the stages a switch moves sent or recomputed
as the plan chose; ``seesaw-send`` and ``seesaw-recompute`` always send it or always recompute it (``seesaw-send-late``: sends it all
at the switch, none while the prefill phase runs; ``seesaw-send-pools``: parks nothing in the host
tier, so a phase's batch is what the pools hold). Greedy outputs must be the same under every
policy; a difference is reported.
"""

from __future__ import annotations

import logging
import statistics
import sys
import threading
import time
from typing import Callable

from hpipe.core.cluster import ClusterSpec
from hpipe.core.errors import HpipeError
from hpipe.core.plan import Plan
from hpipe.core.workload import WorkItem, prompt_ids
from hpipe.model.compute.stage import DTYPES
from runtime.coordinator.deploy import (
    deploy,
    learn_rooms,
    seesaw_kv,
    seesaw_layouts,
    seesaw_phases,
    seesaw_plan_layouts,
)
from runtime.coordinator.engine import Engine, Request
from runtime.coordinator.pipeline import Pipeline
from runtime.coordinator.policies import POLICIES

log = logging.getLogger(__name__)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def run_once(plan: Plan, pipe: Pipeline, items: list[WorkItem], policy: str, seed: int = 0,
             max_running: int = 256, make_policy: Callable[[], object] | None = None) -> dict:
    """One replay of ``items`` under ``policy`` (made by ``make_policy`` where given, for a variant
    of one) on the deployed ``pipe``."""
    session = pipe.session()
    offsets = {c.name: c.clock_offset() for c in pipe.clients}
    name, _, mode = policy.partition("@")[0].partition("+")
    engine = Engine(session, (make_policy or POLICIES[name])(), depth=len(pipe.stages), max_running=max_running,
                    swap=mode != "recompute", top_logits=mode != "whole")
    slicer = plan.slicer()
    done, stop = [0], threading.Event()
    requests: list[Request] = []
    wall0, t0 = time.time(), time.monotonic()

    def finished(r: Request) -> None:
        done[0] += 1
        if done[0] == len(items):
            stop.set()

    def feed() -> None:
        for i, item in enumerate(items):
            delay = t0 + item.arrival_s - time.monotonic()
            if delay > 0 and stop.wait(delay):
                return
            r = Request(prompt_ids(item, i, plan.model.vocab_size, seed), item.output_tokens, slicer=slicer,
                        on_done=finished, arrival_s=max(time.monotonic(), t0 + item.arrival_s))
            requests.append(r)
            engine.add(r)

    feeder = threading.Thread(target=feed, name="workload-feed", daemon=True)
    feeder.start()
    try:
        engine.run(until_idle=False, stop=stop)
    except HpipeError as e:
        engine.fail_all(str(e))
        stop.set()
        raise
    finally:
        feeder.join()
        ended = engine.close()  # every session the run used (a seesaw run switches sessions)
    span = max(r.done_s for r in requests) - t0
    failed = [r.error for r in requests if r.error]
    ttft = [r.first_token_s - r.arrival_s for r in requests if r.first_token_s is not None]
    tpot = [(r.done_s - r.first_token_s) / (len(r.tokens) - 1) for r in requests if len(r.tokens) > 1]
    out_tokens = sum(len(r.tokens) for r in requests)
    in_tokens = sum(len(r.prompt) for r in requests)
    stages, daemons = _busy(ended, len(pipe.stages), span, offsets, wall0)
    phases = _phases(ended, getattr(engine.policy, "switches", None))
    return {"policy": policy, "span_s": round(span, 3), "failed": failed,
            "output_tokens_per_s": round(out_tokens / span, 2), "total_tokens_per_s": round((in_tokens + out_tokens)
                                                                                            / span, 2),
            "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99), "tpot_p50_s": _pct(tpot, 0.5),
            "tpot_p99_s": _pct(tpot, 0.99), "preemptions": engine.preemptions, "swaps": engine.swaps,
            "recomputed": engine.recomputed, "micro_batches": engine.micro_batches,
            "stages": stages, "daemon_busy": daemons, **({"phases": phases} if phases else {}),
            "outputs": [r.tokens for r in requests],
            "log": [[round(m["sent_s"] - t0, 4), round(m["back_s"] - t0, 4), m["prefill"], m["decode"]]
                    for m in engine.log]}


def _busy(ended: list[dict], n_stages: int, span: float, offsets: dict[str, float], wall0: float):
    """Each stage's busy fraction of the run (its compute over every session, whichever daemon
    held it), micro-batches and spans; each daemon's (its stages summed)."""
    stages, daemons = [], {}
    for i in range(n_stages):
        compute, micro_batches, spans, owners = 0.0, 0, [], []
        for e in ended:
            s, d = (e["stats"][i] if i < len(e["stats"]) else {}), e["daemons"][i]
            owners.append(d)
            compute += s.get("compute_s", 0.0)
            micro_batches += s.get("micro_batches", 0)
            daemons[d] = daemons.get(d, 0.0) + s.get("compute_s", 0.0) / span
            at = offsets.get(d, 0.0) + wall0
            spans += [[round(b - at, 5), round(z - at, 5)] for _, _, _, b, z in s.get("spans", ())]
        stages.append({"stage": i, "daemon": "/".join(dict.fromkeys(owners)), "busy": round(compute / span, 4),
                       "micro_batches": micro_batches, "spans": spans})
    return stages, {d: round(v, 4) for d, v in daemons.items()}


def _phases(ended: list[dict], switches: list[dict] | None) -> dict:
    """A run that switched layouts: per phase, its seconds (switches left out) and each daemon's
    busy fraction in them ({} for a run on one session)."""
    if not switches or len(ended) != len(switches) + 1:
        return {}
    names = [{"prefill": "decode", "decode": "prefill"}[switches[0]["to"]]] + [x["to"] for x in switches]
    out: dict[str, dict] = {}
    for name, e in zip(names, ended):
        phase = out.setdefault(name, {"seconds": 0.0, "compute": {}})
        phase["seconds"] += e["seconds"]
        for d, s in zip(e["daemons"], e["stats"]):
            phase["compute"][d] = phase["compute"].get(d, 0.0) + s.get("compute_s", 0.0)
    return {name: {"seconds": round(p["seconds"], 3),
                   "busy": {d: round(c / max(p["seconds"], 1e-9), 4) for d, c in p["compute"].items()}}
            for name, p in out.items()}


def run_workload(plan: Plan, cluster: ClusterSpec, items: list[WorkItem], policies: list[str], rounds: int = 1,
                 seed: int = 0, kv_pool_bytes: int = 0, dequantize: bool = False) -> dict:
    def known(p: str) -> bool:
        name, _, layout = p.partition("@")
        base, _, mode = name.partition("+")
        return (base in POLICIES and mode in ("", "recompute", "whole")
                and layout in ("", "prefill", "decode", *plan.strategies) or p in SEESAW)
    unknown = [p for p in policies if not known(p)]
    if unknown:
        raise HpipeError(f"unknown policies {unknown} (choose from {', '.join(POLICIES)}, each optionally +recompute "
                         "or +whole, and @prefill, @decode or @STRATEGY; or " + ", ".join(SEESAW) + ")")
    with deploy(plan, cluster, kv_pool_bytes=kv_pool_bytes, dequantize=dequantize) as deployed:
        layouts = _layouts(plan, cluster, policies, deployed.recovery.stages)
        return _rounds(plan, deployed.pipe, items, policies, rounds, seed, layouts, kv_pool_bytes)


def _layouts(plan: Plan, cluster: ClusterSpec, policies: list[str], deployed: list) -> dict[str, list]:
    """The stages each policy runs on: the deployed strategy's, another strategy's, one Seesaw
    layout as a plain pipeline, or (``seesaw``) the two layouts' fine stages."""
    out = {}
    for p in policies:
        layout = "seesaw" if p in SEESAW else p.partition("@")[2]
        if layout in ("prefill", "decode"):
            out[p] = seesaw_plan_layouts(plan, cluster)[layout]
        elif layout == "seesaw":
            out[p] = seesaw_layouts(plan, cluster)
        else:
            out[p] = plan.strategies[layout].stages if layout else deployed
    return out


def _rounds(plan: Plan, pipe: Pipeline, items: list[WorkItem], policies: list[str], rounds: int, seed: int,
            layouts: dict, kv_pool_bytes: int) -> dict:
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    dtype = DTYPES[plan.dtype]
    for r in range(rounds):
        for policy in (policies if r % 2 == 0 else policies[::-1]):
            make = None
            if policy in SEESAW:
                pipe.load(plan.model_name, layouts[policy]["prefill"], dtype, kv_pool_bytes, adjacent=True)
                mode, early, park = SEESAW[policy]
                phases = seesaw_phases(pipe, plan.model_name, layouts[policy], dtype, kv_pool_bytes,
                                       sent=seesaw_kv(plan, layouts[policy], mode), early=early, park=park)
                learn_rooms(pipe, plan.model_name, layouts[policy], dtype, kv_pool_bytes, phases)
                make = lambda phases=phases: phases  # noqa: E731
            else:
                pipe.load(plan.model_name, layouts[policy], dtype, kv_pool_bytes)
            result = run_once(plan, pipe, items, "gllm" if policy in SEESAW else policy, seed, make_policy=make)
            if policy in SEESAW:
                result["switches"] = phases.switches
            runs[policy].append(result)
            print(f"[bench] round {r + 1} {policy:<8} {result['total_tokens_per_s']:8.1f} tokens/s "
                  f"({result['span_s']:.1f} s), ttft p50 {result['ttft_p50_s'] or 0:.2f} s, "
                  f"preemptions {result['preemptions']} (swaps {result['swaps']}, recomputed {result['recomputed']})", file=sys.stderr, flush=True)
    reference = runs[policies[0]][0]["outputs"]
    same = {p: [sum(a == b for a, b in zip(run["outputs"], reference)) for run in rs] for p, rs in runs.items()}
    summary = {}
    for p, rs in runs.items():
        med = {k: statistics.median(run[k] for run in rs) for k in ("total_tokens_per_s", "output_tokens_per_s",
                                                                    "span_s")}
        for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"):
            vals = [run[k] for run in rs if run[k] is not None]
            med[k] = statistics.median(vals) if vals else None
        for k in ("preemptions", "swaps", "recomputed"):
            med[k] = sum(run[k] for run in rs)
        med["stage_busy"] = [statistics.median(run["stages"][i]["busy"] for run in rs)
                             for i in range(len(rs[0]["stages"]))]
        med["daemon_busy"] = {d: statistics.median(run["daemon_busy"][d] for run in rs) for d in rs[0]["daemon_busy"]}
        if any("switches" in run for run in rs):  # seesaw: layout switches a run, their seconds
            med["switches"] = statistics.median(len(run["switches"]) for run in rs)
            med["switch_s"] = statistics.median(sum(x["seconds"] for x in run["switches"]) for run in rs)
            for k in ("sent_bytes", "replayed_positions", "restarted", "parked"):  # the KV of the stages switches moved
                med[k] = statistics.median(sum(x.get(k, 0) for x in run["switches"]) for run in rs)
        if all("phases" in run for run in rs):  # and each phase's seconds and busy fractions
            med["phases"] = {ph: {"seconds": statistics.median(run["phases"][ph]["seconds"] for run in rs),
                                  "busy": {d: statistics.median(run["phases"][ph]["busy"].get(d, 0.0) for run in rs)
                                           for d in rs[0]["phases"][ph]["busy"]}}
                             for ph in rs[0]["phases"] if all(ph in run["phases"] for run in rs)}
        med["same_outputs"] = same[p]
        med["failed"] = sum(len(run["failed"]) for run in rs)
        summary[p] = med
    predicted = (plan.meta.get("seesaw") or {}).get("busy") or {}
    return {"requests": len(items), "rounds": rounds, "policies": summary, "runs": runs,
            "stages": [f"{s.daemon} {s.units}" for s in pipe.stages],
            "predicted_busy": {p: predicted[way] for p, way in _WAYS.items() if p in summary and way in predicted}}


#: the planner's names (planner.seesaw) for what a policy of the bench runs on
_WAYS = {"gllm@prefill": "prefill layout", "gllm@decode": "decode layout", "seesaw": "seesaw", "seesaw-send": "seesaw",
         "seesaw-send-late": "seesaw", "seesaw-recompute": "seesaw", "seesaw-send-pools": "seesaw"}
#: the bench's Seesaw policies: how each one's switches move the KV of moved stages
#: (runtime.coordinator.kv_moves.KV_MODES: as the plan chose, always sent, always recomputed),
#: whether a prompt's goes as soon as it is read, and whether a full pool parks prompts in the host tier
SEESAW = {"seesaw": ("plan", True, True), "seesaw-send": ("send", True, True), "seesaw-send-late": ("send", False, True),
          "seesaw-recompute": ("recompute", True, True), "seesaw-send-pools": ("send", True, False)}


def table(result: dict) -> str:
    rows = result["policies"]
    first = next(iter(rows))
    lines = [f"{result['requests']} requests, {result['rounds']} round(s) per policy (medians); stages: "
             + ", ".join(result["stages"]),
             f"{'policy':<15} {'total tok/s':>11} {'out tok/s':>9} {'/ ' + first:>10} {'ttft p50':>9} {'p99':>7} "
             f"{'tpot p50':>9} {'p99':>7} {'preempt':>7} {'swaps':>6} {'recomputed':>10}  same outputs"]
    base = rows[first]["total_tokens_per_s"]
    for p, r in rows.items():
        def s(v):
            return f"{v:.3f}" if v is not None else "-"
        lines.append(f"{p:<15} {r['total_tokens_per_s']:>11.1f} {r['output_tokens_per_s']:>9.1f} "
                     f"{r['total_tokens_per_s'] / base:>10.2f} {s(r['ttft_p50_s']):>9} {s(r['ttft_p99_s']):>7} "
                     f"{s(r['tpot_p50_s']):>9} {s(r['tpot_p99_s']):>7} {r['preemptions']:>7} {r['swaps']:>6} "
                     f"{r['recomputed']:>10}  "
                     + "/".join(f"{n}/{result['requests']}" for n in r["same_outputs"]))
    for p, r in rows.items():
        if "switches" in r:
            lines.append(f"{p}: {r['switches']:.0f} layout switches a run, {r['switch_s']:.2f} s in them; KV of "
                         f"moved stages: {r['sent_bytes'] / 1e6:.1f} MB sent, {r['replayed_positions']:.0f} positions "
                         f"replayed, {r['restarted']:.0f} requests started again; {r['parked']:.0f} requests "
                         "parked in the host tier at a switch")
        for ph, x in r.get("phases", {}).items():
            lines.append(f"{p}, {ph} phase: {x['seconds']:.1f} s, busy " + ", ".join(
                f"{d} {v:.2f}" for d, v in x["busy"].items()))
    for p, predicted in result.get("predicted_busy", {}).items():
        lines.append(f"{p}: busy per daemon, measured (planner's prediction at full load): " + ", ".join(
            f"{d} {rows[p]['daemon_busy'].get(d, 0.0):.2f} ({v:.2f})" for d, v in predicted.items()))
    lines.append("busy fraction per daemon (stages summed): " + "; ".join(
        f"{p}: " + ", ".join(f"{d} {v:.2f}" for d, v in r["daemon_busy"].items()) for p, r in rows.items()))
    lines.append("busy fraction per stage: " + "; ".join(
        f"{p}: " + " ".join(f"{v:.2f}" for v in r["stage_busy"]) for p, r in rows.items()))
    return "\n".join(lines)
