"""The supervisor ``hpipe cluster up`` starts: it restarts a daemon of the cluster that dies, a
bounded number of times, until ``hpipe cluster down`` stops it (it logs to ``supervisor.log``)."""

from __future__ import annotations

import logging
import os
import subprocess
import time

from hpipe.core.cluster import ClusterSpec
from hpipe.core.errors import HpipeError
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
)
from runtime.wire.channels import Security

log = logging.getLogger(__name__)


def supervise(cluster: ClusterSpec, poll_s: float = 0.1, timeout_s: float = 180.0) -> None:
    """Restart the cluster's daemons that die, while ``cluster up`` stands: until ``cluster down``
    removes the supervisor's pid file, or no daemon pid file is left. A daemon that dies
    :data:`MAX_RESTARTS` times within :data:`RESTART_WINDOW_S` is left down (and logged)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    sdir = state_dir(cluster)
    me = sdir / SUPERVISOR_PID
    security = Security.of(cluster)
    emu = emulation(cluster, sdir)
    children: dict[str, subprocess.Popen] = {}  # the daemons it restarted (its children: reaped here)
    deaths: dict[str, list[float]] = {d.name: [] for d in cluster.daemons}
    log.info("supervising %s (%d daemons)", cluster.name, len(cluster.daemons))
    while read_pid(me) == os.getpid():
        pidfiles = {d.name: sdir / f"{d.name}.pid" for d in cluster.daemons}
        if not any(p.exists() for p in pidfiles.values()):
            break
        for d in cluster.daemons:
            pid = read_pid(pidfiles[d.name])
            if not pid:
                continue
            child = children.get(d.name)
            alive = child.poll() is None if child is not None and child.pid == pid else pid_alive(pid)
            if alive:
                continue
            now = time.monotonic()
            deaths[d.name] = [t for t in deaths[d.name] if now - t < RESTART_WINDOW_S] + [now]
            if read_pid(me) != os.getpid():
                break  # cluster down is stopping everything
            if len(deaths[d.name]) > MAX_RESTARTS:
                log.error("daemon %s (pid %d) died %d times within %.0f s: leaving it down",
                          d.name, pid, len(deaths[d.name]), RESTART_WINDOW_S)
                pidfiles[d.name].unlink(missing_ok=True)
                continue
            log.warning("daemon %s (pid %d) died; restarting it (%d of %d within %.0f s)",
                        d.name, pid, len(deaths[d.name]), MAX_RESTARTS, RESTART_WINDOW_S)
            children[d.name] = spawn(d, sdir, emu)
            try:
                log.info("daemon %s: %s", d.name, await_healthy(d, children[d.name], security, sdir, emu, timeout_s))
            except HpipeError as e:
                log.error("daemon %s did not come back: %s", d.name, e)
        time.sleep(poll_s)
    log.info("supervisor of %s stops", cluster.name)
