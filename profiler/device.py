"""What a daemon measures about itself: device identity, free memory, and per-unit compute times.

Compute is timed on units with random weights of the model's real shape, so profiling needs no
checkpoint. The grid is swept ``repeats`` times, each point timed once per sweep (several runs for
short points), after one warm-up run; the median of a point's runs is kept. Sweeping rather than
timing each point's runs back to back spreads a point's samples over the whole measurement, so a
few seconds of machine slowdown spoil one sample of many points, which the median drops, rather
than every sample of one point, which it keeps. GPU work is synchronised before the clock is read.
"""

from __future__ import annotations

import hashlib
import math
import os
import platform
import statistics
import time

import psutil
import torch

from hpipe.core import cpuinfo
from hpipe.core.config import ModelConfig
from hpipe.core.units import UnitRange
from hpipe.model.compute import packed, stage_kernel
from hpipe.model.compute.layers import Attention, FeedForward
from hpipe.model.compute.linear import prefill_rows
from hpipe.model.compute.stage import StageModel
from hpipe.model.kernels import library
from hpipe.model.kernels.precision import asked_prefill_gemm
from hpipe.model.kv.cache import StageCache
from hpipe.model.kv.pool import BatchKV
from hpipe.model.weights.blocks import TYPES
from profiler.grid import LONG_CALL_S, LONG_SWEEPS


def _cgroup_quota() -> str:
    """This process's CPU quota (cgroup v1 ``cfs_quota_us/period`` or v2 ``cpu.max``), '' if none found."""
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return ""
    for line in lines:
        _, controllers, path = line.split(":", 2)
        # `ip netns exec` remounts /sys, hiding the cgroup tree: fall back to init's view of it.
        for root in ("", "/proc/1/root"):
            if controllers == "":  # v2 unified hierarchy
                try:
                    return open(f"{root}/sys/fs/cgroup{path}/cpu.max").read().strip()
                except OSError:
                    continue
            if "cpu" in controllers.split(","):
                base = f"{root}/sys/fs/cgroup/{controllers}{path}"
                try:
                    return (open(f"{base}/cpu.cfs_quota_us").read().strip() + "/"
                            + open(f"{base}/cpu.cfs_period_us").read().strip())
                except OSError:
                    continue
    return ""


def host_id() -> str:
    """Which machine (boot) this process runs on: daemons with the same id share its memory."""
    try:
        return open("/proc/sys/kernel/random/boot_id").read().strip()
    except OSError:
        return platform.node()


