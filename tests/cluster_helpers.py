"""Daemons for tests: real processes on free loopback ports, or in-process servers."""

import random
import shutil
import socket
import tempfile
from pathlib import Path

from hpipe.app.daemon import build
from hpipe.core.cluster import ClusterSpec, DaemonOptions, DaemonSpec
from runtime.cluster import launcher
from runtime.wire.channels import DaemonClient, Security


def free_ports(n):
    """``n`` free loopback ports below the kernel's ephemeral range: a daemon starting up binds its
    data port from that range, and must not take a port another daemon is about to bind."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports: list[int] = []
    while len(ports) < n:
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


def write_cluster(directory: Path, n: int, *, name="test", extra_top="", extra_daemon="") -> Path:
    ports = free_ports(n)
    daemons = "".join(
        f"  - name: s{i}\n    address: 127.0.0.1:{p}\n    device: cpu\n    threads: 1\n{extra_daemon}"
        for i, p in enumerate(ports))
    path = directory / f"{name}.yaml"
    # tests load their tiny models from temporary directories
    path.write_text(f"name: {name}\nmodel_dirs: [{tempfile.gettempdir()}]\n{extra_top}daemons:\n{daemons}")
    return path


class RunningCluster:
    def __init__(self, path: Path):
        self.path = path
        self.spec = ClusterSpec.load(path)

    def __enter__(self):
        launcher.up(self.spec)
        return self

    def __exit__(self, exc_type, *exc):
        launcher.down(self.spec)
        if exc_type is None:
            discard_state(self.spec)


def discard_state(spec: ClusterSpec) -> None:
    """Remove a test cluster's folder of pid files and daemon logs. ``hpipe cluster down`` keeps
    them for post-mortems; a passing test has none to do, and every temporary cluster file has its
    own folder, so they would pile up in the user's cache."""
    shutil.rmtree(launcher.state_dir(spec), ignore_errors=True)


class Served:
    """An in-process daemon on a free loopback port (with the profiler, as ``hpipe daemon`` serves)."""

    def __init__(self, name: str = "d", token: str | None = None, tls_cert=None, tls_key=None, port: int = 0, **kw):
        self.name = name
        if token is not None:
            with tempfile.NamedTemporaryFile("w", suffix=".token", delete=False) as f:
                f.write(token)
            kw["token_file"] = Path(f.name)
        if tls_cert:
            kw.update(tls_cert=Path(tls_cert), tls_key=Path(tls_key))
        kw.setdefault("model_dirs", tempfile.gettempdir())  # tests' tiny models live in temporary directories
        self.server, self.stage, port = build(DaemonOptions(name=name, port=port, **kw))
        self.server.start()
        self.address = f"127.0.0.1:{port}"

    def client(self, security=Security()):
        return DaemonClient(self.address, security)

    def spec(self) -> DaemonSpec:
        return DaemonSpec.at(self.name, self.address, device=str(self.stage.device))

    def stop(self):
        self.stage.shutdown()
        self.server.stop(0)


def cluster_of(*served: Served) -> ClusterSpec:
    return ClusterSpec("in-process", tuple(s.spec() for s in served))


def daemon_pid(cluster: RunningCluster, name: str) -> int:
    """The pid of daemon ``name`` of a cluster ``hpipe cluster up`` started (its supervisor's latest)."""
    return int((launcher.state_dir(cluster.spec) / f"{name}.pid").read_text())
