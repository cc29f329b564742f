"""What a daemon measures about itself: device identity, free memory, and per-unit compute times.

Compute is timed on units with random weights of the model's real shape, so profiling needs no
checkpoint. Each grid point gets one warm-up run and ``repeats`` timed runs; the median is kept.
GPU work is synchronised before the clock is read.
"""

from __future__ import annotations

import hashlib
import os
import platform
import statistics
import time

import psutil
import torch

from hpipe.config import ModelConfig
from hpipe.model import StageModel
from hpipe.model.layers import Attention
from hpipe.model.rope import cos_sin
from hpipe.units import UnitRange


def _cgroup_quota() -> str:
    """This process's CPU quota (cgroup v1 ``cfs_quota_us/period`` or v2 ``cpu.max``), '' if none found."""
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return ""
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2 unified hierarchy
            try:
                return open(f"/sys/fs/cgroup{path}/cpu.max").read().strip()
            except OSError:
                continue
        if "cpu" in controllers.split(","):
            base = f"/sys/fs/cgroup/{controllers}{path}"
            try:
                return (open(f"{base}/cpu.cfs_quota_us").read().strip() + "/"
                        + open(f"{base}/cpu.cfs_period_us").read().strip())
            except OSError:
                continue
    return ""


def fingerprint(device: torch.device) -> str:
    """Identity of what determines speed: hardware, thread count, CPU quota, library versions."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        hw = f"{props.name}/{props.multi_processor_count}SM/{props.total_memory}/" \
             f"mps={os.environ.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE', '')}"
    else:
        cpu = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
        except OSError:
            pass
        hw = f"{cpu}/{psutil.cpu_count()}cpu/affinity={len(os.sched_getaffinity(0))}/quota={_cgroup_quota()}"
    sw = f"torch={torch.__version__}/threads={torch.get_num_threads()}"
    return hashlib.sha256(f"{hw}|{sw}".encode()).hexdigest()[:16] + f" {hw}"


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(psutil.virtual_memory().available)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn, device: torch.device, repeats: int) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def measure_units(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, batches, tokens, contexts,
                  max_len: int, repeats: int = 3, progress=None) -> dict[str, list]:
    """``{kind: seconds[b][s][c]}``; contexts apply to attention only (the others use context 0).

    Points with ``s + c > max_len`` are measured at the largest context that fits (the planner
    never asks for them).
    """
    body = StageModel.random(cfg, UnitRange(0, 3, cfg.num_layers), dtype=dtype, device=device)
    head = StageModel.random(cfg, UnitRange(cfg.num_units - 1, cfg.num_units, cfg.num_layers), dtype=dtype,
                             device=device)
    embed, attn, mlp = body.blocks["0"], body.blocks["1"], body.blocks["2"]
    head_unit = head.blocks[str(cfg.num_units - 1)]
    assert isinstance(attn, Attention)
    out = {k: [] for k in ("embed", "attn", "mlp", "head")}
    for b in batches:
        planes = {k: [] for k in out}
        for s in tokens:
            ids = torch.randint(0, cfg.vocab_size, (b, s), device=device)
            x = torch.randn(b, s, cfg.hidden_size, device=device, dtype=dtype)
            planes["embed"].append([_median_time(lambda: embed(ids), device, repeats)])
            planes["mlp"].append([_median_time(lambda: mlp(x), device, repeats)])
            planes["head"].append([_median_time(lambda: head_unit(x[:, -1:]), device, repeats)])
            row = []
            for c in contexts:
                c_eff = max(0, min(c, max_len - s))
                cache = body.new_cache(b, c_eff + s).layers[0]
                cos, sin = cos_sin(body.inv_freq, torch.arange(c_eff, c_eff + s, device=device), dtype)
                row.append(_median_time(lambda: attn(x, c_eff, cos, sin, cache), device, repeats))
                if progress:
                    progress()
            planes["attn"].append(row)
        for k in out:
            out[k].append(planes[k])
    return out
