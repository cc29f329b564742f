"""Daemons as local processes: where their pid and log files live, starting one, waiting until it
answers, and whether a pid is still alive. Shared by ``hpipe cluster up|down`` and the supervisor."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import psutil

from hpipe.core.cluster import ClusterSpec, DaemonSpec
from hpipe.core.errors import HpipeError
from hpipe.core.paths import cache_root
from hpipe.core.retry import poll
from runtime.wire.channels import DaemonClient, Security

#: the supervisor restarts one daemon at most this many times within the window
MAX_RESTARTS = 5
RESTART_WINDOW_S = 600.0
SUPERVISOR_PID = "supervisor.pid"


def read_pid(path: Path) -> int:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return 0


def state_dir(cluster: ClusterSpec) -> Path:
    key = hashlib.sha256(str(cluster.path).encode()).hexdigest()[:10]
    d = cache_root() / "clusters" / f"{cluster.name}-{key}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def daemon_command(d: DaemonSpec) -> list[str]:
    """The command that starts daemon ``d`` on this machine."""
    return [sys.executable, "-m", "hpipe", "daemon", *d.options().argv()]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, ended but not reaped, does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def stop_all(pids: list[int], timeout_s: float) -> set[int]:
    """SIGTERM to each of ``pids``, SIGKILL to those still running ``timeout_s`` later; the pids
    that had to be killed."""
    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            p.terminate()
            procs.append(p)
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5.0)
    return {p.pid for p in alive}


def spawn(d: DaemonSpec, sdir: Path, emu) -> subprocess.Popen:
    """Start daemon ``d`` as a process of its own (log and pid file in ``sdir``)."""
    from runtime.cluster import emulate

    logf = open(sdir / f"{d.name}.log", "ab")
    prefix = emu.command_prefix(d) if emu else []
    env = {**os.environ, **(emu.daemon_env(d) if emu else {})}
    if d.emulate:
        # part of the device fingerprint: a cached profile is reused only under the same limits
        settings = {**d.emulate, **({"quota_period_us": emulate.QUOTA_PERIOD_US} if "cpu_quota" in d.emulate else {})}
        env["HPIPE_EMULATION"] = ",".join(f"{k}={v}" for k, v in sorted(settings.items()))
    if emu and d.token_file is None and not d.is_local:
        # a host of the emulated network: a namespace on this machine, reachable from it alone
        d = dataclasses.replace(d, insecure=True)
    proc = subprocess.Popen(prefix + daemon_command(d), stdout=logf, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    logf.close()
    (sdir / f"{d.name}.pid").write_text(f"{proc.pid}\n")
    return proc


def await_healthy(d: DaemonSpec, proc: subprocess.Popen, security: Security, sdir: Path, emu,
                   timeout_s: float) -> str:
    """Wait until ``proc`` (daemon ``d``) answers health checks; put it under its CPU quota."""
    client = DaemonClient(d.address, security, d.name)

    def healthy() -> bool:
        if client.health(timeout=1.0):
            return True
        if proc.poll() is not None:
            tail = (sdir / f"{d.name}.log").read_text(errors="replace")[-2000:]
            raise HpipeError(f"daemon {d.name} ({d.address}) exited with code {proc.returncode}:\n{tail}")
        return False

    try:
        if not poll(healthy, timeout_s, 0.2):
            raise HpipeError(f"daemon {d.name} ({d.address}) not healthy after {timeout_s:.0f}s; "
                             f"see {sdir / (d.name + '.log')}")
    finally:
        client.close()
    status = f"started (pid {proc.pid})"
    if emu and d.emulate.get("cpu_quota") is not None:
        status += f", {emu.limit_cpu(d, proc.pid)}"
    return status


def emulation(cluster: ClusterSpec, sdir: Path):
    from runtime.cluster import emulate

    return emulate.Emulation(cluster, sdir) if emulate.needed(cluster) else None
