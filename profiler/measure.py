"""``hpipe profile``: ask every daemon of a cluster to measure itself, then measure every link.

A pipeline keeps every stage busy at once, and the profile describes devices as they run then.
Daemons that share a machine (or a GPU) measure their grids at the same time, beside each other;
the others one at a time. Then every daemon times a reference stage alone (kept in
``meta.reference``: ``hpipe bench --profile`` times it again to tell machine drift from model
error), and the daemons of a shared machine time it in rounds, each alone and then all at once:
that slowdown (``meta.colocation_factors``) gives each one's speed alone, for schedules whose
stages never overlap. ``colocation=False`` measures every grid alone and skips the rounds.
Compute grids are cached per (device fingerprint, model dimensions, dtype, grid, and the
fingerprints of the group a grid was measured beside), so re-profiling unchanged devices is
instant; ``force`` re-measures. A daemon that is down or answers badly fails the whole profile
with its name: partial results are never written as if complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import grpc
from tqdm import tqdm

from hpipe.config import ModelConfig
from hpipe.errors import HpipeError
from hpipe.model.stage import DTYPES
from hpipe.sources import cache_root
from profiler.links import HOST_CPU_TOKENS, fit_host_cpu, fit_link
from profiler.schema import DTYPE_BYTES, ComputeGrid, DeviceProfile, LinkProfile, Profile
from runtime import hoststat
from runtime.channels import StageClient
from runtime.cluster import ClusterSpec
from runtime.wire import TO_WIRE, pb

log = logging.getLogger(__name__)

PROFILE_TIMEOUT_S = 900.0
MAX_PROBE_BYTES = 32 << 20
LINK_PROBE_TOKENS = 2048  # link probes reach at least this many tokens' activations
#: bumped when how a daemon measures changes, so that cached grids measured the old way are not reused
METHOD = 4
#: passes over the compute grid (each point's median is over these). Noise picks plans: on the
#: emulated cluster, plans from 3-sweep profiles re-simulated on the median of ten others took
#: 4.42 s on average (1.00-1.20x their prediction), from 9-sweep ones 4.15 s (0.95-1.04x).
#: See docs/benchmarks.md, "Sixth day".
SWEEPS = 7
#: rounds of (each alone, then all together) behind a co-location factor
COLOCATION_ROUNDS = 3
#: seconds of each reference-stage run a daemon keeps its neighbours company with (see _group_grids)
LOAD_CHUNK_S = 1.0


#: slice lengths whose successor is a grid point too, so that a kernel whose cost steps up just past
#: a block boundary reads as a step, not as a ramp over the whole next interval. Measured on the
#: 2-core Xeon VM (SmolLM2 fp32 MLP, MKL, one thread, 7 sweeps): 128 -> 129 tokens cost 13% more,
#: 512 -> 513 7.5%, and from 129 to 256 the cost is a line again; with no point at 129, slices of
#: 144-176 tokens were predicted 7-11% short. Past 512 the steps measured were 4-7% (768 -> 769: 6.6%),
#: left to interpolation: each point costs profiling time, and long slices are few.
STEP_POINTS = (128, 256, 384, 512)


def grid_axes(max_len: int, batch: int) -> tuple[list[int], list[int], list[int]]:
    # dense enough that piecewise-linear interpolation follows attention's s^2 term (~5% between points)
    tokens = {t for t in (1, 16, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192,
                          12288, 16384, 24576, 32768) if t <= max_len} | {max_len}
    tokens = sorted(tokens | {t + 1 for t in STEP_POINTS if t + 1 <= max_len})
    contexts = sorted({0, max_len // 8, max_len // 4, max_len // 2, (3 * max_len) // 4})
    batches = sorted({1, batch} | {b for b in range(1, batch + 1) if batch % b == 0})
    return batches, tokens, contexts


def config_dict(cfg: ModelConfig) -> dict:
    """A Hugging Face style config.json for ``cfg`` (what the daemon rebuilds the shapes from)."""
    return {
        "architectures": [cfg.architecture], "model_type": cfg.model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": _rope_dict(cfg),
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias,
        **_windows_dict(cfg),
    }


def _windows_dict(cfg: ModelConfig) -> dict:
    windows = [w for w in cfg.sliding_windows if w is not None]
    if not windows:
        return {}
    return {"sliding_window": windows[0],
            "layer_types": ["sliding_attention" if w else "full_attention" for w in cfg.sliding_windows]}


def _rope_dict(cfg: ModelConfig) -> dict:
    rope = {"rope_type": cfg.rope.type, "rope_theta": cfg.rope.theta}
    if cfg.rope.type in ("linear", "llama3"):
        rope["factor"] = cfg.rope.factor
    if cfg.rope.type == "llama3":
        rope.update(low_freq_factor=cfg.rope.low_freq_factor, high_freq_factor=cfg.rope.high_freq_factor,
                    original_max_position_embeddings=cfg.rope.original_max_position_embeddings)
    return rope


def _fail(d, what: str, e: grpc.RpcError) -> HpipeError:
    return HpipeError(f"daemon {d.name} ({d.address}) {what}: {e.code().name}: {e.details()}")


def profile_cluster(cluster: ClusterSpec, model_name: str, cfg: ModelConfig, *, dtype: str = "float32",
                    max_len: int | None = None, batch: int = 1, repeats: int = SWEEPS, force: bool = False,
                    link_repeats: int = 21, colocation: bool = True,
                    colocation_rounds: int = COLOCATION_ROUNDS) -> Profile:
    max_len = max_len or cfg.max_position_embeddings
    if max_len > cfg.max_position_embeddings:
        raise HpipeError(f"--max-len {max_len} exceeds the model's context of {cfg.max_position_embeddings}")
    if dtype not in DTYPE_BYTES:
        raise HpipeError(f"unknown dtype {dtype!r}")
    security = cluster.security()
    clients = {d.name: StageClient(d.address, security, d.name) for d in cluster.daemons}
    batches, tokens, contexts = grid_axes(max_len, batch)
    shape = config_dict(cfg)
    t_start = time.perf_counter()
    n = len(cluster.daemons)
    bar = tqdm(total=n + n * (n - 1), desc="profiling", unit="step", file=sys.stderr, leave=False,
               disable=not sys.stderr.isatty())
    try:
        infos = {}
        for d in cluster.daemons:
            try:
                infos[d.name] = clients[d.name].call("GetDeviceInfo", pb.DeviceInfoRequest(), timeout=10.0)
            except grpc.RpcError as e:
                raise _fail(d, "is down or unreachable", e) from None
        steal0 = {d.name: _steal(clients[d.name]) for d in cluster.daemons}

        def share_key(d):  # CPU daemons on one machine share its RAM; GPU daemons share their GPU
            info = infos[d.name]
            return (info.host_id or d.host, "cpu" if info.device == "cpu" else d.device)

        groups: dict[tuple, list] = {}
        for d in cluster.daemons:
            groups.setdefault(share_key(d), []).append(d)
        ref = reference_stage(cfg, n, max_len, batch)
        request = pb.ProfileRequest(config_json=json.dumps(shape), dtype=TO_WIRE[DTYPES[dtype]], batches=batches,
                                    tokens=tokens, contexts=contexts, max_len=max_len, repeats=repeats)
        key_parts = [METHOD, shape, dtype, batches, tokens, contexts, repeats]
        grids, from_cache, together = {}, [], []
        for group in groups.values():
            concurrent = colocation and len(group) > 1
            if concurrent:
                together += [d.name for d in group]
            got, cached = _group_grids(group, clients, infos, request, key_parts, force, concurrent,
                                       (shape, dtype, ref), bar)
            grids.update(got)
            from_cache += cached
        devices = []
        for d in cluster.daemons:
            info = infos[d.name]
            memory = int(0.9 * info.available_bytes / len(groups[share_key(d)]))
            budget = d.memory_budget or info.memory_budget or None
            if budget:
                memory = min(memory, budget)
            devices.append(DeviceProfile(d.name, d.address, info.device, memory, grids[d.name], info.fingerprint))
        alone, factors = {}, {}
        for group in groups.values():
            if len(group) > 1 and colocation:
                bar.set_postfix_str("co-location: " + ", ".join(d.name for d in group))
                group_factors, group_alone = _colocation_factors(group, clients, shape, dtype, ref,
                                                                colocation_rounds)
                factors.update(group_factors)
                alone.update(group_alone)
            else:
                bar.set_postfix_str("reference stage")
                alone.update({d.name: _time_reference(clients[d.name], d, shape, dtype, ref, 3.0) for d in group})
        act = cfg.hidden_size * DTYPE_BYTES[dtype] * batch
        # activation-sized probes, capped: beyond a few tens of MB a transfer is all bandwidth. They go
        # up to 2048 tokens' worth whatever max_len is: the bandwidth fit needs transfers long enough
        # for TCP to settle (with max_len 512 the largest probes were 0.15-1.2 MB, and a 100 Mbit/s
        # link once read 9.9 MB/s from them; with probes up to 2048 tokens it read 11.4-11.6)
        top = max(max_len, LINK_PROBE_TOKENS)
        sizes = sorted({min(act * t, MAX_PROBE_BYTES) for t in (1, 16, 64, 256, 512, 1024, 2048, 4096, max_len)
                        if t <= top})
        links = []
        for a in cluster.daemons:
            for b in cluster.daemons:
                if a is b:
                    continue
                bar.set_postfix_str(f"link {a.name}->{b.name}")
                try:
                    reply = clients[a.name].call("MeasureLink", pb.LinkRequest(
                        target_address=b.address, sizes=sizes, repeats=link_repeats), timeout=300.0)
                except grpc.RpcError as e:
                    raise _fail(a, f"could not measure its link to {b.name} ({b.address})", e) from None
                lat, bw = fit_link(list(reply.sizes), list(reply.seconds))
                send, recv = _host_cpu_costs(a, b, clients, act, link_repeats)
                links.append(LinkProfile(a.name, b.name, lat, bw, *send, *recv))
                bar.update(1)
        steal1 = {d.name: _steal(clients[d.name]) for d in cluster.daemons}
    finally:
        bar.close()
        for c in clients.values():
            c.close()
    # CPU time the hypervisor took from each daemon's CPUs while it was profiled: a profile taken
    # while the host was busy reads its devices slow
    steal = {k: round(steal1[k] - steal0[k], 2) for k in steal0 if steal0[k] is not None and steal1[k] is not None}
    meta = {"max_len": max_len, "batch": batch, "repeats": repeats, "profiling_s": round(time.perf_counter() - t_start, 2),
            "cluster": cluster.name, "colocation_factors": {k: round(v, 4) for k, v in factors.items()},
            "reference": {**ref, "seconds": {k: round(v, 7) for k, v in alone.items()}},
            "cached": sorted(from_cache, key=[d.name for d in cluster.daemons].index),
            "measured_together": together, "steal_s": steal}
    return Profile(cfg, model_name, dtype, tuple(devices), tuple(links), source="measured", meta=meta)


def _host_cpu_costs(a, b, clients: dict[str, StageClient], act: int, repeats: int):
    """What a message on the link costs the sender's and the receiver's host in CPU, outside their
    device workers: ((per message, per byte) sending, (per message, per byte) receiving).

    Both daemons are idle but for the probes, so the change in their ``host_cpu_s`` over a round
    of same-sized probes is what those messages cost; two sizes separate the per-message part."""
    src, dst = clients[a.name], clients[b.name]
    sizes = [min(act * t, MAX_PROBE_BYTES) for t in HOST_CPU_TOKENS]
    sent, received = [], []
    for size in sizes:
        before = [_host_cpu(c) for c in (src, dst)]
        try:
            src.call("MeasureLink", pb.LinkRequest(target_address=b.address, sizes=[size], repeats=repeats),
                     timeout=300.0)
        except grpc.RpcError as e:
            raise _fail(a, f"could not measure the host CPU cost of its link to {b.name} ({b.address})", e) from None
        after = [_host_cpu(c) for c in (src, dst)]
        sent.append(after[0] - before[0])
        received.append(after[1] - before[1])
    messages = [repeats + 1] * len(sizes)  # MeasureLink sends each size once more, to warm up
    return fit_host_cpu(sizes, messages, sent), fit_host_cpu(sizes, messages, received)


def _status(client: StageClient) -> pb.StatusReply:
    return client.call("Status", pb.StatusRequest(), timeout=10.0)


def _host_cpu(client: StageClient) -> float:
    return _status(client).host_cpu_s


def _steal(client: StageClient) -> float | None:
    """The daemon's CPU steal counter (seconds since boot), or None where it does not know it."""
    return hoststat.reported(_status(client))


