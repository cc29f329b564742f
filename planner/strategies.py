"""hpipe and the baselines, all as schedules of one form, evaluated by the exact simulator.

- **base**: even split over all devices in profile order, the whole batch as one item: no pipelining.
- **gpipe**: even split, the batch cut into micro-batches (best count among divisors of B).
- **gp_b**: hpipe's split (Algorithm 1), micro-batches as GPipe.
- **terapipe**: even split, uniform token slices (best count).
- **throughput** (only when a request mix is given): the split whose busiest daemon does the least
  per request of the mix, prefill and decode (:mod:`planner.serving`), sliced by Algorithm 2.
- **hpipe**: the best simulated schedule among: {Algorithm-1 split, even split} x {micro-batch
  counts} x {Algorithm-2 slicing, uniform slicings} (and, when allowed, the splits interleaved:
  each device holding 2 or 3 unit ranges in rounds, :func:`interleave`), the best few polished by a
  local search over cuts and slices under the simulator (:mod:`planner.refine`). Its candidates
  include every baseline's, so its prediction is never worse than theirs; the simulator, not the
  DP estimate, decides.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import numpy as np

from hpipe.core.plan import Plan, Stage, StrategyPlan, fit_slices, uniform
from hpipe.core.profile import Profile
from hpipe.core.units import UnitRange, even_cuts
from planner.costs import CostModel, Workload
from planner.cuts import InfeasibleError, best_cuts
from planner.refine import refine
from planner.serving import Mix, daemon_loads, serving_cuts, serving_table
from planner.simulator import Timeline, simulate
from planner.slicing import GRANULARITY, CostStage, slicing_table

MAX_UNIFORM_SLICES = 64
REFINE_STARTS = 3      # the local search polishes the best few starting schedules
#: schedules the local search simulates from each starting point: the budget that decides, so that a
#: plan does not depend on how busy the machine was (docs/planner.md: 2000 reached 4.313 s on a
#: profile where 4000 reached 4.302 and 10000 4.272)
REFINE_EVALS = 4000
REFINE_CAP_S = 2.5     # wall-clock cap per starting point: binds only on long schedules (many slices x micro-batches)
INTERLEAVE = (2, 3)    # ranges per device tried for interleaved schedules
MAX_RANGES = 3         # the most unit ranges hpipe gives one device unless told otherwise


@dataclass(frozen=True)
class Candidate:
    bounds: tuple[int, ...]
    daemons: tuple[int, ...]
    micro_batches: int
    slices: tuple[int, ...]
    makespan: float


def items(slices, micro_batches: int):
    """(tokens, context, is last slice of its micro-batch) of every item, in pipeline order."""
    out = []
    for _ in range(micro_batches):
        c = 0
        for i, s in enumerate(slices):
            out.append((s, c, i == len(slices) - 1))
            c += s
    return out


def _item_arrays(slices, micro_batches: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`items` as arrays: tokens, context, and whether each is its micro-batch's last slice."""
    its = items(slices, micro_batches)
    return (np.array([s for s, _, _ in its], dtype=float), np.array([c for _, c, _ in its], dtype=float),
            np.array([x for _, _, x in its], dtype=bool))


def stage_computes(cost: CostModel, work: Workload, bounds, devices, micro_batches: int, slices) -> list[np.ndarray]:
    """Compute seconds of every item on every stage: ``[stage][item]``.

    One item (one micro-batch, unsliced) never has two stages computing at once, so each device
    runs at its speed alone: its co-location factor is taken out. At co-located speeds, Base ran
    0.84-0.88x its prediction on the emulated cluster.
    """
    return _computes(cost, work, bounds, devices, micro_batches, *_item_arrays(slices, micro_batches))


def _computes(cost: CostModel, work: Workload, bounds, devices, micro_batches: int, s_arr, c_arr, last):
    out, b, n = [], work.batch // micro_batches, len(devices)
    for j, (a, e) in enumerate(zip(bounds, bounds[1:])):
        t = cost.stage_times(devices[j], a, e, s_arr, c_arr, b, head=last)
        t = t * cost.alone_scale[devices[j]] if len(s_arr) == 1 else t
        prev, nxt = devices[j - 1] if j > 0 else None, devices[j + 1] if j + 1 < n else None
        out.append(t + cost.host_times(devices[j], prev, nxt, s_arr, b))
    return out


