"""Seesaw on a heterogeneous pipeline: a layout for prefill, a layout for decode, and the switch.

Design note (docs/decisions/seesaw.md). Prefill is bound by compute and by the activations that
cross each link (a prompt's slice of hidden states per boundary); decode by what each device reads
per token and hardly by links (one token's hidden state). So the two phases may want different
cuts. Seesaw (papers/seesaw.md, §4–5) runs a batch of requests' prefill on the prefill layout,
re-shards, decodes the whole batch on the decode layout, and switches back when the batch has
drained: switches are rare, and their cost is spread over the batch.

Everything here is the serving model of :mod:`planner.serving`: under load every daemon is busy,
so a layout's seconds per request are its busiest stage's (its work plus its outgoing transfer).

- one layout for both phases: ``max_j (P_j + D_j + comm)`` — the phases of different requests
  overlap on different daemons (the prefill layout, the decode layout, or the best one for both,
  :mod:`planner.serving`'s split);
- seesaw: ``max_j P_j(prefill layout) + max_j D_j(decode layout) + switch / batch`` — the cluster
  does one phase at a time, each on its own layout.

The switch (prefill -> decode, then back): each unit that changes owner needs its weights on the
new owner (none to move when a daemon can hold both layouts' units at once, else read from its
weights cache at :data:`LOAD_BPS`), and, going to decode, the batch's KV of each attention unit
that moved: sent over the measured link, or recomputed by the new owner from the activations
entering the moved run (the daemon before it in the decode layout sends them from its replay log;
the coordinator, token ids, for a run at the start), whichever the profile says is cheaper (KV
moves no faster than :data:`KV_SEND_BPS`, what the runtime's transfer reaches). Transfers to
different daemons run at once; a daemon's own arrive one after another. Going back to prefill
moves no KV (the batch has finished). ``batch`` is how many requests' KV the decode layout holds
(and the prefill layout, for the prompts): without a host tier, a switch per pool-full of requests.

Pure functions: tested against brute force over every layout on tiny cases
(``tests/planner/test_seesaw.py``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np

from hpipe.core.units import ATTN, MLP, unit_kinds
from planner.costs import FIXED_STAGE_BYTES, CostModel, Workload
from planner.cuts import comm_matrix, min_max_cuts
from planner.serving import Mix, serving_table, unit_work

#: bytes a second a daemon reads weights it does not hold into memory (its weights cache on local
#: disk, each entry's hash checked): Gemma 3 270M's 200 MB stages loaded in 0.2-0.3 s on this
#: project's Xeon (docs/results.md, "Weights sent to daemons")
LOAD_BPS = 0.8e9
#: bytes a second a switch's KV moves between two daemons at most (runtime.daemon.kv_transfer: gRPC
#: parts of 4 MiB, copied into host memory and into the new owner's pool): 829 MB took about 1.55 s
#: between local-3's daemons on this project's 2-core EPYC (docs/results.md, "Seesaw"), whatever
#: the link
KV_SEND_BPS = 0.5e9
#: requests per phase when no pool bounds them (a layout without attention units)
MAX_BATCH = 1 << 16
#: output lengths searched for where seesaw starts to pay
BREAK_EVEN_LENGTHS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class Layout:
    """Contiguous unit ranges ``[bounds[j], bounds[j + 1])`` on ``devices[j]`` (profile indices)."""
    bounds: tuple[int, ...]
    devices: tuple[int, ...]

    def owner(self, unit: int) -> int:
        j = int(np.searchsorted(np.asarray(self.bounds), unit, side="right")) - 1
        return self.devices[j]

    def stages(self):
        return zip(self.devices, self.bounds, self.bounds[1:])


@dataclass(frozen=True)
class Switch:
    """One round of transitions: prefill -> decode with a batch's KV, and back."""
    to_decode_s: float
    to_prefill_s: float
    moved_units: int
    weight_bytes: int      # read by daemons that cannot hold both layouts' units
    kv_bytes: int          # sent where sending beats recomputing
    recomputed_units: int  # attention units whose KV the new owner recomputes instead
    #: each run of units changing owner: (from, to, first unit, end, "send" | "recompute" | "none")
    runs: tuple = ()

    @property
    def seconds(self) -> float:
        return self.to_decode_s + self.to_prefill_s


