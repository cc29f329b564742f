"""Emulated heterogeneity on one machine: the profile sees a throttled device and a shaped link.

Needs root, iproute2 (network namespaces, veth, tc) and cgroup CPU quotas; skipped where any is
missing. CI runs as root, so it runs there.
"""

import os
import subprocess
from pathlib import Path

import pytest

from hpipe.core.cluster import ClusterSpec
from hpipe.core.errors import HpipeError
from profiler.measure import profile_cluster
from runtime.cluster import emulate, launcher
from tests.cluster_helpers import discard_state

UNAVAILABLE = emulate.unavailable()


CLUSTER = """name: emu-test
daemons:
  - name: fast
    address: 198.18.0.31:50191
    device: cpu
    threads: 1
    emulate: {cpus: "0", rate: 100mbit}
  - name: slow
    address: 198.18.0.32:50192
    device: cpu
    threads: 1
    emulate: {cpus: "1", cpu_quota: 0.4}
"""


@pytest.mark.skipif(UNAVAILABLE is not None, reason=UNAVAILABLE or "")
def test_profile_sees_throttled_device_and_shaped_link(tmp_path, smollm2):
    path = tmp_path / "emu.yaml"
    path.write_text(CLUSTER)
    cluster = ClusterSpec.load(path)
    status = launcher.up(cluster)
    try:
        assert "worker thread" in status["slow"] or "process" in status["slow"], status
        profile = profile_cluster(cluster, "smollm2-135m", smollm2.config, max_len=512, repeats=3)
    finally:
        down = launcher.down(cluster)
    fast, slow = profile.daemon("fast"), profile.daemon("slow")
    # a 40% quota: the slow device's MLP takes about 2.5x as long (measured 2.5-2.9x on a 2-core VM)
    ratio = slow.compute["mlp"].time(256, 0, 1) / fast.compute["mlp"].time(256, 0, 1)
    assert 1.8 < ratio < 4.0, ratio
    shaped = profile.link("fast", "slow").bandwidth_Bps
    assert abs(shaped - 12.5e6) / 12.5e6 < 0.15, shaped  # 100 Mbit/s
    # a host's link bounds what comes in too: slow (no rate of its own) sends to fast at fast's rate
    into_fast = profile.link("slow", "fast").bandwidth_Bps
    assert abs(into_fast - 12.5e6) / 12.5e6 < 0.15, into_fast
    # cluster down removed what up created
    assert any(k.startswith("emulation hp-") for k in down), down
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "hp-fast" not in namespaces and "hp-slow" not in namespaces
    assert not any(Path(p).exists() for p in ("/sys/fs/cgroup/cpu/hpipe/emu-test-slow", "/sys/fs/cgroup/hpipe/emu-test-slow"))
    discard_state(cluster)


def test_emulation_settings_are_checked(tmp_path, monkeypatch):
    def load(text):
        p = tmp_path / "c.yaml"
        p.write_text(text)
        return ClusterSpec.load(p)

    with pytest.raises(HpipeError, match="daemons.0.emulate.turbo: not a key hpipe knows here"):
        load("daemons:\n  - {name: a, address: '127.0.0.1:1', emulate: {turbo: 2}}\n")
    with pytest.raises(HpipeError, match="daemons.0.emulate.cpu_quota: Input should be a valid number"):
        load("daemons:\n  - {name: a, address: '127.0.0.1:1', emulate: {cpu_quota: fast}}\n")
    gpu_on_cpu = load("daemons:\n  - {name: a, address: '127.0.0.1:1', emulate: {gpu_share: 50}}\n")
    with pytest.raises(HpipeError, match="gpu_share needs a CUDA device"):
        emulate.validate(gpu_on_cpu)
    link_on_loopback = load("daemons:\n  - {name: a, address: '127.0.0.1:1', emulate: {rate: 1gbit}}\n")
    with pytest.raises(HpipeError, match="needs an address in 198.18.0.0/24"):
        emulate.validate(link_on_loopback)
    mixed = load("daemons:\n  - {name: a, address: '127.0.0.1:1'}\n  - {name: b, address: '198.18.0.40:1'}\n")
    with pytest.raises(HpipeError, match="put every daemon"):
        emulate.validate(mixed)
    # MPS shares need no root; CPU quotas and emulated hosts do, and say so
    mps = load("daemons:\n  - {name: a, address: '127.0.0.1:1', device: 'cuda:0', emulate: {gpu_share: 30}}\n")
    assert not emulate.needs_root(mps)
    quota = load("daemons:\n  - {name: a, address: '127.0.0.1:1', emulate: {cpu_quota: 0.5}}\n")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(HpipeError, match="needs root"):
        emulate.require_root(quota)
    emulate.require_root(mps)


def test_a_quota_the_threads_cannot_exceed_is_not_applied(tmp_path):
    """A whole core for a one-thread daemon: a cgroup would only add throttling at period edges."""
    path = tmp_path / "c.yaml"
    path.write_text("daemons:\n  - {name: a, address: '198.18.0.41:1', threads: 1, emulate: {cpus: '0', cpu_quota: 1.0}}\n")
    emu = emulate.Emulation(ClusterSpec.load(path), tmp_path)
    assert emu.limit_cpu(emu.cluster.daemons[0], os.getpid()) == "100% of a core: no quota needed for 1 thread(s)"
    assert emu.record.read()["cgroups"] == []  # nothing created, nothing to remove


@pytest.mark.skipif(UNAVAILABLE is not None, reason=UNAVAILABLE or "")
def test_a_namespace_set_up_again_gets_the_link_the_file_says_now(tmp_path):
    """`cluster up` again over an emulated host an earlier one left (an `up` that failed half-way,
    or a cluster file edited since): its link is shaped as the file says now, not left as it was."""
    def host(emulate_line: str) -> emulate.Emulation:
        path = tmp_path / "c.yaml"
        path.write_text(f"daemons:\n  - {{name: reshape, address: '198.18.0.46:1', emulate: {{{emulate_line}}}}}\n")
        return emulate.Emulation(ClusterSpec.load(path), tmp_path)

    def qdiscs() -> str:
        inside = subprocess.run(["ip", "netns", "exec", "hp-reshape", "tc", "qdisc", "show", "dev", "hpereshape"],
                                capture_output=True, text=True).stdout
        outside = subprocess.run(["tc", "qdisc", "show", "dev", "hpvreshape"], capture_output=True, text=True).stdout
        return inside + outside

    emu = host("rate: 100mbit")
    try:
        emu.setup_network()
        assert qdiscs().count("rate 100Mbit") == 2  # each way
        host("rate: 40mbit").setup_network()
        shaped = qdiscs()
        assert shaped.count("rate 40Mbit") == 2 and "100Mbit" not in shaped, shaped
        host("cpus: '0'").setup_network()
        assert "tbf" not in qdiscs()
    finally:
        removed = emu.teardown()
    assert "hp-reshape" in removed