def _group_grids(group, clients, infos, request, key_parts: list, force: bool, concurrent: bool, ref_args: tuple,
                 bar) -> tuple[dict[str, dict[str, ComputeGrid]], list[str]]:
    """Compute grids of the daemons of one share group (cached, or measured), and which came from the cache.

    ``concurrent``: the daemons share a machine or a GPU, and measure their grids at the same time,
    as a pipeline runs them. A daemon that finishes first keeps timing the reference stage until
    the last one is done, so every grid point is measured beside busy neighbours. The cache key
    then names the whole group, since a grid measured beside other devices describes them too.
    """
    group_prints = sorted(infos[d.name].fingerprint for d in group) if concurrent else None
    paths = {}
    for d in group:
        key = hashlib.sha256(json.dumps(key_parts + [infos[d.name].fingerprint, group_prints],
                                        sort_keys=True).encode()).hexdigest()[:20]
        paths[d.name] = cache_root() / "profiles" / f"{key}.json"
    reuse = [d for d in group if not force and paths[d.name].exists()]
    if concurrent and len(reuse) < len(group):
        reuse = []  # a grid measured together needs its neighbours measuring beside it
    out = {}
    for d in reuse:
        log.info("%s: reusing cached compute profile %s", d.name, paths[d.name].name)
        out[d.name] = _load_grids(paths[d.name])
        bar.update(1)
    cached = [d.name for d in reuse]
    todo = [d for d in group if d not in reuse]

    def measure(d):
        try:
            reply = clients[d.name].call("ProfileCompute", request, timeout=PROFILE_TIMEOUT_S)
        except grpc.RpcError as e:
            raise _fail(d, "failed to profile itself", e) from None
        got = _grids(d, reply)
        _store_grids(paths[d.name], got)
        bar.update(1)
        return got

    if not concurrent or not todo:
        for d in todo:
            bar.set_postfix_str(f"compute {d.name}")
            out[d.name] = measure(d)
        return out, cached

    bar.set_postfix_str("compute " + ", ".join(d.name for d in group) + " (together)")
    shape, dtype, ref = ref_args
    lock, remaining, done, errors = threading.Lock(), [len(group)], threading.Event(), []

    def measure_then_load(d):
        try:
            got = measure(d)
        except BaseException as e:
            errors.append(e)
            done.set()
            raise
        with lock:
            remaining[0] -= 1
            if not remaining[0]:
                done.set()
        while not done.is_set():  # keep the machine as busy as a pipeline until all are measured
            _time_reference(clients[d.name], d, shape, dtype, ref, LOAD_CHUNK_S)
        return got

    pool = ThreadPoolExecutor(max_workers=len(group))
    futures = [pool.submit(measure_then_load, d) for d in group]
    try:
        done.wait()
        if errors:  # fail now: the caller closes the channels, which ends the others' calls
            raise errors[0]
        return {d.name: f.result() for d, f in zip(group, futures)}, cached
    finally:
        done.set()
        pool.shutdown(wait=False)


