"""Emulated hosts: a network namespace per daemon in 198.18.0.0/24, joined to a bridge by a veth
pair, its link shaped with ``tc`` (``rate``: tbf each way; ``delay_ms``: netem on the way out).
Needs root."""

from __future__ import annotations

import ipaddress
import logging
import re
import subprocess

from hpipe.core.cluster import ClusterSpec, DaemonSpec
from hpipe.core.errors import HpipeError
from runtime.cluster.emulate.state import State, run

log = logging.getLogger(__name__)

EMULATED_NET = ipaddress.ip_network("198.18.0.0/24")
BRIDGE, BRIDGE_IP = "hpbr0", "198.18.0.1"


def in_emulated_net(host: str) -> bool:
    try:
        return ipaddress.ip_address(host) in EMULATED_NET
    except ValueError:
        return False


def names(d: DaemonSpec) -> tuple[str, str, str]:
    tag = _tag(d.name)
    return f"hp-{d.name}", f"hpv{tag}", f"hpe{tag}"


def _tag(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9]", "", name)[:9] or "d"


def setup_network(cluster: ClusterSpec, record: State) -> None:
    """One network namespace per emulated host, on a bridge, its uplink shaped with tc."""
    netns = [d for d in cluster.daemons if in_emulated_net(d.host)]
    if not netns:
        return
    state = record.read()
    if subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True).returncode != 0:
        run("ip", "link", "add", BRIDGE, "type", "bridge")
        run("ip", "addr", "add", f"{BRIDGE_IP}/24", "dev", BRIDGE)
        state["bridge"] = True
    run("ip", "link", "set", BRIDGE, "up")
    for d in netns:
        ns, host_if, ns_if = names(d)
        if ns not in state["netns"]:
            run("ip", "netns", "add", ns)
            state["netns"].append(ns)
            record.write(state)
            run("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
            run("ip", "link", "set", ns_if, "netns", ns)
            run("ip", "link", "set", host_if, "master", BRIDGE, "up")
            inside = ("ip", "netns", "exec", ns)
            run(*inside, "ip", "addr", "add", f"{d.host}/24", "dev", ns_if)
            run(*inside, "ip", "link", "set", ns_if, "up")
            run(*inside, "ip", "link", "set", "lo", "up")
            run(*inside, "ip", "route", "add", "default", "via", BRIDGE_IP)
        # shaped each time: a namespace an earlier `up` left (one that failed half-way, or a
        # cluster file edited since) gets the link the file says now
        shape(d)
    record.write(state)


def shape(d: DaemonSpec) -> None:
    """``d``'s link as its ``rate`` and ``delay_ms`` say (none: unshaped), replacing what it had."""
    ns, host_if, ns_if = names(d)
    inside = ("ip", "netns", "exec", ns)
    for cmd in ((*inside, "tc", "qdisc", "del", "dev", ns_if, "root"), ("tc", "qdisc", "del", "dev", host_if, "root")):
        subprocess.run(cmd, capture_output=True)  # nothing to delete on a new link
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
        burst = f"{_burst_kbit(str(rate))}kbit"
        run(*inside, "tc", "qdisc", "add", "dev", ns_if, *parent, "handle", "2:", "tbf", "rate", str(rate),
            "burst", burst, "latency", "100ms")
        # and what comes in: a host's link bounds its downloads too (weights a coordinator
        # sends it, activations from the stage before), as a real NIC does
        run("tc", "qdisc", "add", "dev", host_if, "root", "tbf", "rate", str(rate), "burst", burst,
            "latency", "100ms")
    log.info("emulated host %s at %s (rate %s, delay %s ms)", d.name, d.host, rate, delay)


def _burst_kbit(rate: str) -> int:
    """A token bucket for ``rate`` (validated: like ``100mbit``) that lets it through at full
    speed: 4 ms of it (the kernel refills the bucket about every tick; at 1 Gbit/s a 256 kbit bucket
    passed 0.3-0.5 of the rate), at least 256 kbit."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)", rate)
    bits = float(m.group(1)) * {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m.group(2)]
    return max(256, int(bits * 0.004 / 1e3))


def namespace_prefix(d: DaemonSpec) -> list[str]:
    """The command prefix that runs a process in ``d``'s namespace (none for a daemon not in one)."""
    return ["ip", "netns", "exec", names(d)[0]] if in_emulated_net(d.host) else []


def teardown(state: dict) -> list[str]:
    removed = []
    for ns in state.get("netns", []):
        # the veth pair first: deleting one end deletes both at once, while a deleted namespace
        # takes its end with it only when the kernel gets to it (a cluster brought up again at once
        # found the old pair's name still taken)
        subprocess.run(["ip", "link", "del", f"hpv{_tag(ns.removeprefix('hp-'))}"], capture_output=True)
        if subprocess.run(["ip", "netns", "del", ns], capture_output=True).returncode == 0:
            removed.append(ns)
    if state.get("bridge"):
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)
        removed.append(BRIDGE)
    return removed
