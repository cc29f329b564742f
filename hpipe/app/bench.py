"""``hpipe bench``: run the same input under each strategy of a plan on the live cluster.

For each strategy: deploy its stages, then prefill a random prompt of ``seq_len`` tokens x
``batch`` with its micro-batches and slices (micro-batch-major, all submitted before waiting,
as the simulator assumes), ``repeat`` times (one strategy after another, or round by round with
``interleave``); report the median latency next to the plan's prediction and ``ideal_s``. Peak
memory per daemon is the daemon process's peak resident set (CPU) or CUDA peak allocation; energy
is read from RAPL or NVML where the machine exposes them. Given the profile the plan came from,
the daemons re-time its reference stage before and after, and every schedule is re-predicted at
the speeds found (``predicted_now_s``).
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from hpipe.core.cluster import ClusterSpec
from hpipe.core.errors import HpipeError
from hpipe.core.plan import Plan
from hpipe.core.profile import Profile
from planner.costs import CostModel, Workload
from planner.strategies import ideal_seconds, timeline
from runtime.coordinator.deploy import deploy
from runtime.coordinator.pipeline import Pipeline, RemoteSequence
from runtime.wire.messages import cpu_steal, pb

log = logging.getLogger(__name__)


def energy_reader(powercap: str = "/sys/class/powercap"):
    """(A function returning joules so far, or None when no energy counter is readable; its source:
    ``rapl``, ``nvml`` or ``unavailable``). RAPL's packages (``intel-rapl:N``, not their sub-zones)."""
    import glob

    files = [f for f in glob.glob(f"{powercap}/intel-rapl:*/energy_uj") if Path(f).parent.name.count(":") == 1]
    try:
        if files:
            [int(open(f).read()) for f in files]
            return lambda: sum(int(open(f).read()) for f in files) / 1e6, "rapl"
    except OSError:
        pass
    try:
        import pynvml  # optional

        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        return lambda: sum(pynvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in handles) / 1e3, "nvml"
    except Exception:  # noqa: BLE001 - absent or unsupported: report unavailable
        return None, "unavailable"


def prefill_once(pipe: Pipeline, ids: torch.Tensor, micro_batches: int, slices: list[int],
                 clock_offsets: list[float] | None = None) -> tuple[float, list]:
    """Wall seconds to prefill ``ids [B, L]`` as ``micro_batches`` groups of rows sliced by ``slices``
    (each slice of a group one micro-batch, all sent before waiting, as the simulator assumes), and
    per-stage statistics (compute, send, receive seconds).

    With the daemons' ``clock_offsets`` (theirs minus ours), each stage's statistics also carry its
    ``timeline``: ``[micro_batch, start, length, received, begin, end]`` per slice, in seconds from the
    first submit on this machine's clock."""
    b = ids.shape[0] // micro_batches
    session = pipe.session()
    where = {}  # micro-batch id -> (group, start, length)
    try:
        seqs = [RemoteSequence(session, ids.shape[1], batch=b) for _ in range(micro_batches)]
        wall0 = time.time()
        t0 = time.perf_counter()
        for u, seq in enumerate(seqs):
            start = 0
            for k, n in enumerate(slices):
                mb = seq.submit(ids[u * b:(u + 1) * b, start:start + n], want_logits=k == len(slices) - 1,
                                prefill=True)
                where[mb] = (u, start, n)
                start += n
        for seq in seqs:
            for _ in slices:
                seq.result()
        elapsed = time.perf_counter() - t0
    finally:
        stats = session.close()
    per_stage = [{k: round(s.get(k, 0), 6) for k in ("compute_s", "send_s", "recv_s")} for s in stats]
    if clock_offsets is not None:
        for j, row in enumerate(per_stage):
            at = clock_offsets[j] + wall0
            row["timeline"] = sorted(
                [[*where[mb], round(r - at, 6), round(bg - at, 6), round(e - at, 6)]
                 for mb, _, r, bg, e in stats[j].get("spans", ()) if mb in where],
                key=lambda x: x[4])
    return elapsed, per_stage


def timeline_summary(spans: list) -> dict:
    """When a stage started and ended, and how long it computed and sat idle in between.

    ``spans``: ``[..., begin, end]`` per slice, in time order (a measured or a predicted timeline)."""
    if not spans:
        return {}
    busy = sum(x[-1] - x[-2] for x in spans)
    first, last = spans[0][-2], max(x[-1] for x in spans)
    return {"start_s": first, "end_s": last, "busy_s": busy, "idle_s": max(0.0, last - first - busy)}


