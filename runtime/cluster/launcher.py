"""``hpipe cluster up|down|status``: run the daemons of a cluster whose addresses are on this machine.

Each daemon is a separate process (its own session, log file and pid file under the cache
directory), so it can be killed, throttled or restarted on its own like a real device. A
supervisor process, started by ``up`` and stopped first by ``down``, restarts a daemon that dies
(a bounded number of times, logged in ``supervisor.log`` there); a coordinator whose pipeline broke
then finds it serving again and redeploys (:mod:`runtime.coordinator.recovery`).
"""

from __future__ import annotations

import logging
import subprocess
import sys

from hpipe.core.cluster import ClusterSpec
from hpipe.core.errors import HpipeError
from hpipe.core.retry import poll
from runtime.cluster.processes import (
    MAX_RESTARTS,
    RESTART_WINDOW_S,
    SUPERVISOR_PID,
    await_healthy,
    emulation,
    pid_alive,
    read_pid,
    spawn,
    state_dir,
    stop_all,
)
from runtime.wire.channels import DaemonClient, Security

log = logging.getLogger(__name__)


def up(cluster: ClusterSpec, timeout_s: float = 180.0, restart: bool = True) -> dict[str, str]:
    """Start every local daemon that is not already serving; wait until all are healthy. With
    ``restart``, a supervisor process (:mod:`runtime.cluster.supervisor`) then restarts any that dies."""
    from runtime.cluster import emulate

    remote = [d.name for d in cluster.daemons if not (d.is_local or d.ssh or emulate.in_emulated_net(d.host))]
    if remote:
        raise HpipeError(f"cluster up starts daemons on this machine, or over SSH where an entry says how (ssh: "
                         f"user@host); start {', '.join(remote)} on their machines with `hpipe daemon` (`hpipe daemon "
                         "--print-systemd-unit` writes a unit that restarts it), or give them ssh:")
    security = Security.of(cluster)
    sdir = state_dir(cluster)
    emu = emulation(cluster, sdir)
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
        if d.ssh:
            status[d.name] = _start_remote(cluster, d, security, timeout_s)
            continue
        started[d.name] = spawn(d, sdir, emu)
    try:
        for name, proc in started.items():
            status[name] = await_healthy(cluster.daemon(name), proc, security, sdir, emu, timeout_s)
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
    if restart and cluster.path is not None and not pid_alive(read_pid(sdir / SUPERVISOR_PID)):
        logf = open(sdir / "supervisor.log", "ab")
        sup = subprocess.Popen([sys.executable, "-m", "hpipe", "cluster", "supervise", str(cluster.path)],
                               stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               start_new_session=True)
        logf.close()
        (sdir / SUPERVISOR_PID).write_text(f"{sup.pid}\n")
        status["supervisor"] = f"running (pid {sup.pid}): restarts a daemon that dies, {MAX_RESTARTS} times " \
                               f"in {RESTART_WINDOW_S // 60:.0f} min at most"
    return status


def down(cluster: ClusterSpec, timeout_s: float = 15.0) -> dict[str, str]:
    sdir = state_dir(cluster)
    status = {}
    pids = {}
    sup = read_pid(sdir / SUPERVISOR_PID)
    (sdir / SUPERVISOR_PID).unlink(missing_ok=True)  # first: it must not restart what stops now
    if sup and pid_alive(sup):
        stop_all([sup], 5.0)
        status["supervisor"] = f"stopped (pid {sup})"
    for d in cluster.daemons:
        if d.ssh:
            status[d.name] = _stop_remote(cluster, d)
            continue
        pidf = sdir / f"{d.name}.pid"
        if not pidf.exists():
            status[d.name] = "not started by hpipe"
            continue
        pid = int(pidf.read_text())
        if pid_alive(pid):
            pids[d.name] = pid
        else:
            status[d.name] = "not running"
        pidf.unlink()
    killed = stop_all(list(pids.values()), timeout_s)
    for name, pid in pids.items():
        status[name] = f"killed (pid {pid}, no exit after SIGTERM)" if pid in killed else f"stopped (pid {pid})"
    from runtime.cluster.emulate import Emulation

    for item in Emulation(cluster, sdir).teardown():
        status[f"emulation {item}"] = "removed"
    return status


def _start_remote(cluster: ClusterSpec, d, security: Security, timeout_s: float) -> str:
    """Start daemon ``d`` on its machine over SSH (:mod:`runtime.cluster.remote`); wait until healthy."""
    from runtime.cluster.remote import Remote

    remote = Remote(d, cluster.name)
    client = DaemonClient(d.address, security, d.name)
    try:
        remote.check_version()
        how = remote.start(cluster.token_file)
        if not poll(lambda: client.health(timeout=1.0), timeout_s, 0.3):
            raise HpipeError(f"daemon {d.name} ({d.address}) not healthy after {timeout_s:.0f}s; its log on "
                             f"{remote.to}:\n{remote.log_tail()}")
        return how
    finally:
        client.close()
        remote.close()


def _stop_remote(cluster: ClusterSpec, d) -> str:
    from runtime.cluster.remote import Remote

    try:
        remote = Remote(d, cluster.name)
    except HpipeError as e:
        return str(e)
    try:
        return remote.stop()
    finally:
        remote.close()


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
