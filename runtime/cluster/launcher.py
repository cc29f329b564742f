"""``hpipe cluster up|down|status``: run the daemons of a cluster whose addresses are on this machine.

Each daemon is a separate process (its own session, log file and pid file under the cache
directory), so it can be killed, throttled or restarted on its own like a real device. A
supervisor process, started by ``up`` and stopped first by ``down``, restarts a daemon that dies
(a bounded number of times, logged in ``supervisor.log`` there); a coordinator whose pipeline broke
then finds it serving again and redeploys (:mod:`runtime.coordinator.recovery`).
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
from runtime.wire.channels import DaemonClient, Security

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


def _spawn(d: DaemonSpec, sdir: Path, emu) -> subprocess.Popen:
    """Start daemon ``d`` as a process of its own (log and pid file in ``sdir``)."""
    from runtime.cluster import emulate

    logf = open(sdir / f"{d.name}.log", "ab")
    prefix = emu.command_prefix(d) if emu else []
    env = {**os.environ, **(emu.daemon_env(d) if emu else {})}
    if d.emulate:
        # part of the device fingerprint: a cached profile is reused only under the same limits
        settings = {**d.emulate, **({"quota_period_us": emulate.QUOTA_PERIOD_US} if "cpu_quota" in d.emulate else {})}
        env["HPIPE_EMULATION"] = ",".join(f"{k}={v}" for k, v in sorted(settings.items()))
    proc = subprocess.Popen(prefix + daemon_command(d), stdout=logf, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    logf.close()
    (sdir / f"{d.name}.pid").write_text(f"{proc.pid}\n")
    return proc


def _await_healthy(d: DaemonSpec, proc: subprocess.Popen, security: Security, sdir: Path, emu,
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


def _emulation(cluster: ClusterSpec, sdir: Path):
    from runtime.cluster import emulate

    return emulate.Emulation(cluster, sdir) if emulate.needed(cluster) else None


def up(cluster: ClusterSpec, timeout_s: float = 180.0, restart: bool = True) -> dict[str, str]:
    """Start every local daemon that is not already serving; wait until all are healthy. With
    ``restart``, a supervisor process (:func:`supervise`) then restarts any that dies."""
    from runtime.cluster import emulate

    remote = [d.name for d in cluster.daemons if not (d.is_local or emulate.in_emulated_net(d.host))]
    if remote:
        raise HpipeError(f"cluster up starts local daemons only; start {', '.join(remote)} on their machines "
                         "with `hpipe daemon` (`hpipe daemon --print-systemd-unit` writes a unit that restarts it)")
    security = Security.of(cluster)
    sdir = state_dir(cluster)
    emu = _emulation(cluster, sdir)
    if emu:
        emulate.validate(cluster)
        emulate.require_root(cluster)
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
        started[d.name] = _spawn(d, sdir, emu)
    try:
        for name, proc in started.items():
            status[name] = _await_healthy(cluster.daemon(name), proc, security, sdir, emu, timeout_s)
    except HpipeError:
        for name, proc in started.items():  # leave nothing running behind a failed start
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
            (sdir / f"{name}.pid").unlink(missing_ok=True)
        raise
    if restart and cluster.path is not None and not _pid_alive(_read_pid(sdir / SUPERVISOR_PID)):
        logf = open(sdir / "supervisor.log", "ab")
        sup = subprocess.Popen([sys.executable, "-m", "hpipe", "cluster", "supervise", str(cluster.path)],
                               stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               start_new_session=True)
        logf.close()
        (sdir / SUPERVISOR_PID).write_text(f"{sup.pid}\n")
        status["supervisor"] = f"running (pid {sup.pid}): restarts a daemon that dies, {MAX_RESTARTS} times " \
                               f"in {RESTART_WINDOW_S // 60:.0f} min at most"
    return status


#: the supervisor restarts one daemon at most this many times within the window
MAX_RESTARTS = 5
RESTART_WINDOW_S = 600.0
SUPERVISOR_PID = "supervisor.pid"


def _read_pid(path: Path) -> int:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return 0


def supervise(cluster: ClusterSpec, poll_s: float = 0.1, timeout_s: float = 180.0) -> None:
    """Restart the cluster's daemons that die, while ``cluster up`` stands: until ``cluster down``
    removes the supervisor's pid file, or no daemon pid file is left. A daemon that dies
    :data:`MAX_RESTARTS` times within :data:`RESTART_WINDOW_S` is left down (and logged)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    sdir = state_dir(cluster)
    me = sdir / SUPERVISOR_PID
    security = Security.of(cluster)
    emu = _emulation(cluster, sdir)
    children: dict[str, subprocess.Popen] = {}  # the daemons it restarted (its children: reaped here)
    deaths: dict[str, list[float]] = {d.name: [] for d in cluster.daemons}
    log.info("supervising %s (%d daemons)", cluster.name, len(cluster.daemons))
    while _read_pid(me) == os.getpid():
        pidfiles = {d.name: sdir / f"{d.name}.pid" for d in cluster.daemons}
        if not any(p.exists() for p in pidfiles.values()):
            break
        for d in cluster.daemons:
            pid = _read_pid(pidfiles[d.name])
            if not pid:
                continue
            child = children.get(d.name)
            alive = child.poll() is None if child is not None and child.pid == pid else _pid_alive(pid)
            if alive:
                continue
            now = time.monotonic()
            deaths[d.name] = [t for t in deaths[d.name] if now - t < RESTART_WINDOW_S] + [now]
            if _read_pid(me) != os.getpid():
                break  # cluster down is stopping everything
            if len(deaths[d.name]) > MAX_RESTARTS:
                log.error("daemon %s (pid %d) died %d times within %.0f s: leaving it down",
                          d.name, pid, len(deaths[d.name]), RESTART_WINDOW_S)
                pidfiles[d.name].unlink(missing_ok=True)
                continue
            log.warning("daemon %s (pid %d) died; restarting it (%d of %d within %.0f s)",
                        d.name, pid, len(deaths[d.name]), MAX_RESTARTS, RESTART_WINDOW_S)
            children[d.name] = _spawn(d, sdir, emu)
            try:
                log.info("daemon %s: %s", d.name, _await_healthy(d, children[d.name], security, sdir, emu, timeout_s))
            except HpipeError as e:
                log.error("daemon %s did not come back: %s", d.name, e)
        time.sleep(poll_s)
    log.info("supervisor of %s stops", cluster.name)