def _load_grids(path) -> dict[str, ComputeGrid]:
    return {k: ComputeGrid.from_dict(g) for k, g in json.loads(path.read_text()).items()}


def _store_grids(path, grids: dict[str, ComputeGrid]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps({k: asdict(g) for k, g in grids.items()}))
    tmp.replace(path)  # atomic: daemons of one fingerprint measured together write the same key


def _grids(d, reply) -> dict[str, ComputeGrid]:
    grids = {}
    for u in reply.units:
        nb, nt, nc = len(u.batches), len(u.tokens), len(u.contexts)
        if len(u.seconds) != nb * nt * nc or any(not (t >= 0) for t in u.seconds):
            raise HpipeError(f"daemon {d.name} ({d.address}) returned a malformed {u.kind} profile")
        secs = tuple(tuple(tuple(u.seconds[(i * nt + j) * nc + k] for k in range(nc)) for j in range(nt))
                     for i in range(nb))
        grids[u.kind] = ComputeGrid(tuple(u.batches), tuple(u.tokens), tuple(u.contexts), secs)
    missing = {"embed", "attn", "mlp", "head"} - set(grids)
    if missing:
        raise HpipeError(f"daemon {d.name} ({d.address}) returned no profile for {sorted(missing)}")
    return grids


def _time_stage(client, d, shape: dict, dtype: str, units: tuple[int, int], batch: int, tokens: int, context: int,
                repeats: int) -> float:
    try:
        return client.call("TimeStage", pb.StageTimeRequest(
            config_json=json.dumps(shape), dtype=TO_WIRE[DTYPES[dtype]], unit_start=units[0],
            unit_end=units[1], batch=batch, tokens=tokens, context=context, repeats=repeats),
            timeout=PROFILE_TIMEOUT_S).seconds
    except grpc.RpcError as e:
        raise _fail(d, "failed to time a stage", e) from None


