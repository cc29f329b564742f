"""What a daemon holds: its current and peak memory, and handing freed memory back to the system.

On a CUDA device these are the caching allocator's allocation counters. On the CPU they are the
process's resident set, and that needs care: glibc keeps freed heap memory in its arenas (one per
thread that allocates), so after a stage is dropped, or after loading one (a checkpoint's plain
tensors freed once packed), the resident set still counts what nobody uses, and a later peak
mixes it in. :func:`release_free` asks glibc to return it (``malloc_trim``) before either
measure is taken.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import resource

import psutil
import torch


def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_TRIM = _malloc_trim()


def available(device: torch.device) -> int:
    """Bytes free on ``device`` now: GPU memory (with what this process's caching allocator holds
    unused), or the machine's available RAM."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0] + cached)
    return int(psutil.virtual_memory().available)


#: of a device's memory, what a share of it may hold in weights and KV pools (the rest: CUDA
#: contexts, activations, the other processes of a machine)
SHARE_USABLE = 0.9


def budget_of_share(device: torch.device, share: float) -> int:
    """A memory budget of ``share`` of ``device``'s memory (a GPU's total, or the machine's RAM)."""
    if device.type == "cuda":  # one this machine has (hpipe daemon checks it first: check_device)
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = psutil.virtual_memory().total
    return int(share * total * SHARE_USABLE)


def release_free(device: torch.device) -> None:
    """Collect garbage and return freed memory to the system (glibc arenas; CUDA's cache)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif _TRIM is not None:
        _TRIM(0)


def current(device: torch.device) -> int:
    """What the process holds now, in the measure of :func:`peak`, after :func:`release_free`."""
    release_free(device)
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return int(psutil.Process().memory_info().rss)


def resident(device: torch.device) -> int:
    """What the process holds now, read without collecting first (cheap enough for every Status):
    CUDA allocations, or the resident set."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return int(psutil.Process().memory_info().rss)


def peak(device: torch.device) -> int:
    """Peak since the last :func:`reset_peak`: CUDA allocations, or the resident set's high-water mark."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:  # the resident set's high-water mark: Linux's VmHWM, which psutil does not report
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def reset_peak(device: torch.device) -> None:
    """Start a new peak from what is held now (freed memory returned first)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    release_free(device)
    try:  # "5" resets the resident-set high-water mark (Linux)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