def cpu_counts() -> tuple[int, int]:
    """(CPUs this process may run on, CPUs the machine has online); 0 where unknown."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    return usable, psutil.cpu_count() or 0


#: the environment that changes the kernels a CPU daemon computes with: instruction-set caps
#: (scripts/avx2.env) and the decode rows' arithmetic (docs/decisions/int8-decode.md)
KERNEL_ENV = ("HPIPE_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY",
              "HPIPE_DECODE_DOT")


def fingerprint(device: torch.device) -> str:
    """Identity of what determines speed: hardware, thread count, CPU quota, library versions."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        hw = f"{props.name}/{props.multi_processor_count}SM/{props.total_memory}/" \
             f"mps={os.environ.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE', '')}"
    else:
        cpu = cpuinfo.model_name()
        # HPIPE_EMULATION: the limits `hpipe cluster up` applied (a network namespace may hide the cgroup files)
        usable, online = cpu_counts()
        hw = (f"{cpu}/{online}cpu/affinity={usable}/quota={_cgroup_quota()}"
              f"/emulation={os.environ.get('HPIPE_EMULATION', '')}")
    # the kernels a stage runs: float32 CPU projections are packed for MKL where that pays; quantized
    # prefill rows in bfloat16 by default unless the daemon's environment says float32
    packs = device.type == "cpu" and packed.pays()
    # (decode rows of K-quants in 15-bit integers by default since #62: grids timed before differ)
    sw = (f"torch={torch.__version__}/threads={torch.get_num_threads()}/mkl_packed={int(packs)}"
          f"/prefill={asked_prefill_gemm() if device.type == 'cpu' else ''}"
          f"/decode={'int15' if device.type == 'cpu' else ''}")
    if device.type == "cpu":  # an instruction set capped (scripts/avx2.env), integer decode rows
        env = [f"{k}={os.environ[k]}" for k in KERNEL_ENV if os.environ.get(k)]
        sw += f"/env={','.join(env)}" if env else ""
        # the kernels' build (their source's hash; nothing built to ask): grids timed with other
        # kernels are not reused
        sw += f"/kernels={'off' if library.switched_off() else library.name()}"
    return hashlib.sha256(f"{hw}|{sw}".encode()).hexdigest()[:16] + f" {hw}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


#: Distinct copies of a unit are rotated through so that the timed unit's weights are as cold as
#: in a real stage, which streams many units' weights per slice. Timing one unit over and over
#: keeps its weights in the last-level cache and under-reports small slices (measured on a 2-core
#: Xeon VM, SmolLM2 MLP: 1.36x at 16 tokens, 1.07x at 512).
WORKING_SET_BYTES = 256 << 20
#: Short points are repeated until this much time is measured (more samples, steadier medians).
MIN_MEASURED_S = 0.06
MAX_REPEATS = 25
#: the most calls a short point makes over all sweeps (64 per sample at the default 7 sweeps)
MAX_SWEEP_CALLS = 7 * 64
#: Untimed calls of each point before its first timed one. One was not enough on a CPU: with one,
#: the first timed call of SmolLM2's MLP (128-2048 tokens) ran up to 3x the point's median in a
#: throttled co-located daemon, and 1.0-1.33x in-process, which biased a median of three sweeps
#: up. The likely cause is the heap: freeing the first call's mmapped buffers raises glibc's mmap
#: threshold, so the second call allocates from a heap that still has to grow.
WARMUP_CALLS = 2


def _median_time(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` after one warm-up: at least ``repeats`` runs, more for short calls."""
    fn()
    _sync(device)
    return statistics.median(_runs(fn, device, repeats, MIN_MEASURED_S, MAX_REPEATS))


def _runs(fn, device: torch.device, at_least: int, min_total_s: float, at_most: int) -> list[float]:
    """Seconds of successive ``fn()`` calls: ``at_least`` runs, more while under ``min_total_s`` (to ``at_most``)."""
    times: list[float] = []
    while len(times) < at_least or (sum(times) < min_total_s and len(times) < at_most):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def swept_medians(points, sweeps: int, device: torch.device, min_total_s: float = MIN_MEASURED_S,
                  max_runs: int = MAX_SWEEP_CALLS) -> dict:
    """Median seconds per point, measured over ``sweeps`` passes of the whole grid.

    ``points(sweep)`` yields ``(key, fn)`` for every point, the same keys each sweep. The first
    sweep warms each point up (``WARMUP_CALLS`` untimed calls). Each sweep takes one sample of a
    point: one call, or, for a short point, the mean of calls made back to back until they fill its
    share (``1 / sweeps``) of ``min_total_s`` or reach ``max_runs``. Back to back, as a busy stage
    runs its units: a device whose speed is a CPU quota runs a call shorter than its budget per
    quota period at full speed, and only a run of calls shows the rate it sustains (the emulated
    cluster's 30% daemon read SmolLM2's MLP at one token as 1.4 ms one call at a time, as fast as
    the full core, and as 9.5 ms back to back). A long point (its first call ``LONG_CALL_S`` or
    more) is warmed up by that one call and timed in the first ``LONG_SWEEPS`` sweeps only.
    """
    sweeps = max(1, sweeps)
    per_sweep_s, per_sweep_runs = min_total_s / sweeps, max(1, max_runs // sweeps)
    samples: dict = {}
    long: set = set()
    for sweep in range(sweeps):
        for key, fn in points(sweep):
            if sweep == 0:  # warm-up: first-call allocations, heap growth and kernel selection
                for _ in range(WARMUP_CALLS):
                    t0 = time.perf_counter()
                    fn()
                    _sync(device)
                    if time.perf_counter() - t0 >= LONG_CALL_S:  # a long point (profiler.grid.LONG_CALL_S)
                        long.add(key)
                        break
            if key in long and sweep >= LONG_SWEEPS:
                continue
            samples.setdefault(key, []).append(statistics.fmean(_runs(fn, device, 1, per_sweep_s, per_sweep_runs)))
    return {key: statistics.median(t) for key, t in samples.items()}


class _Rotation:
    """Calls ``run(copy)`` on the next of several distinct unit copies each time it is called."""

    def __init__(self, copies: list, run):
        self.copies, self.run, self.i = copies, run, 0

    def __call__(self):
        copy = self.copies[self.i % len(self.copies)]
        self.i += 1
        return self.run(copy)


def copies_for(cfg: ModelConfig, dtype: torch.dtype, weight_type: int = 0) -> int:
    """How many distinct blocks (attention + MLP) make a working set of about WORKING_SET_BYTES."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if weight_type:
        _, values, nbytes = TYPES[weight_type]
        itemsize = nbytes / values
    block = cfg.block_weights
    # ceil, not //: a quantized block's bytes per value may be fractional
    return max(1, min(cfg.num_layers, math.ceil(WORKING_SET_BYTES / (block * itemsize))))


def _zeroed(cache: StageCache) -> StageCache:
    """A cache whose slots hold zeros, not whatever memory was there (NaNs or denormals would time
    differently from real keys)."""
    if cache.pool is not None:
        for t in (*cache.pool.k.values(), *cache.pool.v.values()):
            t.zero_()
    return cache


@torch.inference_mode()
def measure_units(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, batches, tokens, contexts,
                  max_len: int, repeats: int = 3, progress=None, weight_type: int = 0) -> dict[str, list]:
    """``{kind: seconds[b][s][c]}``; contexts apply to attention only (the others use context 0).

    Every grid point is measured where it lies, ``s + c`` past ``max_len`` included, so that
    interpolation near the edge of what the planner asks for is not biased by clamped points.
    """
    n = copies_for(cfg, dtype, weight_type)
    body = StageModel.random(cfg, UnitRange(0, 1 + 2 * n, cfg.num_layers), dtype=dtype, device=device,
                             weight_type=weight_type)
    head = StageModel.random(cfg, UnitRange(cfg.num_units - 1, cfg.num_units, cfg.num_layers), dtype=dtype,
                             device=device, weight_type=weight_type)
    embed = body.blocks["0"]
    attns = [body.blocks[str(1 + 2 * i)] for i in range(n)]
    mlps = [body.blocks[str(2 + 2 * i)] for i in range(n)]
    assert all(isinstance(a, Attention) for a in attns)
    head_unit = head.blocks[str(cfg.num_units - 1)]
    # a daemon computes a micro-batch of one-token decode entries through the C++ decode kernel
    # (hpipe.model.compute.stage_kernel) where it applies: those points are timed through it too
    # (SmolLM2 Q4_1, one thread, capped at AVX2: an attention unit's one token at context 512 took
    # 0.31 ms through the units in Python, 0.19-0.20 through the kernel; the MLP's 0.30 and 0.27)
    kernel = library.applies(device, dtype)
    kernel = kernel and all(isinstance(m, FeedForward) for m in mlps)
    kernel_attns = [stage_kernel.StageKernel([a], cfg) for a in attns] if kernel else []
    kernel_mlps = [stage_kernel.StageKernel([m], cfg) for m in mlps] if kernel else []
    longest = max(tokens) + max(contexts)
    out = {k: [] for k in ("embed", "attn", "mlp", "head")}
    for b in batches:
        # one cache per attention copy, long enough for every point; a slice at context c writes
        # [c, c+s) and attends to [0, c+s) of it, as an entry of a micro-batch does in a daemon's pool
        caches = [_zeroed(StageCache.allocate([a.layer], b, longest, cfg.num_kv_heads, cfg.head_dim, dtype, device))
                  for a in attns]
        for cache in caches:
            cache.entries(0, longest, "none")  # take every block now: the points only read and write them
        kv = list(zip(attns, caches))

        def points(sweep: int, b=b, kv=kv):
            # alternate direction, so that a slow drift does not always favour the same end of the grid
            for i, s in list(enumerate(tokens))[::(-1 if sweep % 2 else 1)]:
                ids = torch.randint(0, cfg.vocab_size, (b, s), device=device)
                x = torch.randn(b, s, cfg.hidden_size, device=device, dtype=dtype)
                # the rows of slices of two tokens or more are prefill's, as a daemon's stage marks
                # them: quantized projections multiply them in bfloat16 where the prefill does
                rows = torch.ones(b * s, dtype=torch.bool) if s > 1 and body.low_precision_prefill else None
                decode = kernel and s == 1  # b one-token entries: as the daemon decodes them
                yield ("embed", i, 0), lambda: embed(ids)
                if decode:
                    yield ("mlp", i, 0), _Rotation(list(zip(kernel_mlps, caches)),
                                                   _through_kernel(body, x.reshape(b, cfg.hidden_size), 0))
                else:
                    yield ("mlp", i, 0), _Rotation(mlps, _as_rows(rows, lambda m: m(x)))
                yield ("head", i, 0), lambda: head_unit(x[:, -1:])
                flat = x.reshape(1, b * s, cfg.hidden_size)
                for j, c in enumerate(contexts):
                    if decode:
                        yield ("attn", i, j), _Rotation(list(zip(kernel_attns, caches)),
                                                        _through_kernel(body, flat[0], c))
                        continue
                    tables = body.rotations(torch.arange(c, c + s, device=device).repeat(b))
                    batches_kv = {id(cache): BatchKV(cache.entries(c, s, "none"), cache.pool, device)
                                  for _, cache in kv}
                    yield ("attn", i, j), _Rotation(kv, _as_rows(rows, lambda ac, t=tables, bkv=batches_kv:
                                                                 ac[0](flat, *t[ac[0].rope], bkv[id(ac[1])])))
                if progress:
                    progress()

        medians = swept_medians(points, repeats, device)
        for k in out:
            width = len(contexts) if k == "attn" else 1
            out[k].append([[medians[(k, i, j)] for j in range(width)] for i in range(len(tokens))])
        del caches, kv
    return out


def _through_kernel(body: StageModel, x: torch.Tensor, context: int):
    """A call of ``(kernel, cache)``: the rows of ``x [b, hidden]``, one decode token of each of the
    cache's ``b`` sequences at position ``context``, through the decode kernel of one unit."""
    tables = body.rotations(torch.full((x.shape[0],), context, dtype=torch.long))

    def run(pair):
        unit, cache = pair
        return unit(x, tables, cache.entries(context, 1, "none", prefill=False), cache.pool)
    return run


def _as_rows(rows: torch.Tensor | None, fn):
    """``fn`` run with ``rows`` marked as prefill's (:func:`hpipe.model.compute.linear.prefill_rows`)."""
    def run(*args):
        with prefill_rows(rows):
            return fn(*args)
    return run


#: the random-weight stages time_stage built last, kept for the next call with the same shape:
#: ``(key, [(stage, cache)])``. Co-located daemons time a stage together for a few seconds, and
#: building the weights anew each call (up to ~1 s on a throttled CPU) would leave them timing
#: while others still build. One entry: a different stage replaces it; ``release_timed_stages``
#: frees it (a daemon does, on deploying).
_built: tuple | None = None


def release_timed_stages() -> None:
    global _built
    if _built is None:
        return
    on_gpu = _built[0][2].startswith("cuda")
    _built = None
    if on_gpu:
        torch.cuda.empty_cache()  # give the memory back for the stage being deployed


def _stages_for(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, units: UnitRange, batch: int,
                length: int, weight_type: int = 0) -> list:
    global _built
    key = (cfg, dtype, str(device), units, batch, length, weight_type)
    if _built is not None and _built[0] == key:
        return _built[1]
    _built = None  # free the old stage before building the new one
    first = StageModel.random(cfg, units, dtype=dtype, device=device, weight_type=weight_type)
    weight_bytes = first.weight_bytes()
    n = max(1, min(8, WORKING_SET_BYTES // max(weight_bytes, 1)))
    stages = [first] + [StageModel.random(cfg, units, dtype=dtype, device=device, seed=i, weight_type=weight_type)
                        for i in range(1, n)]
    caches = [_zeroed(StageCache.allocate(units.attention_layers(), batch, length, cfg.num_kv_heads,
                                          cfg.head_dim, dtype, device)) for _ in stages]
    _built = (key, list(zip(stages, caches)))
    return _built[1]


@torch.inference_mode()
def time_stage(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, units: UnitRange, batch: int,
               tokens: int, context: int, repeats: int = 5, weight_type: int = 0) -> float:
    """Median seconds of one forward of a random-weight stage over ``units`` (a direct measurement).

    Like :func:`measure_units`, it rotates through distinct copies of the stage up to about
    ``WORKING_SET_BYTES``, so a small stage is not timed with its weights hot in the cache. The
    copies are kept for the next call of the same shape (see ``_built``).
    """
    pairs = _stages_for(cfg, dtype, device, units, batch, context + tokens, weight_type)
    if units.has_embed:
        x = torch.randint(0, cfg.vocab_size, (batch, tokens), device=device)
    else:
        x = torch.randn(batch, tokens, cfg.hidden_size, device=device, dtype=dtype)

    def run(pair):
        stage, cache = pair
        cache.length = context  # the prefix's values do not change the work
        stage(x, context, cache)

    return _median_time(_Rotation(pairs, run), device, repeats)