def reference_stage(cfg: ModelConfig, n_devices: int, max_len: int, batch: int) -> dict:
    """The stage every daemon times to compare speeds across time and co-location: a 1/n share of the
    model's blocks over a slice of the size pipelines use (128 tokens) at a mid context.

    The slice size matters: co-located daemons that take turns on one core evict each other's
    cache, which costs a small slice more than a large one (on one core shared 60/30%, a matrix
    product whose weights fit the L2 cache ran 1.32x slower beside the other daemon; one that
    streams its weights from memory, 1.03x).
    """
    blocks = max(1, cfg.num_layers // max(1, n_devices))
    return {"units": [1, 1 + 2 * blocks], "tokens": max(1, min(128, max_len // 4)), "context": max_len // 2,
            "batch": batch}


def _time_reference(client, d, shape: dict, dtype: str, ref: dict, seconds: float) -> float:
    """Median seconds of the reference stage on ``d``, over about ``seconds`` of runs."""
    args = (shape, dtype, tuple(ref["units"]), ref["batch"], ref["tokens"], ref["context"])
    estimate = _time_stage(client, d, *args, 1)
    return _time_stage(client, d, *args, max(3, math.ceil(seconds / max(estimate, 1e-6))))


def _colocation_factors(group, clients, shape: dict, dtype: str, ref: dict,
                        rounds: int = COLOCATION_ROUNDS) -> tuple[dict[str, float], dict[str, float]]:
    """How much slower each daemon of ``group`` (sharing a machine or a GPU) computes while the others do too.

    A pipeline keeps every stage busy at once, and co-located daemons then share cores, caches and
    memory bandwidth; measured alone, they look faster than they run. Each round times every
    daemon alone, one after another, then all together, each repeating for about the same wall
    time so that the runs overlap from start to end (daemons keep the stage they built, so none is
    still building while others time). A daemon's factor is the median of its rounds' ratios, at
    least 1; the planner divides it out for schedules whose stages never overlap (the grids were
    measured together already). Returns the factors, and each daemon's
    median time alone over the rounds (the profile's reference timings).

    Rounds, because one ratio is as noisy as the effect: on a 2-core VM, single 3 s measurements of
    the same daemon's factor ranged 1.04-1.24, and one profile's factor (1.07) was a quarter of the
    slowdown its stage showed in the pipeline.
    """
    ratios: dict[str, list[float]] = {d.name: [] for d in group}
    alones: dict[str, list[float]] = {d.name: [] for d in group}
    for _ in range(max(1, rounds)):
        alone = {d.name: _time_reference(clients[d.name], d, shape, dtype, ref, 1.5) for d in group}
        for name, t in alone.items():
            alones[name].append(t)
        span = max(2.0, 3 * max(alone.values()))
        with ThreadPoolExecutor(max_workers=len(group)) as pool:
            together = dict(zip([d.name for d in group], pool.map(
                lambda d: _time_reference(clients[d.name], d, shape, dtype, ref, span), group)))
        for name in ratios:
            ratios[name].append(together[name] / alone[name])
    factors = {name: max(1.0, statistics.median(r)) for name, r in ratios.items()}
    log.info("co-location slowdown: %s", ", ".join(
        f"{k} x{v:.2f} (rounds {', '.join(f'{x:.2f}' for x in ratios[k])})" for k, v in factors.items()))
    return factors, {name: statistics.median(t) for name, t in alones.items()}


def calibrate(cluster: ClusterSpec, profile: Profile, names: list[str] | None = None,
              seconds: float = 3.0) -> dict[str, float]:
    """How much slower (> 1) or faster each daemon computes now than when ``profile`` was measured.

    Each daemon times the profile's reference stage again, alone; the factor is now / then. Machines
    drift: on the emulated cluster, stages ran 10-24% off a profile taken minutes earlier, in
    either direction. Scaling the profile by these factors separates that drift from model error.
    Each timing spans ``seconds`` (twice the profile's): on a VM one 1.5 s timing once read a
    device 1.40x slower than another taken a minute before, while a bench in between ran at the
    profile's speed.
    """
    ref = profile.meta.get("reference")
    if not ref or not ref.get("seconds"):
        raise HpipeError("the profile has no reference timings (it predates them, or was simulated): re-profile")
    names = names or [d.name for d in profile.devices]
    daemons = {d.name: d for d in cluster.daemons}
    missing = [n for n in names if n not in daemons or n not in ref["seconds"]]
    if missing:
        raise HpipeError(f"cannot calibrate {', '.join(missing)}: not in both the cluster and the profile")
    shape = config_dict(profile.model)
    security = cluster.security()
    factors = {}
    for name in names:
        client = StageClient(daemons[name].address, security, name)
        try:
            now = _time_reference(client, daemons[name], shape, profile.dtype, ref, seconds)
        finally:
            client.close()
        factors[name] = now / ref["seconds"][name]
    return factors
