"""``hpipe cluster up|down|status``: run the daemons of a cluster whose addresses are on this machine.

Each daemon is a separate process (its own session, log file and pid file under the cache
directory), so it can be killed, throttled or restarted on its own like a real device.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hpipe.core.cluster import ClusterSpec, DaemonSpec
from hpipe.core.errors import HpipeError
from hpipe.core.paths import cache_root
from runtime.channels import DaemonClient, Security

log = logging.getLogger(__name__)


def state_dir(cluster: ClusterSpec) -> Path:
    key = hashlib.sha256(str(cluster.path).encode()).hexdigest()[:10]
    d = cache_root() / "clusters" / f"{cluster.name}-{key}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def daemon_command(d: DaemonSpec) -> list[str]:
    """The command that starts daemon ``d`` on this machine."""
    return [sys.executable, "-m", "hpipe", "daemon", *d.options().argv()]


def _pid_alive(pid: int) -> bool:
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


def up(cluster: ClusterSpec, timeout_s: float = 180.0) -> dict[str, str]:
    """Start every local daemon that is not already serving; wait until all are healthy."""
    from runtime import emulate

    remote = [d.name for d in cluster.daemons if not (d.is_local or emulate.in_emulated_net(d.host))]
    if remote:
        raise HpipeError(f"cluster up starts local daemons only; start {', '.join(remote)} on their machines "
                         "with `hpipe daemon`")
    security = Security.of(cluster)
    sdir = state_dir(cluster)
    emu = None
    if emulate.needed(cluster):
        emulate.validate(cluster)
        emulate.require_root(cluster)
        emu = emulate.Emulation(cluster, sdir)
        emu.setup_network()
        emu.setup_mps()
    started: dict[str, subprocess.Popen] = {}
    status = {}
    for d in cluster.daemons:
        client = DaemonClient(d.address, security, d.name)
        if client.health(timeout=1.0):
            status[d.name] = "already running"
            client.close()
            continue
        client.close()
        logf = open(sdir / f"{d.name}.log", "ab")
        prefix = emu.command_prefix(d) if emu else []
        env = {**os.environ, **(emu.daemon_env(d) if emu else {})}
        if d.emulate:
            # part of the device fingerprint: a cached profile is reused only under the same limits
            settings = {**d.emulate, **({"quota_period_us": emulate.QUOTA_PERIOD_US} if "cpu_quota" in d.emulate else {})}
            env["HPIPE_EMULATION"] = ",".join(f"{k}={v}" for k, v in sorted(settings.items()))
        proc = subprocess.Popen(prefix + daemon_command(d), stdout=logf, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        (sdir / f"{d.name}.pid").write_text(f"{proc.pid}\n")
        started[d.name] = proc
    deadline = time.monotonic() + timeout_s
    for name, proc in started.items():
        d = cluster.daemon(name)
        client = DaemonClient(d.address, security, name)
        try:
            while not client.health(timeout=1.0):
                if proc.poll() is not None:
                    tail = (sdir / f"{name}.log").read_text(errors="replace")[-2000:]
                    raise HpipeError(f"daemon {name} ({d.address}) exited with code {proc.returncode}:\n{tail}")
                if time.monotonic() > deadline:
                    raise HpipeError(f"daemon {name} ({d.address}) not healthy after {timeout_s:.0f}s; "
                                     f"see {sdir / (name + '.log')}")
                time.sleep(0.2)
        finally:
            client.close()
        status[name] = f"started (pid {proc.pid})"
        if emu and d.emulate.get("cpu_quota") is not None:
            status[name] += f", {emu.limit_cpu(d, proc.pid)}"
    return status


def down(cluster: ClusterSpec, timeout_s: float = 15.0) -> dict[str, str]:
    sdir = state_dir(cluster)
    status = {}
    pids = {}
    for d in cluster.daemons:
        pidf = sdir / f"{d.name}.pid"
        if not pidf.exists():
            status[d.name] = "not started by hpipe"
            continue
        pid = int(pidf.read_text())
        if _pid_alive(pid):
            os.kill(pid, signal.SIGTERM)
            pids[d.name] = pid
        else:
            status[d.name] = "not running"
        pidf.unlink()
    deadline = time.monotonic() + timeout_s
    for name, pid in pids.items():
        while _pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
            status[name] = f"killed (pid {pid}, no exit after SIGTERM)"
        else:
            status[name] = f"stopped (pid {pid})"
    from runtime.emulate import Emulation

    for item in Emulation(cluster, sdir).teardown():
        status[f"emulation {item}"] = "removed"
    return status


def status(cluster: ClusterSpec) -> list[dict]:
    from runtime.wire import pb

    security = Security.of(cluster)
    rows = []
    for d in cluster.daemons:
        client = DaemonClient(d.address, security, d.name)
        row = {"name": d.name, "address": d.address, "device": d.device, "healthy": client.health(timeout=2.0)}
        if row["healthy"]:
            try:
                st = client.call("Status", pb.StatusRequest(), timeout=5.0)
                row.update(model=st.model, units=[[p.unit_start, p.unit_end] for p in st.parts] if st.loaded else None,
                           open_sequences=st.open_sequences, kv_bytes=st.kv_bytes, weight_bytes=st.weight_bytes)
            except Exception as e:  # noqa: BLE001 - report, do not fail the whole table
                row["error"] = str(e)
        client.close()
        rows.append(row)
    return rows