@dataclass(frozen=True)
class Seesaw:
    """The two layouts, the switch between them, and seconds per request at full load of each way."""
    prefill: Layout
    decode: Layout
    serving: Layout          # the best single layout for both phases (planner.serving's split)
    batch: int
    switch: Switch
    request_s: dict          # "prefill layout" / "decode layout" / "serving layout" / "seesaw" -> seconds a request
    phase_s: dict            # seesaw's "prefill" and "decode" seconds per request
    busy: dict               # way -> daemon name -> its busy share of the time
    choice: str
    break_even_output: int | None  # the shortest answer (of BREAK_EVEN_LENGTHS) at which seesaw pays

    @property
    def gain(self) -> float:
        """Seesaw's throughput over the best single layout's."""
        best = min(t for way, t in self.request_s.items() if way != "seesaw")
        return best / self.request_s["seesaw"] if self.request_s["seesaw"] > 0 else math.inf

    def to_dict(self, cost: CostModel) -> dict:
        names = [d.name for d in cost.daemons]

        def layout(lay: Layout) -> list[dict]:
            return [{"daemon": names[m], "units": [a, b]} for m, a, b in lay.stages()]
        return {"prefill": layout(self.prefill), "decode": layout(self.decode), "serving": layout(self.serving),
                "batch": self.batch,
                "switch": {**asdict(self.switch), "seconds": self.switch.seconds,
                           "runs": [{"from": names[a], "to": names[b], "units": [u, v], "kv": kv}
                                    for a, b, u, v, kv in self.switch.runs]},
                "request_s": self.request_s, "phase_s": self.phase_s, "busy": self.busy, "choice": self.choice,
                "gain": self.gain, "break_even_output": self.break_even_output}


def phase_time(table: np.ndarray, comm: np.ndarray, lay: Layout) -> float:
    """A layout's seconds per request for one phase: its busiest stage's work and outgoing transfer."""
    worst = 0.0
    for j, (m, a, b) in enumerate(lay.stages()):
        out = comm[m, lay.devices[j + 1]] if j + 1 < len(lay.devices) else 0.0
        worst = max(worst, float(table[m, a, b]) + out)
    return worst


def both_time(tables, comms, lay: Layout) -> float:
    """A layout's seconds per request serving both phases at once (prefill and decode overlap)."""
    (tp, td), (cp, cd) = tables, comms
    worst = 0.0
    for j, (m, a, b) in enumerate(lay.stages()):
        out = cp[m, lay.devices[j + 1]] + cd[m, lay.devices[j + 1]] if j + 1 < len(lay.devices) else 0.0
        worst = max(worst, float(tp[m, a, b] + td[m, a, b]) + out)
    return worst


def _busy(per_device: dict[int, float], total: float, cost: CostModel) -> dict[str, float]:
    return {cost.daemons[m].name: round(t / total, 3) if total > 0 else 0.0 for m, t in per_device.items()}


def _weights(cost: CostModel, units: set[int]) -> int:
    p, kinds = cost.profile, unit_kinds(cost.L)
    total = sum(p.unit_weight_bytes(kinds[u]) for u in units)
    if 0 in units and cost.num_units - 1 in units and p.model.tie_word_embeddings:
        total -= p.matrix_bytes(p.model.vocab_size * p.model.hidden_size)
    return total


def _held(lay: Layout) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for m, a, b in lay.stages():
        out.setdefault(m, set()).update(range(a, b))
    return out