def down(cluster: ClusterSpec, timeout_s: float = 15.0) -> dict[str, str]:
    sdir = state_dir(cluster)
    status = {}
    pids = {}
    sup = _read_pid(sdir / SUPERVISOR_PID)
    (sdir / SUPERVISOR_PID).unlink(missing_ok=True)  # first: it must not restart what stops now
    if sup and _pid_alive(sup):
        os.kill(sup, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        while _pid_alive(sup) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _pid_alive(sup):
            os.kill(sup, signal.SIGKILL)
        status["supervisor"] = f"stopped (pid {sup})"
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
    from runtime.cluster.emulate import Emulation

    for item in Emulation(cluster, sdir).teardown():
        status[f"emulation {item}"] = "removed"
    return status


def status(cluster: ClusterSpec) -> list[dict]:
    from runtime.wire.messages import pb

    security = Security.of(cluster)
    rows = []
    for d in cluster.daemons:
        client = DaemonClient(d.address, security, d.name)
        row = {"name": d.name, "address": d.address, "device": d.device, "healthy": client.health(timeout=2.0)}
        if row["healthy"]:
            try:
                st = client.call("Status", pb.StatusRequest(), timeout=5.0)
                row.update(model=st.model, units=[[st.stages[i].unit_start, st.stages[i].unit_end] for i in st.held]
                           if st.loaded else None, open_sequences=st.open_sequences, kv_bytes=st.kv_bytes,
                           replay_bytes=st.replay_bytes, weight_bytes=st.weight_bytes)
            except Exception as e:  # noqa: BLE001 - report, do not fail the whole table
                row["error"] = str(e)
        client.close()
        rows.append(row)
    return rows
