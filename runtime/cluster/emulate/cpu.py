"""Emulated device speeds: a daemon pinned to cores (``taskset``) and its device worker under a
cgroup CPU quota.

On cgroup v1 only the daemon's worker thread (the one that runs every slice and every profiling
measurement) joins the group, so the emulated device is slow while its network stack is not, and
links are what ``tc`` makes them: the two separate resources the planner models. On cgroup v2 (no
per-thread groups outside threaded mode) the whole daemon joins. The quota period is 5 ms,
shorter than one unit's forward: with the kernel's default 100 ms a 30 ms matrix product fits
inside one period's budget and runs at full speed, so a 60% daemon would time as if it were
unthrottled for short work and 60% for long work (measured: 1.2x instead of 1.7x).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from hpipe.core.cluster import ClusterSpec, DaemonSpec
from runtime.cluster.emulate.state import State

log = logging.getLogger(__name__)

QUOTA_PERIOD_US = 5_000  # see the module docstring


#: the OS-level name of a daemon's worker thread (Linux keeps 15 characters)
WORKER_THREAD_NAME = "hpipe-worker"


def name_this_thread(name: str) -> None:
    """Give the calling thread an OS-level name (``/proc/<pid>/task/<tid>/comm``); a no-op off Linux."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # 15 = PR_SET_NAME
    except (OSError, AttributeError):
        pass


def find_thread(pid: int, name: str, timeout_s: float) -> int | None:
    """The id of ``pid``'s thread named ``name``, waiting up to ``timeout_s`` for it to appear."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                if (task / "comm").read_text().strip() == name:
                    return int(task.name)
        except OSError:
            pass
        if time.monotonic() > deadline:
            return None
        time.sleep(0.1)


def pin_prefix(d: DaemonSpec) -> list[str]:
    """The command prefix that pins ``d`` to its cores (none if it names none)."""
    return ["taskset", "-c", str(d.emulate["cpus"])] if d.emulate.get("cpus") is not None else []


def limit_cpu(cluster: ClusterSpec, record: State, d: DaemonSpec, pid: int, timeout_s: float = 30.0) -> str:
    """Put daemon ``pid``'s worker thread (cgroup v1) or whole process (v2) under its CPU quota.

    Call it once the daemon serves: its worker thread exists and carries its name by then.
    Returns what was limited, for the launcher's report.
    """
    quota = d.emulate.get("cpu_quota")
    if quota is None:
        return ""
    if d.threads and float(quota) >= d.threads:
        # a quota its threads cannot exceed only throttles at period edges (a 100% daemon was
        # throttled 339 times in one bench run, 1% of its time)
        return f"{float(quota):.0%} of a core: no quota needed for {d.threads} thread(s)"
    state = record.read()
    period = QUOTA_PERIOD_US
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cpu.cfs_quota_us").exists():
        group = v1 / "hpipe" / f"{cluster.name}-{d.name}"
        group.mkdir(parents=True, exist_ok=True)
        (group / "cpu.cfs_period_us").write_text(str(period))
        (group / "cpu.cfs_quota_us").write_text(str(int(float(quota) * period)))
    else:
        group = Path("/sys/fs/cgroup") / "hpipe" / f"{cluster.name}-{d.name}"
        group.mkdir(parents=True, exist_ok=True)
        (group / "cpu.max").write_text(f"{int(float(quota) * period)} {period}")
    if str(group) not in state["cgroups"]:
        state["cgroups"].append(str(group))
    record.write(state)
    if (group / "tasks").exists():  # v1: the device thread alone
        tid = find_thread(pid, WORKER_THREAD_NAME, timeout_s)
        if tid is not None:
            (group / "tasks").write_text(str(tid))
            return f"worker thread {tid} at {float(quota):.0%} of a core"
        log.warning("daemon %s: no %s thread found; limiting the whole process", d.name, WORKER_THREAD_NAME)
    (group / "cgroup.procs").write_text(str(pid))
    return f"process {pid} at {float(quota):.0%} of a core"


def teardown(state: dict) -> list[str]:
    removed = []
    for group in state.get("cgroups", []):
        try:
            os.rmdir(group)
            removed.append(group)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("could not remove cgroup %s: %s", group, e)
        try:
            os.rmdir(Path(group).parent)  # the shared "hpipe" parent, once no cluster uses it
        except OSError:
            pass
    return removed
