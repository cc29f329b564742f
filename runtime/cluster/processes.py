"""Daemons as local processes: where their pid and log files live, starting one, waiting until it
answers, and whether a pid is still alive. Shared by ``hpipe cluster up|down`` and the supervisor."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

from hpipe.core.cluster import ClusterSpec, DaemonSpec
from hpipe.core.errors import HpipeError
from hpipe.core.paths import cache_root
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
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child still answers kill(0): look at its state
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


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
    deadline = time.monotonic() + timeout_s
    try:
        while not client.health(timeout=1.0):
            if proc.poll() is not None:
                tail = (sdir / f"{d.name}.log").read_text(errors="replace")[-2000:]
                raise HpipeError(f"daemon {d.name} ({d.address}) exited with code {proc.returncode}:\n{tail}")
            if time.monotonic() > deadline:
                raise HpipeError(f"daemon {d.name} ({d.address}) not healthy after {timeout_s:.0f}s; "
                                 f"see {sdir / (d.name + '.log')}")
            time.sleep(0.2)
    finally:
        client.close()
    status = f"started (pid {proc.pid})"
    if emu and d.emulate.get("cpu_quota") is not None:
        status += f", {emu.limit_cpu(d, proc.pid)}"
    return status


def emulation(cluster: ClusterSpec, sdir: Path):
    from runtime.cluster import emulate

    return emulate.Emulation(cluster, sdir) if emulate.needed(cluster) else None
