"""Emulated heterogeneity on one Linux machine: CPU quotas, shaped links, GPU shares.

A daemon's ``emulate`` settings in a cluster file:

```yaml
  - name: slow
    address: 198.18.0.13:50163   # an emulated host: its own network namespace
    emulate: {cpus: "1", cpu_quota: 0.3, rate: 1gbit, delay_ms: 0.2}
```

- ``cpus`` pins the daemon to those cores; ``cpu_quota`` caps its device worker at that fraction
  of one core (:mod:`runtime.cluster.emulate.cpu`, root).
- A daemon whose address lies in 198.18.0.0/24 (RFC 2544's benchmarking range: hosts this machine
  creates itself) runs in its own network namespace; ``rate`` and ``delay_ms`` shape its uplink
  (:mod:`runtime.cluster.emulate.net`, root). The coordinator reaches the namespaces through a bridge.
- ``gpu_share`` (a CUDA daemon; percent) makes it a CUDA MPS client limited to that share of the
  GPU (:mod:`runtime.cluster.emulate.mps`, no root).

Everything created is recorded in the cluster's state folder and removed by ``cluster down``.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from hpipe.core.cluster import ClusterSpec, DaemonSpec
from hpipe.core.errors import HpipeError
from runtime.cluster.emulate import cpu, mps, net
from runtime.cluster.emulate.cpu import QUOTA_PERIOD_US, WORKER_THREAD_NAME, name_this_thread
from runtime.cluster.emulate.mps import uses_mps
from runtime.cluster.emulate.net import BRIDGE_IP, EMULATED_NET, in_emulated_net
from runtime.cluster.emulate.state import State

__all__ = ["QUOTA_PERIOD_US", "WORKER_THREAD_NAME", "Emulation", "in_emulated_net", "name_this_thread", "needed",
           "needs_root", "require_root", "unavailable", "uses_mps", "validate"]


def needed(cluster: ClusterSpec) -> bool:
    return any(d.emulate or in_emulated_net(d.host) for d in cluster.daemons)


def validate(cluster: ClusterSpec) -> None:
    """What spans settings (each one's type and range: hpipe.core.schemas.Emulate, at load)."""
    for d in cluster.daemons:
        if ("rate" in d.emulate or "delay_ms" in d.emulate) and not in_emulated_net(d.host):
            raise HpipeError(f"daemon {d.name}: link emulation needs an address in {EMULATED_NET} (its own "
                             f"network namespace), not {d.host}")
        if in_emulated_net(d.host) and d.host == BRIDGE_IP:
            raise HpipeError(f"daemon {d.name}: {BRIDGE_IP} is the bridge's address")
        if d.emulate.get("gpu_share") is not None and not d.device.startswith("cuda"):
            raise HpipeError(f"daemon {d.name}: gpu_share needs a CUDA device, not {d.device}")
    netns = [d for d in cluster.daemons if in_emulated_net(d.host)]
    if netns and len(netns) != len(cluster.daemons):
        raise HpipeError("daemons in emulated network namespaces cannot reach loopback daemons: put every daemon "
                         f"of the cluster in {EMULATED_NET}, or none")


def needs_root(cluster: ClusterSpec) -> bool:
    """CPU quotas (cgroups) and emulated hosts (network namespaces, tc) need root; MPS does not."""
    return any("cpu_quota" in d.emulate or in_emulated_net(d.host) for d in cluster.daemons)


def unavailable() -> str | None:
    """Why this machine cannot emulate CPU quotas and shaped links, or None if it can."""
    import shutil
    import uuid

    if os.geteuid() != 0:
        return "needs root"
    if not all(shutil.which(t) for t in ("ip", "tc", "taskset")):
        return "needs ip, tc and taskset (iproute2, util-linux)"
    if not (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").exists() or Path("/sys/fs/cgroup/cgroup.controllers").exists()):
        return "needs cgroup CPU quotas"
    probe = f"hpprobe{uuid.uuid4().hex[:6]}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "cannot create network namespaces here"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def require_root(cluster: ClusterSpec) -> None:
    if needs_root(cluster) and os.geteuid() != 0:
        raise HpipeError("this cluster emulates devices or links (cgroups, network namespaces, tc), which needs "
                         "root; run as root, or use a cluster file without 'emulate' (e.g. clusters/local-3.yaml)")


class Emulation:
    """Creates and removes the emulated network, GPU shares and CPU limits of one cluster."""

    def __init__(self, cluster: ClusterSpec, state_dir: Path):
        self.cluster = cluster
        self.record = State(state_dir)

    def setup_network(self) -> None:
        net.setup_network(self.cluster, self.record)

    def setup_mps(self) -> None:
        mps.setup_mps(self.cluster, self.record)

    def daemon_env(self, d: DaemonSpec) -> dict[str, str]:
        return mps.daemon_env(self.cluster, self.record, d)

    def command_prefix(self, d: DaemonSpec) -> list[str]:
        return net.namespace_prefix(d) + cpu.pin_prefix(d)

    def limit_cpu(self, d: DaemonSpec, pid: int, timeout_s: float = 30.0) -> str:
        return cpu.limit_cpu(self.cluster, self.record, d, pid, timeout_s)

    def teardown(self) -> list[str]:
        state = self.record.read()
        removed = cpu.teardown(state) + net.teardown(state) + mps.teardown(state)
        self.record.remove()
        return removed
