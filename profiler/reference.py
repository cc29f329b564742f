"""The reference stage: one stage every daemon times, to compare its speed across time and neighbours.

``hpipe profile`` keeps each daemon's time (``meta.reference``) and, for daemons sharing a machine
or a GPU, how much slower each runs while the others compute too (``meta.colocation_factors``).
``hpipe bench --profile`` times it again (:func:`calibrate`) to tell machine drift from model
error.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from concurrent.futures import ThreadPoolExecutor

import grpc

from hpipe.core.cluster import ClusterSpec
from hpipe.core.config import ModelConfig
from hpipe.core.errors import HpipeError
from hpipe.core.profile import Profile
from hpipe.core.units import block_units
from hpipe.model.compute.stage import DTYPES
from hpipe.model.kernels.precision import asked_prefill_gemm
from runtime.wire.channels import DaemonClient, Security
from runtime.wire.messages import TO_WIRE, pb

log = logging.getLogger(__name__)

PROFILE_TIMEOUT_S = 900.0
#: rounds of (each alone, then all together) behind a co-location factor
COLOCATION_ROUNDS = 3


def daemon_error(d, what: str, e: grpc.RpcError) -> HpipeError:
    return HpipeError(f"daemon {d.name} ({d.address}) {what}: {e.code().name}: {e.details()}")


def time_stage(client, d, shape: dict, dtype: str, units: tuple[int, int], batch: int, tokens: int, context: int,
                repeats: int) -> float:
    try:
        return client.call("TimeStage", pb.StageTimeRequest(
            config_json=json.dumps(shape), dtype=TO_WIRE[DTYPES[dtype]], unit_start=units[0],
            unit_end=units[1], batch=batch, tokens=tokens, context=context, repeats=repeats,
            prefill_gemm=asked_prefill_gemm()),
            timeout=PROFILE_TIMEOUT_S).seconds
    except grpc.RpcError as e:
        raise daemon_error(d, "failed to time a stage", e) from None


#: the most weight bytes the reference stage holds: a 1/n share of an 8B model's blocks (10 of 32,
#: 1.3 GB at Q4_K_M) took 10-15 s a call on local-3, and the co-location rounds time it about 70
#: times (docs/decisions/profile-sweeps.md)
REFERENCE_BYTES = 256 << 20


def reference_stage(cfg: ModelConfig, n_devices: int, max_len: int, batch: int, block_bytes: float = 0) -> dict:
    """The stage every daemon times to compare speeds across time and co-location: a 1/n share of the
    model's blocks, no more than :data:`REFERENCE_BYTES` of them (``block_bytes``: one block's
    weights as the daemons hold them), over a slice of the size pipelines use (128 tokens) at a mid
    context.

    The slice size matters: co-located daemons that take turns on one core evict each other's
    cache, which costs a small slice more than a large one (on one core shared 60/30%, a matrix
    product whose weights fit the L2 cache ran 1.32x slower beside the other daemon; one that
    streams its weights from memory, 1.03x).
    """
    blocks = max(1, cfg.num_layers // max(1, n_devices))
    if block_bytes:
        blocks = min(blocks, max(1, int(REFERENCE_BYTES // block_bytes)))
    return {"units": [block_units(0)[0], block_units(blocks - 1)[1] + 1], "tokens": max(1, min(128, max_len // 4)), "context": max_len // 2,
            "batch": batch}


def time_reference(client, d, shape: dict, dtype: str, ref: dict, seconds: float) -> float:
    """Median seconds of the reference stage on ``d``, over about ``seconds`` of runs."""
    args = (shape, dtype, tuple(ref["units"]), ref["batch"], ref["tokens"], ref["context"])
    estimate = time_stage(client, d, *args, 1)
    return time_stage(client, d, *args, max(3, math.ceil(seconds / max(estimate, 1e-6))))


def colocation_factors(group, clients, shape: dict, dtype: str, ref: dict,
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
        alone = {d.name: time_reference(clients[d.name], d, shape, dtype, ref, 1.5) for d in group}
        for name, t in alone.items():
            alones[name].append(t)
        span = max(2.0, 3 * max(alone.values()))
        with ThreadPoolExecutor(max_workers=len(group)) as pool:
            together = dict(zip([d.name for d in group], pool.map(
                lambda d: time_reference(clients[d.name], d, shape, dtype, ref, span), group)))
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
    names = names or [d.name for d in profile.daemons]
    daemons = {d.name: d for d in cluster.daemons}
    missing = [n for n in names if n not in daemons or n not in ref["seconds"]]
    if missing:
        raise HpipeError(f"cannot calibrate {', '.join(missing)}: not in both the cluster and the profile")
    shape = profile.model.to_dict()
    security = Security.of(cluster)
    factors = {}
    for name in names:
        client = DaemonClient(daemons[name].address, security, name)
        try:
            now = time_reference(client, daemons[name], shape, profile.dtype, ref, seconds)
        finally:
            client.close()
        factors[name] = now / ref["seconds"][name]
    return factors
