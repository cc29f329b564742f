"""``hpipe profile``: ask every daemon of a cluster to measure itself, then measure every link.

A pipeline keeps every stage busy at once, and the profile describes devices as they run then.
Daemons that share a machine (or a GPU) measure their grids at the same time, beside each other;
the others one at a time. Then every daemon times a reference stage alone (kept in
``meta.reference``: ``hpipe bench --profile`` times it again to tell machine drift from model
error), and the daemons of a shared machine time it in rounds, each alone and then all at once:
that slowdown (``meta.colocation_factors``) gives each one's speed alone, for schedules whose
stages never overlap. ``colocation=False`` measures every grid alone and skips the rounds.
Compute grids are cached per (device fingerprint, model dimensions, dtype, grid, the precision
of quantized prefill rows, and the fingerprints of the group a grid was measured beside), so
re-profiling unchanged devices is instant; ``force`` re-measures. A daemon that is down or answers badly fails the whole profile
with its name: partial results are never written as if complete.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from tqdm import tqdm

from hpipe.core.cluster import ClusterSpec, DaemonSpec, memory_system
from hpipe.core.config import ModelConfig
from hpipe.core.errors import HpipeError
from hpipe.core.profile import DTYPE_BYTES, ComputeGrid, DaemonProfile, LinkProfile, Profile
from hpipe.model.compute.stage import DTYPES
from hpipe.model.kernels.precision import asked_prefill_gemm
from profiler.grid import (
    DEFAULT_MAX_LEN,
    METHOD,
    SWEEPS,
    estimate_seconds,
    grid_axes,
    grids_from_reply,
    group_twins,
    merge_grids,
    twin_shares,
)
from profiler.grid_cache import grid_path, load_grids, store_grids
from profiler.links import HOST_CPU_TOKENS, MAX_PROBE_BYTES, PILOT_BYTES, fit_host_cpu, fit_link, fit_probes
from profiler.reference import (
    COLOCATION_ROUNDS,
    PROFILE_TIMEOUT_S,
    colocation_factors,
    daemon_error,
    reference_stage,
    time_reference,
    time_stage,
)
from runtime.wire.channels import DaemonClient, Security
from runtime.wire.messages import TO_WIRE, cpu_steal, pb

log = logging.getLogger(__name__)

LINK_PROBE_TOKENS = 2048  # link probes reach at least this many tokens' activations
#: seconds of each reference-stage run a daemon keeps its neighbours company with (see _group_grids)
LOAD_CHUNK_S = 1.0


def _device_info(d: DaemonSpec, client: DaemonClient):
    try:
        return client.call("GetDeviceInfo", pb.DeviceInfoRequest(), timeout=10.0)
    except grpc.RpcError as e:
        raise daemon_error(d, "is down or unreachable", e) from None


def _measure_links(cluster: ClusterSpec, clients: dict, act: int, max_len: int, link_repeats: int,
                   bar) -> list[LinkProfile]:
    """Every directed link's latency and bandwidth, and the host CPU a message costs either end
    (``act``: a token's activation bytes)."""
    # activation-sized probes, capped: beyond a few tens of MB a transfer is all bandwidth. They go
    # up to 2048 tokens' worth whatever max_len is: the bandwidth fit needs transfers long enough
    # for TCP to settle (with max_len 512 the largest probes were 0.15-1.2 MB, and a 100 Mbit/s
    # link once read 9.9 MB/s from them; with probes up to 2048 tokens it read 11.4-11.6)
    top = max(max_len, LINK_PROBE_TOKENS)
    sizes = sorted({min(act * t, MAX_PROBE_BYTES) for t in (1, 16, 64, 256, 512, 1024, 2048, 4096, max_len)
                    if t <= top})
    links = []
    data_ports = {d.name: _status(clients[d.name]).data_port for d in cluster.daemons}
    for a in cluster.daemons:
        for b in cluster.daemons:
            if a is b:
                continue
            bar.set_postfix_str(f"link {a.name}->{b.name}")
            try:
                probe = functools.partial(clients[a.name].call, "MeasureLink", timeout=300.0)
                target = dict(target_address=b.address, target_data_port=data_ports[b.name])
                pilot = probe(pb.LinkRequest(**target, sizes=[PILOT_BYTES], repeats=1)).seconds[0]
                these, repeats = fit_probes(sizes, link_repeats, PILOT_BYTES / max(pilot, 1e-6))
                if (these, repeats) != (sizes, link_repeats):
                    log.info("link %s->%s: about %.1f MB/s, so probes up to %d bytes, %d rounds", a.name, b.name,
                             PILOT_BYTES / max(pilot, 1e-6) / 1e6, these[-1], repeats)
                reply = probe(pb.LinkRequest(**target, sizes=these, repeats=repeats))
            except grpc.RpcError as e:
                raise daemon_error(a, f"could not measure its link to {b.name} ({b.address})", e) from None
            lat, bw = fit_link(list(reply.sizes), list(reply.seconds))
            send, recv = _host_cpu_costs(a, b, data_ports[b.name], clients, act, repeats, these[-1])
            links.append(LinkProfile(a.name, b.name, lat, bw, *send, *recv))
            bar.update(1)
    return links


def _reference_times(groups: dict, clients: dict, shape: dict, dtype: str, ref: dict, colocation: bool,
                     rounds: int, bar) -> tuple[dict, dict]:
    """Each daemon's time for the reference stage alone, and how much slower the daemons of a
    shared machine run it together (its co-location factors)."""
    alone, factors = {}, {}
    for group in groups.values():
        if len(group) > 1 and colocation:
            bar.set_postfix_str("co-location: " + ", ".join(d.name for d in group))
            group_factors, group_alone = colocation_factors(group, clients, shape, dtype, ref, rounds)
            factors.update(group_factors)
            alone.update(group_alone)
        else:
            bar.set_postfix_str("reference stage")
            alone.update({d.name: time_reference(clients[d.name], d, shape, dtype, ref, 3.0) for d in group})
    return alone, factors


def profile_cluster(cluster: ClusterSpec, model_name: str, cfg: ModelConfig, *, dtype: str = "float32",
                    max_len: int | None = None, batch: int = 1, repeats: int = SWEEPS, force: bool = False,
                    link_repeats: int = 21, colocation: bool = True,
                    colocation_rounds: int = COLOCATION_ROUNDS, say=log.info, weight_bits: float = 0.0,
                    weight_type: int = 0) -> Profile:
    """Measure every daemon of ``cluster`` and every link between them. ``say`` receives one line
    before measuring: about how long it will take. ``weight_bits``: the bits per weight the daemons
    hold the matrices at (a GGUF's blocks; 0: ``dtype``), which the planner's memory check uses;
    ``weight_type``: the ggml type the daemons time their units' matrices in (0: float), as
    ``quantization_config`` in the config they are sent (and in the cache key of what they
    measured)."""
    max_len = max_len or min(cfg.max_position_embeddings, DEFAULT_MAX_LEN)
    if max_len > cfg.max_position_embeddings:
        raise HpipeError(f"--max-len {max_len} exceeds the model's context of {cfg.max_position_embeddings}")
    if dtype not in DTYPE_BYTES:
        raise HpipeError(f"unknown dtype {dtype!r}")
    security = Security.of(cluster)
    clients = {d.name: DaemonClient(d.address, security, d.name) for d in cluster.daemons}
    batches, tokens, contexts = grid_axes(max_len, batch)
    shape = cfg.to_dict()
    if weight_type:
        shape["quantization_config"] = {"quant_method": "gguf", "ggml_type": weight_type}
    t_start = time.perf_counter()
    n = len(cluster.daemons)
    bar = tqdm(total=n + n * (n - 1), desc="profiling", unit="step", file=sys.stderr, leave=False,
               disable=not sys.stderr.isatty())
    try:
        infos = {d.name: _device_info(d, clients[d.name]) for d in cluster.daemons}
        steal0 = {d.name: _steal(clients[d.name]) for d in cluster.daemons}

        def share_key(d):
            info = infos[d.name]
            return memory_system(info.host_id or d.host, "cpu" if info.device == "cpu" else d.device)

        groups: dict[tuple, list] = {}
        for d in cluster.daemons:
            groups.setdefault(share_key(d), []).append(d)
        per_weight = weight_bits / 8 if weight_bits else DTYPE_BYTES[dtype]
        ref = reference_stage(cfg, n, max_len, batch, per_weight * cfg.block_weights)
        request, key_parts = grid_request(shape, dtype, (batches, tokens, contexts), max_len, repeats)
        line, costs = _forecast(cluster, groups, clients, infos, key_parts, force, colocation, shape, dtype,
                                (batches, tokens, contexts), repeats, max_len, colocation_rounds)
        say(line)
        grids, from_cache, together = {}, [], []
        for group in groups.values():
            concurrent = colocation and len(group) > 1
            if concurrent:
                together += [d.name for d in group]
            got, cached = _group_grids(group, clients, infos, request, key_parts, force, concurrent,
                                       (shape, dtype, ref), bar, costs)
            grids.update(got)
            from_cache += cached
        devices = []
        for d in cluster.daemons:
            info = infos[d.name]
            memory = int(0.9 * info.available_bytes / len(groups[share_key(d)]))
            budget = d.memory_budget or info.memory_budget or None
            if budget:
                memory = min(memory, budget)
            devices.append(DaemonProfile(d.name, d.address, info.device, memory, grids[d.name], info.fingerprint))
        alone, factors = _reference_times(groups, clients, shape, dtype, ref, colocation, colocation_rounds, bar)
        links = _measure_links(cluster, clients, cfg.hidden_size * DTYPE_BYTES[dtype] * batch, max_len,
                               link_repeats, bar)
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
    return Profile(cfg, model_name, dtype, tuple(devices), tuple(links), source="measured", meta=meta,
                   weight_bits=weight_bits)


def grid_request(shape: dict, dtype: str, axes: tuple[list, list, list], max_len: int,
                 repeats: int) -> tuple[pb.ProfileRequest, list]:
    """What each daemon is asked to measure, and what its cached grid is keyed by. Quantized
    prefill rows are timed in the precision runs will ask the daemons to compute in (this
    process's ``HPIPE_PREFILL_GEMM``, as a pipeline's Load sends it; where it names none, each
    daemon's default, which its fingerprint names)."""
    prefill = asked_prefill_gemm()
    batches, tokens, contexts = axes
    request = pb.ProfileRequest(config_json=json.dumps(shape), dtype=TO_WIRE[DTYPES[dtype]], batches=batches,
                                tokens=tokens, contexts=contexts, max_len=max_len, repeats=repeats,
                                prefill_gemm=prefill)
    return request, [METHOD, shape, dtype, batches, tokens, contexts, repeats] + ([prefill] if prefill else [])


def _forecast(cluster, groups, clients, infos, key_parts, force, colocation, shape, dtype, axes, sweeps, max_len,
              rounds) -> tuple[str, dict[str, dict[int, float]]]:
    """A line saying about how long profiling will take, from a pilot timing of one block per daemon
    whose grid is not cached (a few milliseconds to a second each), and what each slice length of
    the grid will cost each of those daemons to time (which deals twins their shares)."""
    pilot_tokens = min(512, max_len)
    seconds, cached, costs = 0.0, 0, {}
    for group in groups.values():
        prints = sorted(infos[d.name].fingerprint for d in group) if colocation and len(group) > 1 else None
        todo = [d for d in group if force or not grid_path(key_parts, infos[d.name].fingerprint, prints).exists()]
        if prints and todo:  # measured together: all of them again, twins each a share (_group_grids)
            todo = list(group)
        piloted: dict[str, dict] = {}  # by fingerprint: twins are the same device, timed once
        for d in todo:
            print_ = infos[d.name].fingerprint
            if print_ not in piloted:
                t0 = time_stage(clients[d.name], d, shape, dtype, (1, 3), 1, pilot_tokens, 0, 1)
                tc = time_stage(clients[d.name], d, shape, dtype, (1, 3), 1, pilot_tokens, max_len // 2, 1)
                per_token = t0 / pilot_tokens
                per_context = max(tc - t0, 0.0) / (pilot_tokens * max(max_len // 2, 1))
                piloted[print_] = {t: estimate_seconds((axes[0], [t], axes[2]), sweeps, per_token, per_context)
                                   for t in axes[1]}
            costs[d.name] = piloted[print_]
        shares = twin_shares(todo, infos, axes[1], costs) if prints else {d.name: axes[1] for d in todo}
        per_daemon = [sum(costs[d.name][t] for t in shares[d.name]) for d in todo]
        cached += len(group) - len(todo)
        # daemons that share a machine measure their grids at the same time (sharing its CPUs: the
        # pilot ran alone), the others in turn
        if prints:
            threads, cpus = sum(infos[d.name].threads for d in group), infos[group[0].name].host_cpus
            on_cpus = infos[group[0].name].device == "cpu" and cpus
            seconds += max(per_daemon, default=0.0) * (max(1.0, threads / cpus) if on_cpus else 1.0)
        else:
            seconds += sum(per_daemon)
    n = len(cluster.daemons)
    seconds += 3.0 * n * max(1, rounds) + 2.0 * n * (n - 1)  # reference timings, links
    reuse = f"; {cached} grid(s) cached" if cached else ""
    return f"profiling {n} daemons up to {max_len} tokens: about {_duration(seconds)}{reuse}", costs


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def _host_cpu_costs(a, b, data_port: int, clients: dict[str, DaemonClient], act: int, repeats: int, largest: int):
    """What a message on the link costs the sender's and the receiver's host in CPU, outside their
    device workers: ((per message, per byte) sending, (per message, per byte) receiving).

    Both daemons are idle but for the probes, so the change in their ``host_cpu_s`` over a round
    of same-sized probes is what those messages cost; two sizes separate the per-message part."""
    src, dst = clients[a.name], clients[b.name]
    sizes = [min(act * t, largest) for t in HOST_CPU_TOKENS]
    sent, received = [], []
    for size in sizes:
        before = [_host_cpu(c) for c in (src, dst)]
        try:
            src.call("MeasureLink", pb.LinkRequest(target_address=b.address, target_data_port=data_port, sizes=[size],
                                                   repeats=repeats), timeout=300.0)
        except grpc.RpcError as e:
            raise daemon_error(a, f"could not measure the host CPU cost of its link to {b.name} ({b.address})", e) from None
        after = [_host_cpu(c) for c in (src, dst)]
        sent.append(after[0] - before[0])
        received.append(after[1] - before[1])
    messages = [repeats + 1] * len(sizes)  # MeasureLink sends each size once more, to warm up
    return fit_host_cpu(sizes, messages, sent), fit_host_cpu(sizes, messages, received)


def _status(client: DaemonClient) -> pb.StatusReply:
    return client.call("Status", pb.StatusRequest(), timeout=10.0)


def _host_cpu(client: DaemonClient) -> float:
    return _status(client).host_cpu_s


def _steal(client: DaemonClient) -> float | None:
    """The daemon's CPU steal counter (seconds since boot), or None where it does not know it."""
    return cpu_steal(_status(client))


def _group_grids(group, clients, infos, request, key_parts: list, force: bool, concurrent: bool, ref_args: tuple,
                 bar, costs: dict | None = None) -> tuple[dict[str, dict[str, ComputeGrid]], list[str]]:
    """Compute grids of the daemons of one share group (cached, or measured), and which came from the cache.

    ``concurrent``: the daemons share a machine or a GPU, and measure their grids at the same time,
    as a pipeline runs them. A daemon that finishes first keeps timing the reference stage until
    the last one is done, so every grid point is measured beside busy neighbours. The cache key
    then names the whole group, since a grid measured beside other devices describes them too.
    """
    group_prints = sorted(infos[d.name].fingerprint for d in group) if concurrent else None
    paths = {d.name: grid_path(key_parts, infos[d.name].fingerprint, group_prints) for d in group}
    reuse = [d for d in group if not force and paths[d.name].exists()]
    if concurrent and len(reuse) < len(group):
        reuse = []  # a grid measured together needs its neighbours measuring beside it
    out = {}
    for d in reuse:
        log.info("%s: reusing cached compute profile %s", d.name, paths[d.name].name)
        out[d.name] = load_grids(paths[d.name])
        bar.update(1)
    cached = [d.name for d in reuse]
    todo = [d for d in group if d not in reuse]

    def measure(d, tokens=None):
        asked = request
        if tokens is not None:
            asked = pb.ProfileRequest()
            asked.CopyFrom(request)
            del asked.tokens[:]
            asked.tokens.extend(tokens)
        try:
            reply = clients[d.name].call("ProfileCompute", asked, timeout=PROFILE_TIMEOUT_S)
        except grpc.RpcError as e:
            raise daemon_error(d, "failed to profile itself", e) from None
        got = grids_from_reply(d, reply)
        if tokens is None:
            store_grids(paths[d.name], got)
        bar.update(1)
        return got

    if not concurrent or not todo:
        for d in todo:
            bar.set_postfix_str(f"compute {d.name}")
            out[d.name] = measure(d)
        return out, cached

    bar.set_postfix_str("compute " + ", ".join(d.name for d in group) + " (together)")
    shape, dtype, ref = ref_args
    shares = twin_shares(group, infos, list(request.tokens), costs or {})
    lock, remaining, done, errors = threading.Lock(), [len(group)], threading.Event(), []

    def measure_then_load(d):
        try:
            tokens = shares[d.name]
            got = measure(d, tokens) if tokens else {}
        except BaseException as e:
            errors.append(e)
            done.set()
            raise
        with lock:
            remaining[0] -= 1
            if not remaining[0]:
                done.set()
        while not done.is_set():  # keep the machine as busy as a pipeline until all are measured
            time_reference(clients[d.name], d, shape, dtype, ref, LOAD_CHUNK_S)
        return got

    pool = ThreadPoolExecutor(max_workers=len(group))
    futures = [pool.submit(measure_then_load, d) for d in group]
    try:
        done.wait()
        if errors:  # fail now: the caller closes the channels, which ends the others' calls
            raise errors[0]
        parts = {d.name: f.result() for d, f in zip(group, futures)}
    finally:
        done.set()
        pool.shutdown(wait=False)
    for twins in group_twins(group, infos).values():
        whole = merge_grids([parts[d.name] for d in twins if parts[d.name]])
        store_grids(paths[twins[0].name], whole)  # twins share one cache path
        out.update({d.name: whole for d in twins})
    return out, cached