def simulate_schedule(cost: CostModel, work: Workload, bounds, devices, micro_batches: int, slices,
                      keep: bool = False) -> float | Timeline:
    s_arr, c_arr, last = _item_arrays(slices, micro_batches)
    comp = [t.tolist() for t in _computes(cost, work, bounds, devices, micro_batches, s_arr, c_arr, last)]
    comm = [np.broadcast_to(cost.comm_time(devices[j], devices[j + 1], s_arr, work.batch // micro_batches),
                            s_arr.shape).tolist() for j in range(len(devices) - 1)]
    return simulate(comp, comm, keep=keep, devices=devices)


def answer_token_s(cost: CostModel, work: Workload, bounds, devices) -> float:
    """Seconds one answer token takes through the chain: each stage computing one token of every
    sequence (alone, as in decode only one stage of a sequence computes at a time) at the answer's
    mean context, its host's cost of the hops in and out, and every link between stages. A chain
    that interleaves unit ranges pays every extra hop here once per token, where prefill pays it
    once per slice."""
    one, ctx = np.ones(1), np.array([float(min(work.seq_len + work.output_len / 2, work.kv_len))])
    compute = _computes(cost, work, bounds, devices, 1, one, ctx, np.ones(1, dtype=bool))
    hops = sum(float(cost.comm_time(devices[j], devices[j + 1], 1, work.batch)) for j in range(len(devices) - 1))
    return sum(float(t[0]) for t in compute) + hops


def _with_answer(cost: CostModel, work: Workload, cand: Candidate) -> float:
    """What ``cand`` is chosen by: its prefill's makespan, plus its answer's decode if the workload has one."""
    if not work.output_len:
        return cand.makespan
    return cand.makespan + work.output_len * answer_token_s(cost, work, cand.bounds, cand.daemons)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _fits(cost: CostModel, work: Workload, bounds, devices) -> bool:
    """Whether every device holds its stages: summed over the stages of a device (interleaved)."""
    need: dict[int, int] = {}
    for j, (a, b) in enumerate(zip(bounds, bounds[1:])):
        need[devices[j]] = need.get(devices[j], 0) + cost.stage_memory(a, b, work)
    return all(n <= cost.daemons[d].memory_bytes for d, n in need.items())


def interleave(bounds: tuple[int, ...], devices: tuple[int, ...],
               v: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The chain ``A1 B1 C1 A2 B2 C2 ...``: each stage of ``bounds`` cut into ``v`` parts, in rounds.

    Device j keeps about the units it had (its share split evenly over its ``v`` parts); None when
    there is one stage, or some stage has fewer than ``v`` units.
    """
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    if v < 2 or len(sizes) < 2 or min(sizes) < v:
        return None
    parts = [[n // v + (1 if r < n % v else 0) for r in range(v)] for n in sizes]
    out, chain = [0], []
    for r in range(v):
        for j, dev in enumerate(devices):
            out.append(out[-1] + parts[j][r])
            chain.append(dev)
    return tuple(out), tuple(chain)


def _best(cost, work, bounds, devices, mbs, slicings) -> Candidate:
    best = None
    for m in mbs:
        for sl in slicings(m):
            t = simulate_schedule(cost, work, bounds, devices, m, sl)
            if best is None or t < best.makespan:
                best = Candidate(tuple(bounds), tuple(devices), m, tuple(sl), t)
    return best


def _uniforms(length: int):
    # every count up to 16, then coarser steps up to MAX_UNIFORM_SLICES
    counts = sorted({k for k in (*range(1, 17), 20, 24, 28, 32, 40, 48, 56, 64)
                     if k <= min(MAX_UNIFORM_SLICES, length)})
    return [uniform(length, k) for k in counts]


def _check_asked(profile: Profile, work: Workload, strategy: str, mix: Mix | None, max_ranges: int) -> None:
    context = profile.model.max_position_embeddings
    if work.seq_len < 1 or work.batch < 1:
        raise InfeasibleError("sequence length and batch must be >= 1")
    if strategy == "throughput" and mix is None:
        raise InfeasibleError("the throughput strategy is planned for a request mix: none was given")
    if max_ranges < 1:
        raise InfeasibleError("a device holds at least one unit range (--max-ranges-per-device >= 1)")
    if work.kv_len > context:
        raise InfeasibleError(f"length {work.kv_len} exceeds the model's context of {context} tokens")
    if work.kv_len < work.seq_len:
        raise InfeasibleError(f"--max-len {work.kv_len} is below --seq-len {work.seq_len}")


def _best_hpipe(cost: CostModel, work: Workload, splits: list, mbs: list[int], max_ranges: int, granularity: int,
                hpipe_slicings) -> Candidate:
    """hpipe's schedule: each split as it is and interleaved (each device holding several unit
    ranges), scheduled; the best few refined; the fastest."""
    L = work.seq_len
    starts = []
    for bounds, devices in splits:
        starts.append(_best(cost, work, bounds, devices, mbs, hpipe_slicings(bounds, devices)))
        for v in (v for v in INTERLEAVE if v <= max_ranges):
            chain = interleave(bounds, devices, v)
            if chain and _fits(cost, work, *chain):
                starts.append(_best(cost, work, *chain, mbs, lambda m: _uniforms(L)))
    starts.sort(key=lambda c: _with_answer(cost, work, c))
    best = None
    for c in starts[:REFINE_STARTS]:
        c = _refined(cost, work, c, granularity)
        if best is None or _with_answer(cost, work, c) < _with_answer(cost, work, best):
            best = c
    return best


def plan(profile: Profile, work: Workload, *, strategy: str = "hpipe", granularity: int = GRANULARITY,
         max_ranges: int = MAX_RANGES, mix: Mix | None = None, progress=None) -> Plan:
    """Plan hpipe and every baseline for ``work``; ``strategy`` is the one the plan executes.

    ``max_ranges``: the most unit ranges hpipe may give one device. Interleaved chains are
    candidates like any other, chosen only where the simulator says they are faster (1: none; see
    docs/decisions/interleaving.md for the measurements behind the default).
    ``mix``: also plan ``throughput``, the split for serving many requests of that mean shape
    (:mod:`planner.serving`), sliced by Algorithm 2 like hpipe's."""
    t_start = time.perf_counter()
    cost = CostModel(profile)
    _check_asked(profile, work, strategy, mix, max_ranges)
    n = len(cost.daemons)
    L = work.seq_len
    mbs = _divisors(work.batch)
    one = lambda m: [[L]]  # noqa: E731

    dp = best_cuts(cost, work)
    k = min(n, cost.num_units)  # an even split cannot use more devices than there are units
    even = ((0, *even_cuts(cost.num_units, k), cost.num_units), tuple(range(k)))
    even_ok = _fits(cost, work, *even)
    splits = [(dp.bounds, dp.daemons)] + ([even] if even_ok and even != (dp.bounds, dp.daemons) else [])

    tables = {}

    def hpipe_slicings(bounds, devices):
        def gen(m):
            key = (bounds, devices, m)
            if key not in tables:
                stages = [CostStage(devices[j], a, b, devices[j + 1] if j + 1 < len(devices) else None,
                                devices[j - 1] if j > 0 else None)
                          for j, (a, b) in enumerate(zip(bounds, bounds[1:]))]
                max_len = max(granularity, (work.kv_len // granularity) * granularity)
                tables[key] = slicing_table(cost, stages, max_len, work.batch // m, granularity)
            table = tables[key]
            key_len = min((k for k in table.slices if k >= L), default=max(table.slices))

            return [fit_slices(table.slices[key_len], L)] + _uniforms(L)
        return gen

    results: dict[str, Candidate | None] = {}
    best_h = _best_hpipe(cost, work, splits, mbs, max_ranges, granularity, hpipe_slicings)
    results["hpipe"] = best_h
    results["base"] = _best(cost, work, *even, [1], one) if even_ok else None
    results["gpipe"] = _best(cost, work, *even, mbs, one) if even_ok else None
    results["gp_b"] = _best(cost, work, dp.bounds, dp.daemons, mbs, one)
    results["terapipe"] = _best(cost, work, *even, [1], lambda m: _uniforms(L)) if even_ok else None
    meta: dict = {}
    if mix is not None:
        per_request = serving_table(cost, work, mix)
        split = serving_cuts(cost, per_request, mix)
        results["throughput"] = _best(cost, work, split.bounds, split.daemons, mbs,
                                      hpipe_slicings(split.bounds, split.daemons))
        meta["serving"] = {"mix": asdict(mix), "daemon_request_s": {
            name: daemon_loads(cost, per_request, c.bounds, c.daemons)
            for name, c in (("hpipe", best_h), ("throughput", results["throughput"]))}}

    scheduled = results["throughput"] if strategy == "throughput" else best_h
    key = (scheduled.bounds, scheduled.daemons, scheduled.micro_batches)
    if key not in tables:
        hpipe_slicings(scheduled.bounds, scheduled.daemons)(scheduled.micro_batches)
    slicing = dict(tables[key].slices)

    strategies = {}
    for name, cand in results.items():
        if cand is None:
            continue
        strategies[name] = StrategyPlan(name, _stage_plans(cost, work, cand), cand.micro_batches, cand.slices,
                                        cand.makespan)
    if strategy not in strategies:
        raise InfeasibleError(f"strategy {strategy!r} is infeasible here (its even split does not fit in memory)")
    if work.output_len:  # each strategy's answer, beside its prefill (predicted_s)
        meta["answer"] = {"output_len": work.output_len, "token_s": {
            name: answer_token_s(cost, work, cand.bounds, cand.daemons) for name, cand in results.items() if cand}}
    meta.update({"planning_s": round(time.perf_counter() - t_start, 3), "profile_source": profile.source,
                 "cut_bottleneck_s": dp.bottleneck,
                 "infeasible": sorted(k for k, v in results.items() if v is None),
                 # the links as profiled, for people (hpipe serve's page draws them)
                 "links": [{"src": k.src, "dst": k.dst, "bandwidth_Bps": k.bandwidth_Bps, "latency_s": k.latency_s}
                           for k in profile.links]})
    return Plan(profile.model_name, profile.model, profile.dtype, work.batch, L, work.kv_len, granularity,
                strategy, strategies, slicing, ideal_seconds(cost, work), meta=meta,
                slicing_for="throughput" if strategy == "throughput" else "hpipe")


def _refined(cost: CostModel, work: Workload, cand: Candidate, granularity: int) -> Candidate:
    """``cand`` after local search over its cuts and slices (devices and micro-batches fixed)."""
    def evaluate(bounds, slices):
        return simulate_schedule(cost, work, bounds, cand.daemons, cand.micro_batches, slices)

    def feasible(bounds):
        return _fits(cost, work, bounds, cand.daemons)

    makespan, bounds, slices = refine(evaluate, cand.bounds, cand.slices, granularity=granularity,
                                      feasible=feasible, max_evals=REFINE_EVALS, time_budget_s=REFINE_CAP_S)
    return Candidate(bounds, cand.daemons, cand.micro_batches, slices, makespan)


def _stage_plans(cost: CostModel, work: Workload, cand: Candidate) -> tuple[Stage, ...]:
    computes = stage_computes(cost, work, cand.bounds, cand.daemons, cand.micro_batches, cand.slices)
    out = []
    for j, (a, b) in enumerate(zip(cand.bounds, cand.bounds[1:])):
        dev = cost.daemons[cand.daemons[j]]
        out.append(Stage(dev.name, dev.address, UnitRange(a, b, cost.L), cost.stage_memory(a, b, work, max(cand.slices)),
                         dev.memory_bytes, float(computes[j].sum())))
    return tuple(out)


def ideal_seconds(cost: CostModel, work: Workload) -> float:
    """Total work over the devices' summed speed: 1 / sum_d (1 / T_d), T_d = whole model on d, unsliced."""
    speeds = 0.0
    for m in range(len(cost.daemons)):
        t = cost.stage_time(m, 0, cost.num_units, work.seq_len, 0, work.batch)
        if t > 0:
            speeds += 1.0 / t
    return 1.0 / speeds if speeds else math.inf


def timeline(profile: Profile, work: Workload, sp: StrategyPlan) -> Timeline:
    cost = CostModel(profile)
    names = [d.name for d in cost.daemons]
    bounds = tuple(s.units.start for s in sp.stages) + (sp.stages[-1].units.end,)
    devices = tuple(names.index(s.daemon) for s in sp.stages)
    return simulate_schedule(cost, work, bounds, devices, sp.micro_batches, sp.slices, keep=True)