def bench(plan: Plan, cluster: ClusterSpec, *, seq_len: int | None = None, batch: int | None = None,
          strategies: list[str] | None = None, repeat: int = 3, interleave: bool = False,
          profile: Profile | None = None, dequantize: bool = False) -> dict:
    """Measure each strategy ``repeat`` times. By default a strategy's runs follow one another; with
    ``interleave`` they go round by round (deploy, warm up, one timed run; next strategy), so that a
    machine whose speed drifts over minutes slows every strategy alike, at twice the runs.

    With the ``profile`` the plan was made from, every daemon also times the profile's reference
    stage before and after the runs; each strategy's schedule is re-simulated on the profile scaled
    by the mean of the two (``predicted_now_s``), which tells machine drift from model error."""
    seq_len = seq_len or plan.seq_len
    batch = batch or plan.batch
    names = strategies or list(plan.strategies)
    missing = [n for n in names if n not in plan.strategies]
    if missing:
        raise HpipeError(f"the plan has no strategy {', '.join(missing)} (it has {', '.join(plan.strategies)})")
    if repeat < 1:
        raise HpipeError("--repeat must be at least 1")
    if batch != plan.batch and any(plan.strategies[n].micro_batches > 1 for n in names):
        log.warning("batch %d differs from the plan's %d: micro-batch counts are kept", batch, plan.batch)
    planned = seq_len == plan.seq_len and batch == plan.batch
    used = sorted({s.daemon for n in names for s in plan.strategies[n].stages})
    if profile is not None:
        _check_profile(plan, profile, used)
        before = _calibrate(cluster, profile, used)
    ids = torch.randint(0, plan.model.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    energy, energy_source = energy_reader()
    runs: dict[str, list[dict]] = {name: [] for name in names}
    bar = tqdm(total=len(names) * repeat, desc="bench", file=sys.stderr, disable=not sys.stderr.isatty())

    def measure(name: str, count: int) -> None:
        """Deploy ``name``, warm up on the real input, then time ``count`` runs."""
        sp = plan.strategies[name]
        with deploy(plan, cluster, strategy=name, dequantize=dequantize) as deployed:
            _measure_deployed(deployed.pipe, sp, name, count)

    def _measure_deployed(pipe: Pipeline, sp, name: str, count: int) -> None:
        daemon_offsets = [c.clock_offset() for c in pipe.clients]
        offsets = [daemon_offsets[d] for d in pipe.stage_daemon]
        mb = sp.micro_batches if batch % sp.micro_batches == 0 else 1
        slices = plan.slices_for(seq_len, name)
        # warm-up with the real input: the first run of full-size shapes pays for allocator growth and
        # kernel selection (on an H100, Base's first of three runs was 20% slower than the others)
        prefill_once(pipe, ids, mb, slices)
        for _ in range(count):
            runs[name].append(_timed_run(pipe, ids, mb, slices, offsets, energy))
            bar.update(1)

    if interleave:
        for _ in range(repeat):
            for name in names:
                measure(name, 1)
    else:
        for name in names:
            measure(name, repeat)
    bar.close()
    rows = {name: _row(plan.strategies[name], runs[name], batch * seq_len, planned) for name in names}
    if profile is not None and planned:
        work = Workload(plan.seq_len, plan.batch, plan.max_len)
        for name, row in rows.items():
            tl = timeline(profile, work, plan.strategies[name])
            for j, stage in enumerate(row["stages"]):
                stage["predicted_timeline"] = [[round(a, 6), round(e, 6)] for jj, _, a, e in tl.compute if jj == j]
    result = {"seq_len": seq_len, "batch": batch, "ideal_s": plan.ideal_s if planned else None,
              "energy_source": energy_source, "order": "interleaved" if interleave else "blocks", "strategies": rows}
    if profile is not None:
        after = _calibrate(cluster, profile, used)
        factors = {d: (before[d] + after[d]) / 2 for d in used}
        result["calibration"] = {"before": before, "after": after, "factors": factors}
        if planned:
            scaled = profile.scaled(factors)
            # the bound at the bench's speeds, as predicted_now_s is the schedule at them
            result["ideal_now_s"] = ideal_seconds(CostModel(scaled), work)
            for name, row in rows.items():
                row["predicted_now_s"] = timeline(scaled, work, plan.strategies[name]).makespan
    return result


def _timed_run(pipe: Pipeline, ids: torch.Tensor, mb: int, slices: list[int], offsets: list[float],
               energy) -> dict:
    """One timed prefill of ``ids``: its seconds, joules (where ``energy`` reads them), stages'
    spans, and each daemon's peak and baseline memory, CPU steal and host CPU over it."""
    status0 = [c.call("Status", pb.StatusRequest(), timeout=10) for c in pipe.clients]
    e0 = energy() if energy else None
    elapsed, stages = prefill_once(pipe, ids, mb, slices, offsets)
    joules = energy() - e0 if energy else None
    status = [c.call("Status", pb.StatusRequest(), timeout=10) for c in pipe.clients]
    steal = {d.name: None if a is None or b is None else round(b - a, 3)
             for d, a, b in zip(pipe.daemons, map(cpu_steal, status0), map(cpu_steal, status))}
    return {"s": elapsed, "j": joules, "stages": stages, "mb": mb, "slices": len(slices),
            "peak": {d.name: st.peak_memory_bytes for d, st in zip(pipe.daemons, status)},
            "base": {d.name: st.baseline_memory_bytes for d, st in zip(pipe.daemons, status)},
            "steal": steal,
            "host_cpu": {d.name: round(b.host_cpu_s - a.host_cpu_s, 4) for d, a, b in zip(pipe.daemons, status0, status)}}


def _check_profile(plan: Plan, profile: Profile, devices: list[str]) -> None:
    if (profile.model_name, profile.dtype) != (plan.model_name, plan.dtype):
        raise HpipeError(f"the profile is of {profile.model_name} {profile.dtype}; the plan is of {plan.model_name} "
                         f"{plan.dtype}")
    missing = [d for d in devices if d not in {x.name for x in profile.daemons}]
    if missing:
        raise HpipeError(f"the profile has no device {', '.join(missing)}: not the profile this plan came from")


def _calibrate(cluster: ClusterSpec, profile: Profile, devices: list[str]) -> dict[str, float]:
    """Each device's speed factor against the profile (now / then; > 1 is slower now)."""
    from profiler.reference import calibrate

    factors = calibrate(cluster, profile, devices)
    log.info("speed now vs profile: %s", ", ".join(f"{d} x{f:.3f}" for d, f in factors.items()))
    return factors


def _row(sp, runs: list[dict], tokens: int, planned: bool) -> dict:
    """One strategy's report from its timed runs: median latency, the highest memory peak."""
    times = [r["s"] for r in runs]
    joules = [r["j"] for r in runs if r["j"] is not None]
    latency = statistics.median(times)
    # per-stage statistics of the median run (the lower middle one for an even count), so that they
    # explain the latency reported, not an outlier
    middle = sorted(runs, key=lambda r: r["s"])[(len(runs) - 1) // 2]
    devices = list(dict.fromkeys(s.daemon for s in sp.stages))  # a daemon holds several stages if interleaved
    planned_memory = {d: sum(s.memory_bytes for s in sp.stages if s.daemon == d) for d in devices}
    # per device, the run (deployment) whose peak rose most above what the daemon held before it
    worst = {d: max(runs, key=lambda r: r["peak"][d] - r["base"][d]) for d in devices}
    return {
        "latency_s": latency, "tokens_per_s": tokens / latency,
        "predicted_s": sp.predicted_s if planned else None,
        "slices": runs[-1]["slices"], "micro_batches": runs[-1]["mb"], "cuts": sp.cuts,
        "daemons": devices, "runs_s": times,
        "peak_memory_bytes": {d: worst[d]["peak"][d] for d in devices},
        "baseline_memory_bytes": {d: worst[d]["base"][d] for d in devices},
        "predicted_memory_bytes": planned_memory,
        "energy_j": statistics.median(joules) if joules else None,
        "stages": [{"daemon": st.daemon, "units": [st.units.start, st.units.end], "predicted_compute_s": st.compute_s,
                    **stats} for st, stats in zip(sp.stages, middle["stages"])],
        "stages_run_s": middle["s"],
        # seconds the hypervisor took from each daemon's CPUs during each run (None: not known)
        "runs_steal_s": [r["steal"] for r in runs],
        # CPU seconds each daemon spent outside its device worker per run (transport, RPC): on a
        # CPU device, time its compute could not have
        "host_cpu_s": {d: statistics.median(r["host_cpu"][d] for r in runs) for d in devices},
    }


def table(result: dict) -> str:
    nan = float("nan")
    ideal = result["ideal_s"]
    rows = result["strategies"]
    now = any("predicted_now_s" in r for r in rows.values())
    ideal_now = result.get("ideal_now_s")
    lines = [f"{result['seq_len']} tokens x batch {result['batch']}; ideal "
             f"{f'{ideal:.3f} s' if ideal else 'n/a (not the planned length)'}"
             f"{f' ({ideal_now:.3f} s at the speeds measured now)' if ideal_now else ''}; "
             f"energy: {result['energy_source']}"]
    cal = result.get("calibration")
    if cal:
        lines.append("speed vs profile (reference stage now / then, before and after the runs; > 1 is slower): "
                     + ", ".join(f"{d} {cal['before'][d]:.2f}/{cal['after'][d]:.2f}" for d in cal["factors"]))
    lines.append(f"{'strategy':<10} {'measured s':>10} {'predicted s':>11} {'meas/pred':>9} "
                 + (f"{'pred now s':>10} {'meas/now':>8} " if now else "")
                 + f"{'tokens/s':>9} {'hpipe/it':>9} {'ideal/meas':>10}"
                 + (f" {'ideal now/meas':>14}" if ideal_now else ""))
    hp = rows.get("hpipe", {}).get("latency_s")
    for name, r in rows.items():
        pred, lat = r["predicted_s"], r["latency_s"]
        cells = f"{name:<10} {lat:>10.3f} {pred if pred is not None else nan:>11.3f} {(lat / pred) if pred else nan:>9.2f} "
        if now:
            pn = r.get("predicted_now_s")
            cells += f"{pn if pn else nan:>10.3f} {(lat / pn) if pn else nan:>8.2f} "
        lines.append(cells + f"{r['tokens_per_s']:>9.0f} {(hp / lat) if hp else nan:>9.2f} "
                     f"{ideal / lat if ideal else nan:>10.2f}" + (f" {ideal_now / lat:>14.2f}" if ideal_now else ""))
    lines.append("memory GiB per daemon: peak above what the daemon held before the deployment / planned:")
    for name, r in rows.items():
        cells = [f"{d} {(r['peak_memory_bytes'][d] - r['baseline_memory_bytes'][d]) / 2**30:.2f} / "
                 f"{r['predicted_memory_bytes'][d] / 2**30:.2f}" for d in r["peak_memory_bytes"]]
        lines.append(f"  {name:<10} " + ", ".join(cells))
    if any(v is not None for r in rows.values() for run in r["runs_steal_s"] for v in run.values()):
        lines.append("CPU steal per run, seconds (time the hypervisor ran other work on each daemon's CPUs; "
                     "it slows a run whatever the schedule):")
        for name, r in rows.items():
            per = ", ".join(f"{d} " + "/".join("?" if run[d] is None else f"{run[d]:.2f}" for run in r["runs_steal_s"])
                            for d in r["daemons"])
            lines.append(f"  {name:<10} runs " + "/".join(f"{t:.2f}" for t in r["runs_s"]) + f" s: {per}")
    if any(r.get("host_cpu_s") for r in rows.values()):
        lines.append("host CPU per run outside the device workers (transport, RPC), median seconds:")
        for name, r in rows.items():
            lines.append(f"  {name:<10} " + ", ".join(f"{d} {v:.3f}" for d, v in r.get("host_cpu_s", {}).items()))
    hp_row = rows.get("hpipe")
    if hp_row and any(st.get("timeline") for st in hp_row["stages"]):
        lines.append("hpipe per stage in its median run, measured (planned), seconds: start, compute, idle "
                     "between slices, end")
        for st in hp_row["stages"]:
            m = timeline_summary(st.get("timeline", []))
            p = timeline_summary(st.get("predicted_timeline", []))
            if m:
                stage = f"{st['daemon']} [{st['units'][0]}, {st['units'][1]})"
                lines.append(f"  {stage:<16} " + ", ".join(
                    f"{label} {m[k]:.3f}" + (f" ({p[k]:.3f})" if p else "")
                    for label, k in (("start", "start_s"), ("compute", "busy_s"), ("idle", "idle_s"), ("end", "end_s"))))
    return "\n".join(lines)