def capacity(cost: CostModel, mix: Mix, prefill: Layout, decode: Layout) -> tuple[int, set[int]]:
    """How many requests one phase takes (the KV both layouts hold for them), and the daemons that
    can keep both layouts' units in memory at once (for them a switch reads no weights)."""
    kinds, kv_token = unit_kinds(cost.L), cost.profile.kv_bytes_per_token_per_layer()
    hp, hd = _held(prefill), _held(decode)

    def requests(m: int, weights: set[int], phase_units: set[int], tokens: int) -> float:
        """Requests whose KV fits on ``m`` beside the weights of ``weights``."""
        attn = sum(kinds[x] == ATTN for x in phase_units)
        room = cost.daemons[m].memory_bytes - _weights(cost, weights) - FIXED_STAGE_BYTES
        return room / (attn * kv_token * tokens) if attn else (math.inf if room >= 0 else 0.0)

    resident, batch = set(), math.inf
    for m in set(hp) | set(hd):
        p_units, d_units = hp.get(m, set()), hd.get(m, set())
        both = p_units | d_units
        if min(requests(m, both, p_units, mix.prompt), requests(m, both, d_units, mix.prompt + mix.output)) >= 1:
            resident.add(m)
        batch = min(batch, requests(m, both if m in resident else p_units, p_units, mix.prompt),
                    requests(m, both if m in resident else d_units, d_units, mix.prompt + mix.output))
    return (int(batch) if math.isfinite(batch) else MAX_BATCH), resident


def switch_cost(cost: CostModel, mix: Mix, prefill: Layout, decode: Layout, batch: int,
                resident: set[int]) -> Switch:
    """What one round of transitions costs (see the module's note)."""
    p, kinds, u = cost.profile, unit_kinds(cost.L), cost.num_units
    kv_unit = p.kv_bytes_per_token_per_layer() * mix.prompt * batch
    act = p.activation_bytes_per_token() * mix.prompt * batch
    prompts = Mix(mix.prompt, 0, mix.decode_batch, mix.chunk)
    to_decode: dict[int, float] = {}
    to_prefill: dict[int, float] = {}
    weight_bytes = kv_bytes = recomputed = moved = 0
    runs: list[tuple[int, int, int, int]] = []  # (from, to, first unit, end) of units changing owner
    for unit in range(u):
        src, dst = prefill.owner(unit), decode.owner(unit)
        if src == dst:
            continue
        moved += 1
        if runs and runs[-1][:2] == (src, dst) and runs[-1][3] == unit:
            runs[-1] = (src, dst, runs[-1][2], unit + 1)
        else:
            runs.append((src, dst, unit, unit + 1))
    choices = []
    for src, dst, a, b in runs:
        wb = _weights(cost, set(range(a, b)))
        if dst not in resident:
            to_decode[dst] = to_decode.get(dst, 0.0) + wb / LOAD_BPS
            weight_bytes += wb
        if src not in resident:
            to_prefill[src] = to_prefill.get(src, 0.0) + wb / LOAD_BPS
            weight_bytes += wb
        attn = sum(kinds[x] == ATTN for x in range(a, b))
        if not attn:
            choices.append((src, dst, a, b, "none"))
            continue
        link = cost.link(src, dst)
        send = link.latency_s + attn * kv_unit / min(link.bandwidth_Bps, KV_SEND_BPS)
        per_unit = unit_work(cost, dst, prompts, "prefill")  # the new owner computes the moved run
        # from what enters it: the token ids (the coordinator's) for a run at the start, else the
        # rows the daemon before it in the decode layout logged, over their link
        before = decode.owner(a - 1) if a else dst
        entering = 0.0
        if before != dst:
            into = cost.link(before, dst)
            entering = into.latency_s + act / into.bandwidth_Bps
        redo = entering + batch * sum(
            per_unit[1] if kinds[x] == ATTN else per_unit[2] for x in range(a, b) if kinds[x] in (ATTN, MLP))
        if send <= redo:
            to_decode[dst] = to_decode.get(dst, 0.0) + send
            kv_bytes += attn * kv_unit
        else:
            to_decode[dst] = to_decode.get(dst, 0.0) + redo
            recomputed += attn
        choices.append((src, dst, a, b, "send" if send <= redo else "recompute"))
    return Switch(max(to_decode.values(), default=0.0), max(to_prefill.values(), default=0.0), moved,
                  weight_bytes, kv_bytes, recomputed, tuple(choices))


def best_layout(table: np.ndarray, comm: np.ndarray, cost: CostModel) -> Layout:
    cuts = min_max_cuts(table, comm, list(range(len(cost.daemons))), cost.num_units)
    if not math.isfinite(cuts.bottleneck):
        raise ValueError("no layout fits")
    return Layout(cuts.bounds, cuts.daemons)


