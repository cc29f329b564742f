"""Start and stop real daemon processes for tests, on free loopback ports."""

import socket
import textwrap
from pathlib import Path

from runtime import launcher
from runtime.cluster import ClusterSpec


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def write_cluster(directory: Path, n: int, *, name="test", extra_top="", extra_daemon="") -> Path:
    ports = free_ports(n)
    daemons = "".join(
        f"  - name: s{i}\n    address: 127.0.0.1:{p}\n    device: cpu\n    threads: 1\n{extra_daemon}"
        for i, p in enumerate(ports))
    path = directory / f"{name}.yaml"
    path.write_text(f"name: {name}\n{extra_top}daemons:\n{daemons}")
    return path


class RunningCluster:
    def __init__(self, path: Path):
        self.path = path
        self.spec = ClusterSpec.load(path)

    def __enter__(self):
        launcher.up(self.spec)
        return self

    def __exit__(self, *exc):
        launcher.down(self.spec)
