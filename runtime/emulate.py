"""Emulated heterogeneity on one Linux machine (root): CPU quotas and shaped links.

A daemon's ``emulate`` settings in a cluster file:

```yaml
  - name: slow
    address: 198.18.0.13:50163   # an emulated host: its own network namespace
    emulate: {cpus: "1", cpu_quota: 0.3, rate: 1gbit, delay_ms: 0.2}
```

- ``cpus`` pins the daemon to those cores (``taskset``); ``cpu_quota`` caps its *device* at that
  fraction of one core with a cgroup CPU quota: on cgroup v1 only the daemon's worker thread (the
  one that runs every slice and every profiling measurement) joins the group, so the emulated
  device is slow while its network stack is not, and links are what ``tc`` makes them, the two
  separate resources the planner models. On cgroup v2 (no per-thread groups outside threaded
  mode) the whole daemon joins. The quota period is 5 ms, shorter than one unit's forward: with
  the kernel's default 100 ms a 30 ms matrix product fits inside one period's budget and runs at
  full speed, so a 60% daemon would time as if it were unthrottled for short work and 60% for
  long work (measured: 1.2x instead of 1.7x).
- A daemon whose address lies in 198.18.0.0/24 (RFC 2544's benchmarking range: hosts this
  machine creates itself) runs in its own network namespace, joined to a bridge ``hpbr0``
  (198.18.0.1) by a veth pair; ``rate`` (tc tbf) and ``delay_ms`` (tc netem) shape everything it
  sends, i.e. its uplink. The coordinator reaches the namespaces through the bridge.

- ``gpu_share`` (a CUDA daemon; percent) makes the daemon a CUDA MPS client limited to that share
  of the GPU's SMs (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``), so daemons of different speeds share
  one GPU concurrently. ``cluster up`` starts an MPS control daemon whose pipe and log folders
  live in the cluster's state directory, and points every CUDA daemon of the cluster at it.
  Measured on an H100: two 50% clients each ran at about 61% of full speed at once, a 25% client
  at about a third. MPS needs no root; CPU quotas and network namespaces do.

Everything created is recorded in the cluster's state directory and removed by ``cluster down``.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import subprocess
from pathlib import Path

from hpipe.errors import HpipeError
from runtime.cluster import ClusterSpec, DaemonSpec

log = logging.getLogger(__name__)

EMULATED_NET = ipaddress.ip_network("198.18.0.0/24")
BRIDGE, BRIDGE_IP = "hpbr0", "198.18.0.1"
KEYS = {"cpus", "cpu_quota", "rate", "delay_ms", "gpu_share"}
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


def _find_thread(pid: int, name: str, timeout_s: float) -> int | None:
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


def in_emulated_net(host: str) -> bool:
    try:
        return ipaddress.ip_address(host) in EMULATED_NET
    except ValueError:
        return False


def needed(cluster: ClusterSpec) -> bool:
    return any(d.emulate or in_emulated_net(d.host) for d in cluster.daemons)


def validate(cluster: ClusterSpec) -> None:
    for d in cluster.daemons:
        unknown = set(d.emulate) - KEYS
        if unknown:
            raise HpipeError(f"daemon {d.name}: unknown emulate settings {sorted(unknown)} (known: {sorted(KEYS)})")
        if ("rate" in d.emulate or "delay_ms" in d.emulate) and not in_emulated_net(d.host):
            raise HpipeError(f"daemon {d.name}: link emulation needs an address in {EMULATED_NET} (its own "
                             f"network namespace), not {d.host}")
        if in_emulated_net(d.host) and d.host == BRIDGE_IP:
            raise HpipeError(f"daemon {d.name}: {BRIDGE_IP} is the bridge's address")
        share = d.emulate.get("gpu_share")
        if share is not None:
            if not d.device.startswith("cuda"):
                raise HpipeError(f"daemon {d.name}: gpu_share needs a CUDA device, not {d.device}")
            if not 0 < _number(d, "gpu_share", share) <= 100:
                raise HpipeError(f"daemon {d.name}: gpu_share is a percentage in (0, 100], got {share}")
        q = d.emulate.get("cpu_quota")
        if q is not None and not 0 < _number(d, "cpu_quota", q) <= 64:
            raise HpipeError(f"daemon {d.name}: cpu_quota must be a positive fraction of a core, got {q}")
        if d.emulate.get("rate") and not re.match(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit)$", str(d.emulate["rate"])):
            raise HpipeError(f"daemon {d.name}: rate {d.emulate['rate']!r} is not like 100mbit or 1gbit")
    netns = [d for d in cluster.daemons if in_emulated_net(d.host)]
    if netns and len(netns) != len(cluster.daemons):
        raise HpipeError("daemons in emulated network namespaces cannot reach loopback daemons: put every daemon "
                         f"of the cluster in {EMULATED_NET}, or none")


def _number(d: DaemonSpec, key: str, value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise HpipeError(f"daemon {d.name}: {key} must be a number, got {value!r}") from None


def needs_root(cluster: ClusterSpec) -> bool:
    """CPU quotas (cgroups) and emulated hosts (network namespaces, tc) need root; MPS does not."""
    return any("cpu_quota" in d.emulate or in_emulated_net(d.host) for d in cluster.daemons)


def uses_mps(cluster: ClusterSpec) -> bool:
    return any("gpu_share" in d.emulate for d in cluster.daemons)


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


def _run(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise HpipeError(f"emulation step failed: {' '.join(cmd)}: {r.stderr.strip()}")


def _names(d: DaemonSpec) -> tuple[str, str, str]:
    tag = re.sub(r"[^a-zA-Z0-9]", "", d.name)[:9] or "d"
    return f"hp-{d.name}", f"hpv{tag}", f"hpe{tag}"


class Emulation:
    """Creates and removes the emulated network and CPU limits of one cluster; state in a JSON file."""

    def __init__(self, cluster: ClusterSpec, state_dir: Path):
        self.cluster = cluster
        self.state_file = state_dir / "emulation.json"

    def _state(self) -> dict:
        return json.loads(self.state_file.read_text()) if self.state_file.exists() else {"netns": [], "cgroups": []}

    def _save(self, state: dict) -> None:
        self.state_file.write_text(json.dumps(state))

    def setup_network(self) -> None:
        netns = [d for d in self.cluster.daemons if in_emulated_net(d.host)]
        if not netns:
            return
        state = self._state()
        if subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True).returncode != 0:
            _run("ip", "link", "add", BRIDGE, "type", "bridge")
            _run("ip", "addr", "add", f"{BRIDGE_IP}/24", "dev", BRIDGE)
            state["bridge"] = True
        _run("ip", "link", "set", BRIDGE, "up")
        for d in netns:
            ns, host_if, ns_if = _names(d)
            if ns in state["netns"]:
                continue
            _run("ip", "netns", "add", ns)
            state["netns"].append(ns)
            self._save(state)
            _run("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
            _run("ip", "link", "set", ns_if, "netns", ns)
            _run("ip", "link", "set", host_if, "master", BRIDGE, "up")
            inside = ("ip", "netns", "exec", ns)
            _run(*inside, "ip", "addr", "add", f"{d.host}/24", "dev", ns_if)
            _run(*inside, "ip", "link", "set", ns_if, "up")
            _run(*inside, "ip", "link", "set", "lo", "up")
            _run(*inside, "ip", "route", "add", "default", "via", BRIDGE_IP)
            rate, delay = d.emulate.get("rate"), d.emulate.get("delay_ms")
            parent = ("root",)
            if delay:
                r = subprocess.run([*inside, "tc", "qdisc", "add", "dev", ns_if, "root", "handle", "1:", "netem",
                                    "delay", f"{float(delay)}ms"], capture_output=True, text=True)
                if r.returncode != 0:
                    raise HpipeError(f"daemon {d.name}: delay_ms needs tc netem, which this kernel lacks "
                                     f"({r.stderr.strip()}); remove delay_ms (rate works without it)")
                parent = ("parent", "1:")
            if rate:
                _run(*inside, "tc", "qdisc", "add", "dev", ns_if, *parent, "handle", "2:", "tbf", "rate", str(rate),
                     "burst", "256kbit", "latency", "100ms")
            log.info("emulated host %s at %s (rate %s, delay %s ms)", d.name, d.host, rate, delay)
        self._save(state)

    # --- GPU shares (CUDA MPS) ------------------------------------------------------------------
    def _mps_env(self) -> dict[str, str]:
        base = self.state_file.parent / "mps"
        return {"CUDA_MPS_PIPE_DIRECTORY": str(base / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(base / "log")}

    def setup_mps(self) -> None:
        """Start this cluster's MPS control daemon, unless it already runs."""
        if not uses_mps(self.cluster):
            return
        env = self._mps_env()
        state = self._state()
        if state.get("mps") and Path(env["CUDA_MPS_PIPE_DIRECTORY"], "control").exists():
            return
        for folder in env.values():
            Path(folder).mkdir(parents=True, exist_ok=True)
        try:
            r = subprocess.run(["nvidia-cuda-mps-control", "-d"], env={**os.environ, **env}, capture_output=True,
                               text=True, timeout=30)
        except FileNotFoundError:
            raise HpipeError("gpu_share needs CUDA MPS, but nvidia-cuda-mps-control is not on this machine's PATH; "
                             "remove gpu_share to run the daemons without it") from None
        if r.returncode != 0:
            raise HpipeError(f"could not start the CUDA MPS control daemon: {(r.stderr or r.stdout).strip()}")
        state["mps"] = env
        self._save(state)
        log.info("MPS control daemon started (pipe %s)", env["CUDA_MPS_PIPE_DIRECTORY"])

    def daemon_env(self, d: DaemonSpec) -> dict[str, str]:
        """Environment a daemon starts with: MPS pipe and share for CUDA daemons of an MPS cluster."""
        if not (uses_mps(self.cluster) and d.device.startswith("cuda")):
            return {}
        env = self._mps_env()
        if "gpu_share" in d.emulate:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(d.emulate["gpu_share"])
        return env

    def _stop_mps(self, state: dict) -> list[str]:
        env = state.get("mps")
        if not env:
            return []
        try:
            subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", env={**os.environ, **env},
                           capture_output=True, text=True, timeout=30)
        except (FileNotFoundError, subprocess.TimeoutExpired) as e:
            log.warning("could not stop the MPS control daemon: %s", e)
            return []
        return ["mps control daemon"]

    def command_prefix(self, d: DaemonSpec) -> list[str]:
        prefix = []
        if in_emulated_net(d.host):
            prefix += ["ip", "netns", "exec", _names(d)[0]]
        if d.emulate.get("cpus") is not None:
            prefix += ["taskset", "-c", str(d.emulate["cpus"])]
        return prefix

    def limit_cpu(self, d: DaemonSpec, pid: int, timeout_s: float = 30.0) -> str:
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
        state = self._state()
        period = QUOTA_PERIOD_US
        v1 = Path("/sys/fs/cgroup/cpu")
        if (v1 / "cpu.cfs_quota_us").exists():
            group = v1 / "hpipe" / f"{self.cluster.name}-{d.name}"
            group.mkdir(parents=True, exist_ok=True)
            (group / "cpu.cfs_period_us").write_text(str(period))
            (group / "cpu.cfs_quota_us").write_text(str(int(float(quota) * period)))
        else:
            group = Path("/sys/fs/cgroup") / "hpipe" / f"{self.cluster.name}-{d.name}"
            group.mkdir(parents=True, exist_ok=True)
            (group / "cpu.max").write_text(f"{int(float(quota) * period)} {period}")
        if str(group) not in state["cgroups"]:
            state["cgroups"].append(str(group))
        self._save(state)
        if (group / "tasks").exists():  # v1: the device thread alone
            tid = _find_thread(pid, WORKER_THREAD_NAME, timeout_s)
            if tid is not None:
                (group / "tasks").write_text(str(tid))
                return f"worker thread {tid} at {float(quota):.0%} of a core"
            log.warning("daemon %s: no %s thread found; limiting the whole process", d.name, WORKER_THREAD_NAME)
        (group / "cgroup.procs").write_text(str(pid))
        return f"process {pid} at {float(quota):.0%} of a core"

    def teardown(self) -> list[str]:
        state = self._state()
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
        for ns in state.get("netns", []):
            if subprocess.run(["ip", "netns", "del", ns], capture_output=True).returncode == 0:
                removed.append(ns)  # deleting the namespace deletes its veth pair
        if state.get("bridge"):
            subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)
            removed.append(BRIDGE)
        removed += self._stop_mps(state)
        self.state_file.unlink(missing_ok=True)
        return removed