def seesaw(cost: CostModel, work: Workload, mix: Mix, batch: int | None = None, *,
           break_even: bool = True) -> Seesaw:
    """The prefill layout, the decode layout and what switching between them costs for ``mix``;
    seconds per request of each way, and the choice. ``batch``: requests per phase (default: as
    many as the layouts' KV pools hold, :func:`capacity`)."""
    tables = (serving_table(cost, work, mix, "prefill"), serving_table(cost, work, mix, "decode"))
    comms = (comm_matrix(cost, mix.prompt, 1), comm_matrix(cost, mix.output, 1))
    lp, ld = best_layout(tables[0], comms[0], cost), best_layout(tables[1], comms[1], cost)
    ls = best_layout(tables[0] + tables[1], comms[0] + comms[1], cost)  # the best one layout for both
    fitted, resident = capacity(cost, mix, lp, ld)
    n = max(1, batch if batch is not None else fitted)
    sw = switch_cost(cost, mix, lp, ld, n, resident)
    phases = {"prefill": phase_time(tables[0], comms[0], lp), "decode": phase_time(tables[1], comms[1], ld)}
    singles = {"prefill layout": lp, "decode layout": ld, "serving layout": ls}
    request_s = {way: both_time(tables, comms, lay) for way, lay in singles.items()}
    request_s["seesaw"] = phases["prefill"] + phases["decode"] + sw.seconds / n
    if lp == ld:
        request_s["seesaw"] = request_s["prefill layout"]  # one layout: nothing to switch
    busy = {}
    for way, lay in singles.items():
        busy[way] = _busy({m: float(tables[0][m, a, b] + tables[1][m, a, b]) for m, a, b in lay.stages()},
                          request_s[way], cost)
    load: dict[int, float] = {}
    for table, lay in ((tables[0], lp), (tables[1], ld)):
        for m, a, b in lay.stages():
            load[m] = load.get(m, 0.0) + float(table[m, a, b])
    busy["seesaw"] = _busy(load, request_s["seesaw"], cost)
    choice = min(request_s, key=request_s.get) if lp != ld else "prefill layout"
    result = Seesaw(lp, ld, ls, n, sw, request_s, phases, busy, choice, None)
    if break_even:
        result = replace(result, break_even_output=break_even_output(cost, work, mix, batch))
    return result


def break_even_output(cost: CostModel, work: Workload, mix: Mix, batch: int | None = None) -> int | None:
    """The shortest answer length (of :data:`BREAK_EVEN_LENGTHS`) at which seesaw beats every
    single layout for ``mix``'s prompts; None if it never does."""
    for out in BREAK_EVEN_LENGTHS:
        s = seesaw(cost, work, replace(mix, output=out), batch, break_even=False)
        if s.choice == "seesaw":
            return out
    return None


def table(result: Seesaw, cost: CostModel, mix: Mix) -> str:
    """The three ways side by side, for ``hpipe plan --objective seesaw``."""
    names = [d.name for d in cost.daemons]

    def layout(lay: Layout) -> str:
        return " | ".join(f"{names[m]} {a}-{b}" for m, a, b in lay.stages())
    tokens = mix.output
    lines = [f"seesaw for requests of {mix.prompt} prompt and {mix.output} answer tokens "
             f"({result.batch} per phase):",
             f"  prefill layout: {layout(result.prefill)}",
             f"  decode layout:  {layout(result.decode)}",
             f"  serving layout: {layout(result.serving)} (the best one layout for both phases)",
             f"  switch: {result.switch.moved_units} units change owner; {result.switch.seconds:.3f} s a round "
             f"({result.switch.weight_bytes / 1e6:.1f} MB of weights read, {result.switch.kv_bytes / 1e6:.1f} MB of KV "
             f"sent, {result.switch.recomputed_units} attention units recomputed)"]
    for way, s in result.request_s.items():
        rate = tokens / s if s > 0 else math.inf
        mark = "  <- chosen" if way == result.choice else ""
        lines.append(f"  {way:15s} {s * 1e3:9.2f} ms a request  {rate:9.1f} answer tokens/s{mark}")
    be = result.break_even_output
    lines.append(f"  seesaw / best single layout: {result.gain:.2f}x; it pays from answers of {be} tokens"
                 if be is not None else
                 f"  seesaw / best single layout: {result.gain:.2f}x; it does not pay for any answer length here")
    return "\n".join(lines)
