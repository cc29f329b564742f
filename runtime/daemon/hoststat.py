"""CPU time the hypervisor took from this machine ("steal"), from psutil (Linux's ``/proc/stat``), and
the CPU time a daemon spends outside its device worker.

On a virtual machine the physical cores behind the virtual CPUs may also run other guests. The
time a virtual CPU was ready to run but was not given its core is counted as steal. A bench run
that lost CPU time this way is slower for a reason no schedule can fix, and a profile taken
while the host was busy reads its devices slow. So each daemon reports the steal on its own CPUs
(``StatusReply.cpu_steal_s``); ``hpipe bench`` shows it per run, and ``hpipe profile`` keeps what
each daemon lost while it was profiled (``meta.steal_s``).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Iterable

import psutil

from hpipe.core import cpuinfo


def steal_seconds(cpus: Iterable[int] | None = None, times: list | None = None) -> float | None:
    """Steal since boot, in seconds summed over ``cpus`` (default: the CPUs this process may run on),
    from psutil's per-CPU times (``/proc/stat`` on Linux).

    ``None`` where it cannot be known: a platform or kernel without steal accounting, or none of
    ``cpus`` listed. ``times`` is psutil's per-CPU list (for tests)."""
    if times is None:
        try:
            times = psutil.cpu_times(percpu=True)
        except (OSError, NotImplementedError):
            return None
    if cpus is None and hasattr(os, "sched_getaffinity"):
        cpus = os.sched_getaffinity(0)
    wanted = range(len(times)) if cpus is None else [c for c in cpus if 0 <= c < len(times)]
    steal = [getattr(times[c], "steal", None) for c in wanted]
    if not steal or any(s is None for s in steal):
        return None
    return float(sum(steal))


def thread_clock(thread: threading.Thread) -> int | None:
    """The CPU-time clock of ``thread``, to be taken while it runs (None where the platform has no
    per-thread clocks). Reading the clock later needs no thread descriptor: asking for a thread's
    clock after the thread had ended (``pthread_getcpuclockid``) crashed a daemon that answered
    ``Status`` while it stopped."""
    try:
        return time.pthread_getcpuclockid(thread.ident)
    except (AttributeError, OSError):
        return None


def host_cpu_seconds(worker_clock: int | None) -> float:
    """CPU seconds this process has used outside the worker thread whose clock is ``worker_clock``
    (:func:`thread_clock`; connections, sender, RPC) since it started: what moving activations costs
    the host, apart from compute. Once the worker has ended, the process's whole CPU time."""
    total = time.process_time()
    if worker_clock is None:
        return total
    try:
        inside = time.clock_gettime(worker_clock)
    except OSError:  # the worker has ended: the kernel refuses its clock
        return total
    return max(total - inside, 0.0)


@functools.lru_cache(maxsize=None)
def device_name(device: str) -> str:
    """The model name of the GPU ``device`` ("cuda:0") or of this machine's CPU, for people to read."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(device)
    return cpuinfo.model_name()
